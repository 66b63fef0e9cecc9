"""Developer tool (GPU): launch plans of the batch-1 query/key launch (`triton_decode_qk.launch_plan`: R_K columns
per program and warps), timed as whole CUDA-graph decode steps, the plans in turn in one process
(docs/data/decode-qk-plan-h100.txt). Qwen3-4B shape by default, random weights, batch 1, INT2 (Hadamard).

    PYTHONPATH=src:scripts python scripts/probe_decode_qk_plan.py [--contexts 100000] [--plans 32x4,16x1,8x1]
"""
import sys

import torch

sys.path.insert(0, "scripts")
import oscarkv  # noqa: E402
from check_static_decode import ablation_arguments, alternating_step_ms, print_ablation  # noqa: E402
from oscarkv.kernels import triton_decode_qk  # noqa: E402
from oscarkv.models import load_model  # noqa: E402

args = ablation_arguments(plans="32x4,16x1")
shipped = triton_decode_qk.launch_plan


def using(columns: int, warps: int):
    def plan(rows: int, d: int) -> tuple[int, int, int]:
        return (1, min(d, columns), warps) if rows == 1 else shipped(rows, d)

    def use():
        triton_decode_qk.launch_plan = plan
    return use


variants = {p: using(*map(int, p.split("x"))) for p in args.plans.split(",")}
model, _ = load_model(args.model, device="cuda", dtype=torch.bfloat16)
torch.manual_seed(0)
for ctx in (int(c) for c in args.contexts.split(",")):
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, ctx), device="cuda")
    oscarkv.patch(model, method="hadamard")
    print_ablation(args, ctx, "hadamard", alternating_step_ms(model, prompt, variants, reps=2))
triton_decode_qk.launch_plan = shipped
