"""Developer tool (GPU): the static decode step with the cache write's flush and write in one launch for
decode steps (`triton_write.launch_write`, merge=True) against two launches (merge=False), alternating
in one process, three times each (docs/data/write-launch-ablation-h100.txt). Qwen3-4B shape by default,
random weights, batch 1, INT2 (Hadamard) cache; ms per graph step.

    PYTHONPATH=src:scripts python scripts/probe_write_launch_ablation.py [--model random:qwen3-4b] [--contexts 100000,30000]
"""
import sys

import torch

sys.path.insert(0, "scripts")
import oscarkv  # noqa: E402
from check_static_decode import ablation_arguments, alternating_step_ms, print_ablation  # noqa: E402
from oscarkv.kernels import triton_write  # noqa: E402
from oscarkv.models import load_model  # noqa: E402

args = ablation_arguments()
now = triton_write.launch_write


def using(**options):
    """Put `launch_write` with `options` in place, whatever its callers pass."""
    def use():
        triton_write.launch_write = lambda *a, **kw: now(*a, **{**kw, **options})
    return use


VARIANTS = {"one launch": using(), "two launches": using(merge=False)}

model, _ = load_model(args.model, device="cuda", dtype=torch.bfloat16)
torch.manual_seed(0)
oscarkv.patch(model, method="hadamard")
for ctx in (int(c) for c in args.contexts.split(",")):
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, ctx), device="cuda")
    times = alternating_step_ms(model, prompt, VARIANTS)
    triton_write.launch_write = now
    print_ablation(args, ctx, "hadamard", times)
