"""Developer tool (GPU): warps per program of a decode step's merged flush-and-write launch
(`triton_write.DECODE_WRITE_WARPS`), timed as whole CUDA-graph decode steps (one step in 64 flushes a page), the
choices in turn in one process. Qwen3-4B shape by default, random weights, batch 1, INT2 (Hadamard).

    PYTHONPATH=src:scripts python scripts/probe_write_warps.py [--contexts 100000] [--warps 4,1,2,8]
"""
import sys

import torch

sys.path.insert(0, "scripts")
import oscarkv  # noqa: E402
from check_static_decode import ablation_arguments, alternating_step_ms, print_ablation  # noqa: E402
from oscarkv.kernels import triton_write  # noqa: E402
from oscarkv.models import load_model  # noqa: E402

args = ablation_arguments(warps="4,1,2,8")
shipped = triton_write.DECODE_WRITE_WARPS


def using(warps: int):
    def use():
        triton_write.DECODE_WRITE_WARPS = warps
    return use


variants = {f"{w} warps": using(int(w)) for w in args.warps.split(",")}
model, _ = load_model(args.model, device="cuda", dtype=torch.bfloat16)
torch.manual_seed(0)
for ctx in (int(c) for c in args.contexts.split(",")):
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, ctx), device="cuda")
    oscarkv.patch(model, method="hadamard")
    print_ablation(args, ctx, "hadamard", alternating_step_ms(model, prompt, variants, reps=2))
triton_write.DECODE_WRITE_WARPS = shipped
