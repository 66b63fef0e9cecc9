"""Time the serving engine's decode step in process (no HTTP) for the BF16 and the INT2 slot caches.

python scripts/profile_serve_step.py [--model random:qwen3-4b] [--clients 32] [--prompt-tokens 8192] [--profile]
                                    [--cuda-graphs on|off|both]

With --cuda-graphs both, each method runs with and without the per-batch-size CUDA graphs, and the
greedy tokens of the timed steps must be equal between the two.
"""

import argparse
import gc
import json
import time

import torch

from oscarkv.models import load_model
from oscarkv.serving.build import build_engine
from oscarkv.serving.engine import EngineConfig, SamplingParams


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:qwen3-4b")
    parser.add_argument("--methods", default="bf16,hadamard")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--cuda-graphs", choices=("on", "off", "both"), default="on")
    args = parser.parse_args()
    results = []
    graph_settings = {"on": [True], "off": [False], "both": [False, True]}[args.cuda_graphs]
    for method, graphs in [(m, g) for m in args.methods.split(",") for g in graph_settings]:
        model, tokenizer = load_model(args.model)
        config = EngineConfig(max_seqs=args.clients, max_context=args.prompt_tokens + 4 * args.steps + 64,
                              prefill_chunk=args.prompt_tokens, cuda_graphs=graphs)
        engine = build_engine(model, tokenizer, method, config=config)
        engine.eos_ids = set()
        started = time.perf_counter()
        engine.warm_up()
        warm_up_s = time.perf_counter() - started
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(0)
        for _ in range(args.clients):
            prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=g).tolist()
            engine.submit(prompt, SamplingParams(max_tokens=4 * args.steps), lambda e: None)
        torch.cuda.synchronize()
        t = time.perf_counter()
        while any(s.reading_prompt for s in engine._running) or engine._waiting:
            engine.step()
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        step = (time.perf_counter() - t) / args.steps
        tokens = [list(seq.generated) for seq in engine._running]
        forward = []
        for _ in range(5):
            seqs = list(engine._running)
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.inference_mode():
                engine._forward([s.slot for s in seqs], [[s.generated[-1]] for s in seqs])
            torch.cuda.synchronize()
            forward.append(time.perf_counter() - t)
            for s in seqs:
                s.generated.append(s.generated[-1])
        row = {"method": method, "cuda_graphs": graphs, "clients": args.clients, "prompt_tokens": args.prompt_tokens,
               "warm_up_s": round(warm_up_s, 1), "prefill_s": round(prefill, 2), "step_ms": round(1000 * step, 2),
               "forward_ms": round(1000 * min(forward), 2), "tokens_per_s": round(args.clients / step, 1),
               "kv_gib": round(engine.cache.usage().bytes_total / 2**30, 2)}
        previous = results[-1] if results and results[-1]["method"] == method else None
        if previous is not None:
            row["tokens_equal_to_previous"] = previous["tokens"] == tokens
        print(json.dumps(row), flush=True)
        row["tokens"] = tokens
        results.append(row)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    engine.step()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))
        del engine, model
        gc.collect()  # the cache and its layers refer to each other
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
