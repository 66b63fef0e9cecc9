"""Developer tool (GPU): where the window launch's time goes in one layer's decode step (`ops.attend_step`, the
shipped plan): windows launched second and merging the splits (shipped), second with a combine launch, first with a
combine launch, and no window launch at all (history and combine only: a wrong answer); alternating, best of three
CUDA-graph timings. Qwen3 shapes (32 query / 8 KV heads, D 128).

    PYTHONPATH=src python scripts/probe_window_launch.py 32x32768,64x8192"""
import sys

import torch

from oscarkv.benchmarks.attention import _time_us, copy_bandwidth_gbs, decode_bytes, decode_case
from oscarkv.kernels import gluon_history, reference, triton_attention
from oscarkv.kernels.ops import attend_step, choose_splits

shipped = triton_attention.launch_attention
shipped_kernel = triton_attention._paged_attention_kernel


class _NoWindows:
    def __getitem__(self, grid):
        return lambda *args, **kw: None if kw.get("REGIONS") == 2 else shipped_kernel[grid](*args, **kw)


VARIANTS = {"merged": {}, "combine": dict(merge=False), "windows_first": dict(merge=False, window_first=True),
            "no_windows": dict(merge=False)}
copy = copy_bandwidth_gbs(torch.device("cuda"))
for spec in sys.argv[1].split(","):
    batch, context = (int(x) for x in spec.split("x"))
    case = decode_case(batch, context)
    gluon = gluon_history.takes(case.layer, case.step, 32, 0, case.q.device)
    splits = choose_splits(case.layer, batch, 1, 32, context, case.q.device, gluon=gluon)
    ref = reference.attention_reference(case.layer, case.step, case.q, case.k_new, case.v_new, 128 ** -0.5).float()
    out = torch.zeros_like(case.q)
    work = (torch.empty(batch, 32, splits, 128, dtype=torch.float32, device="cuda"),
            torch.empty(batch, 32, splits, dtype=torch.float32, device="cuda"))

    def make(name):
        options = VARIANTS[name]
        def fn():
            triton_attention.launch_attention = lambda *a, **kw: shipped(*a, **{**kw, **options})
            if name == "no_windows":
                triton_attention._paged_attention_kernel = _NoWindows()
            try:
                attend_step(case.layer, case.step, case.q, case.k_new, case.v_new, 128 ** -0.5, num_splits=splits,
                            out=out, workspace=work, validate=False)
            finally:
                triton_attention.launch_attention = shipped
                triton_attention._paged_attention_kernel = shipped_kernel
        return fn

    fns = {name: make(name) for name in VARIANTS}
    times = {name: [] for name in VARIANTS}
    errs = {}
    for rnd in range(3):
        for name, fn in fns.items():
            out.zero_()
            fn(); torch.cuda.synchronize()
            errs[name] = (out.float() - ref).abs().max().item()
            times[name].append(_time_us(fn))
    nbytes = decode_bytes(case, context)
    print(f"{spec:>10} splits {splits:3d}: " + "  ".join(
        f"{name} {min(t):6.1f} us ({nbytes / min(t) / 1e3 / copy:5.1%}, err {errs[name]:.0e})" for name, t in times.items()),
        flush=True)
    case = None
    torch.cuda.empty_cache()
