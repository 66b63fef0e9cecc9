"""Developer tool (GPU): decode steps whose window programs bring the output projection's weight into the L2 cache
while the history programs run, against steps without, alternating in one process. Qwen3-4B shape by default,
random weights, INT2 (Hadamard); ms per CUDA-graph step.

    PYTHONPATH=src:scripts python scripts/probe_l2_prefetch.py [--contexts 100000,30000] [--batch 1]
"""
import sys

import torch

sys.path.insert(0, "scripts")
import oscarkv  # noqa: E402
from check_static_decode import ablation_arguments, alternating_step_ms, print_ablation  # noqa: E402
from oscarkv.integrations import decode_attention  # noqa: E402
from oscarkv.models import load_model  # noqa: E402

args = ablation_arguments()


def prefetching(on: bool):
    def use():
        decode_attention.L2_PREFETCH = on
    return use


model, _ = load_model(args.model, device="cuda", dtype=torch.bfloat16)
torch.manual_seed(0)
for ctx in (int(c) for c in args.contexts.split(",")):
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, ctx), device="cuda")
    oscarkv.patch(model, method="hadamard")
    print_ablation(args, ctx, "hadamard", alternating_step_ms(model, prompt, {"none": prefetching(False),
                                                                               "o_proj": prefetching(True)}))
