"""Developer probe (GPU): time to first token of one prompt read alone by `serve`'s engine, by chunk length.

The engine runs in this process, stepped from this thread (no HTTP), over a random model, with the BF16 cache and
the INT2 cache (hadamard method) in turn. For each `--solo` chunk length (prompt tokens a forward while no request
is decoding; `--chunk` while one is) it warms the engine up, then submits one prompt of each `--prompts` length at
a time and times submit -> first token, best of `--repeats`, with the GPU memory the prompt took at its peak
beyond what was allocated before it:

    PYTHONPATH=src python scripts/probe_serve_prefill.py [--model random:qwen3-4b] [--prompts 8192 16384]
        [--chunk 2048] [--solo 2048 8192] [--repeats 3]
"""
from __future__ import annotations

import argparse
import time

import torch

from oscarkv.benchmarks.decode import release_memory
from oscarkv.models import load_model
from oscarkv.serving.build import build_engine
from oscarkv.serving.engine import EngineConfig, SamplingParams


def first_token_ms(engine, prompt: list[int]) -> float:
    """Submit `prompt` (one token to generate) to an idle engine, step it until idle; ms to its first event (the
    first token)."""
    seen: list[float] = []
    engine.submit(prompt, SamplingParams(max_tokens=1),
                  lambda event: seen.append(time.perf_counter()) if not seen else None)
    torch.cuda.synchronize()
    started = time.perf_counter()
    while engine.step():
        pass
    return (seen[0] - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:qwen3-4b")
    parser.add_argument("--prompts", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--solo", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, device="cuda")
    vocabulary = model.config.vocab_size
    for method in ("bf16", "hadamard"):
        for solo in args.solo:
            config = EngineConfig(max_seqs=4, max_context=max(args.prompts) + 64, prefill_chunk=args.chunk,
                                  solo_prefill_chunk=solo, prefix_reuse=False)
            engine = build_engine(model, tokenizer, method, config=config)
            assert engine.warm_up()
            for tokens in args.prompts:
                times = []
                for repeat in range(args.repeats):
                    prompt = torch.randint(0, vocabulary, (tokens,),
                                           generator=torch.Generator().manual_seed(repeat)).tolist()
                    torch.cuda.synchronize()
                    before = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    times.append(first_token_ms(engine, prompt))
                    peak = torch.cuda.max_memory_allocated() - before
                print(f"{method:8s} chunk {args.chunk} alone {engine.solo_prefill_chunk:5d}: {tokens:6d}-token prompt, "
                      f"first token {min(times):7.1f} ms (best of {args.repeats}; all {', '.join(f'{t:.0f}' for t in times)}),"
                      f" peak {peak / 2**20:6.0f} MiB over the memory before", flush=True)
            del engine
            release_memory()


if __name__ == "__main__":
    main()
