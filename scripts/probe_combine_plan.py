"""Developer tool (GPU): the split combine's launch plan (channels per program, `ops.COMBINE_CHANNELS`, and warps,
`triton_attention.COMBINE_WARPS`), timed as whole CUDA-graph decode steps, the plans in turn in one process.
Qwen3-4B shape by default, random weights, batch 1, INT2 (Hadamard).

    PYTHONPATH=src:scripts python scripts/probe_combine_plan.py [--contexts 100000] [--plans 32x4,16x4,32x8]
"""
import sys

import torch

sys.path.insert(0, "scripts")
import oscarkv  # noqa: E402
from check_static_decode import ablation_arguments, alternating_step_ms, print_ablation  # noqa: E402
from oscarkv.kernels import ops, triton_attention  # noqa: E402
from oscarkv.models import load_model  # noqa: E402

args = ablation_arguments(plans="32x4,16x4,32x8")
shipped = ops.COMBINE_CHANNELS, triton_attention.COMBINE_WARPS


def using(channels: int, warps: int):
    def use():
        ops.COMBINE_CHANNELS, triton_attention.COMBINE_WARPS = channels, warps
    return use


variants = {p: using(*map(int, p.split("x"))) for p in args.plans.split(",")}
model, _ = load_model(args.model, device="cuda", dtype=torch.bfloat16)
torch.manual_seed(0)
for ctx in (int(c) for c in args.contexts.split(",")):
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, ctx), device="cuda")
    oscarkv.patch(model, method="hadamard")
    print_ablation(args, ctx, "hadamard", alternating_step_ms(model, prompt, variants, reps=2))
ops.COMBINE_CHANNELS, triton_attention.COMBINE_WARPS = shipped
