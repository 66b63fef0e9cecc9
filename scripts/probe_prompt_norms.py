"""Developer probe (GPU): prompts with the model's RMSNorms eager against the Triton norm kernel, same process.

`forward_slots` runs a prompt's known RMSNorms and residual adds as oscarkv's Triton kernel where the model's
CacheConfig compiles the small operations (`integrations.norms`, "Prompts"). This times whole prompts both ways,
alternating, for each cache, prompt length and chunk length (as `serve` feeds them), best of --rounds:

    PYTHONPATH=src python scripts/probe_prompt_norms.py [--model random:qwen3-4b] [--prompts 8192/2048,8192/8192,32768/32768]
        [--rounds 3]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from profile_prefill import prompt_runner  # noqa: E402

from oscarkv.benchmarks.decode import release_memory  # noqa: E402
from oscarkv.integrations import static_decode  # noqa: E402
from oscarkv.models import load_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:qwen3-4b")
    parser.add_argument("--prompts", default="8192/2048,8192/8192,32768/32768", help="tokens/chunk, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model, _ = load_model(args.model, device="cuda", dtype=torch.bfloat16)
    asks = static_decode.compiles_small_ops
    print(f"{args.model}, {torch.cuda.get_device_name()}; ms a prompt, best of {args.rounds} (alternating)")
    for spec in args.prompts.split(","):
        tokens, chunk = (int(x) for x in spec.split("/"))
        for name in ("bf16", "int2"):
            cache, prompt = prompt_runner(model, name, tokens, chunk)
            best = {False: float("inf"), True: float("inf")}
            try:
                for round_ in range(args.rounds + 1):
                    for kernel in (False, True):
                        static_decode.compiles_small_ops = (lambda m, k=kernel: k and asks(m))
                        ms = prompt()
                        if round_:  # the first round compiles and warms up
                            best[kernel] = min(best[kernel], ms)
            finally:
                static_decode.compiles_small_ops = asks
                del cache
                release_memory()
            print(f"  {name:4s} {tokens:6d} tokens in chunks of {chunk:6d}: eager norms {best[False]:8.1f}  "
                  f"Triton norms {best[True]:8.1f}  ({best[False] / best[True]:.3f}x)", flush=True)


if __name__ == "__main__":
    main()
