"""Developer tool (GPU): the static decode step with the attention's queries and keys prepared in one launch
(`integrations/decode_attention.py`) against the five launches it replaces (q/k norms, rotary, query
rotation), alternating in one process, three times each (docs/data/decode-qk-ablation-h100.txt).
Qwen3-4B shape by default, random weights, batch 1, INT2 (Hadamard) and BF16 caches; ms per graph step.

    PYTHONPATH=src:scripts python scripts/probe_decode_qk_ablation.py [--model random:qwen3-4b] [--contexts 100000,30000]
"""
import contextlib
import sys

import torch

sys.path.insert(0, "scripts")
import oscarkv  # noqa: E402
from check_static_decode import ablation_arguments, alternating_step_ms, print_ablation  # noqa: E402
from oscarkv.integrations import static_decode  # noqa: E402
from oscarkv.models import load_model  # noqa: E402

args = ablation_arguments()
fused = static_decode.fused_decode_attention


@contextlib.contextmanager
def off(model, enabled=True):
    yield


def using(fn):
    def use():
        static_decode.fused_decode_attention = fn
    return use


model, _ = load_model(args.model, device="cuda", dtype=torch.bfloat16)
torch.manual_seed(0)
for ctx in (int(c) for c in args.contexts.split(",")):
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, ctx), device="cuda")
    for method in ("hadamard", "bf16"):
        oscarkv.patch(model, method=method)
        times = alternating_step_ms(model, prompt, {"one launch": using(fused), "five launches": using(off)})
        static_decode.fused_decode_attention = fused
        print_ablation(args, ctx, method, times)
