"""Developer tool (GPU): time one decode step of the INT2 attention (`ops.attend_step`, the launch plan that
`oscarkv bench attention` times) on benchmark shapes, for A/B runs of two versions of the kernels in fresh
processes:

    for i in 1 2 3; do
        PYTHONPATH=old/src python scripts/probe_decode_ab.py before 1x131072,32x32768
        PYTHONPATH=src python scripts/probe_decode_ab.py after 1x131072,32x32768
    done

One line per shape: best of three CUDA-graph timings (µs), the fraction of the measured copy bandwidth, and the
max abs error against the torch reference."""
import sys

import torch

from oscarkv.benchmarks.attention import _time_us, copy_bandwidth_gbs, decode_bytes, decode_case
from oscarkv.kernels import reference
from oscarkv.kernels.ops import attend_step, choose_splits

label, shapes = sys.argv[1], sys.argv[2]
copy = copy_bandwidth_gbs(torch.device("cuda"))
for shape in shapes.split(","):
    batch, context = (int(x) for x in shape.split("x"))
    case = decode_case(batch, context)
    layer, step, q, k, v = case.layer, case.step, case.q, case.k_new, case.v_new
    scale = 128 ** -0.5
    splits = choose_splits(layer, batch, 1, 32, context, q.device)
    out = torch.empty_like(q)
    workspace = (torch.empty(batch, 32, splits, 128, dtype=torch.float32, device=q.device),
                 torch.empty(batch, 32, splits, dtype=torch.float32, device=q.device))

    def fn():
        attend_step(layer, step, q, k, v, scale, num_splits=splits, out=out, workspace=workspace, validate=False)

    fn()
    err = (out.float() - reference.attention_reference(layer, step, q, k, v, scale).float()).abs().max().item()
    us = min(_time_us(fn) for _ in range(3))
    nbytes = decode_bytes(case, context)
    print(f"{label:>8} {shape:>9}: {us:7.1f} us  {nbytes / us / 1e3 / copy:6.1%} of copy ({copy:.0f} GB/s)  "
          f"err {err:.1e}", flush=True)
    del case, layer, step, q, k, v, out, workspace
    torch.cuda.empty_cache()
