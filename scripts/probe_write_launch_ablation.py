"""Developer tool (GPU): the static decode step with the cache write's flush and write in one launch for
decode steps (`triton_write.launch_write`, merge=True) against two launches (merge=False), alternating
in one process, three times each (docs/data/write-launch-ablation-h100.txt). Qwen3-4B shape by default,
random weights, batch 1, INT2 (Hadamard) cache; ms per graph step.

    PYTHONPATH=src:scripts python scripts/probe_write_launch_ablation.py [--model random:qwen3-4b] [--contexts 100000,30000]
"""
import argparse
import gc
import sys

import torch

sys.path.insert(0, "scripts")
import oscarkv  # noqa: E402
from check_static_decode import step_ms  # noqa: E402
from oscarkv.kernels import triton_write  # noqa: E402
from oscarkv.models import load_model  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="random:qwen3-4b")
parser.add_argument("--contexts", default="100000,30000")
parser.add_argument("--batch", type=int, default=1)
args = parser.parse_args()
now = triton_write.launch_write


def forced(launch, **options):
    """`launch` with `options` whatever the caller passes (functools.partial lets the call override them)."""
    return lambda *a, **kw: launch(*a, **{**kw, **options})


VARIANTS = {"one launch": now, "two launches": forced(now, merge=False)}

model, _ = load_model(args.model, device="cuda", dtype=torch.bfloat16)
torch.manual_seed(0)
oscarkv.patch(model, method="hadamard")
for ctx in (int(c) for c in args.contexts.split(",")):
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, ctx), device="cuda")
    res = {name: [] for name in VARIANTS}
    for rep in range(3):
        for name, which in VARIANTS.items():
            triton_write.launch_write = which
            res[name].append(step_ms(model, prompt, 64, graphs=True))
            gc.collect()
            torch.cuda.empty_cache()
    triton_write.launch_write = now
    print(args.model, args.batch, ctx, "hadamard", {k: [round(v, 3) for v in vs] for k, vs in res.items()}, flush=True)
