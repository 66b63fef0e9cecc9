"""Developer tool (GPU): a conversation's second turn, and prompts with a common start, with and without prefix
reuse, in process.

    PYTHONPATH=src python scripts/probe_prefix_reuse.py [--method hadamard] [--conversations 8]
        [--prompt 8192] [--reply 128] [--follow-up 512] [--prefill-chunk 2048] [--scenario turns|common-start]

One engine over a random Qwen3-4B (speed only), warmed up, running its own thread as `oscarkv serve` does.
For each setting of `EngineConfig.prefix_reuse` (the engine's config is swapped between runs; the retained
caches are freed first): `--conversations` first turns of `--prompt` random token ids, each answered with
`--reply` tokens; once all are done, every second turn at once: the first turn's prompt, its reply and
`--follow-up` new tokens. Prints, per turn, when the last request got its first token and when the last
finished (seconds after the turn was sent), and how many prompt tokens the engine read or took from a
retained cache.

--scenario common-start: a first request of `--prompt` tokens (a system prompt) and `--follow-up` of its own
runs alone; then `--conversations` - 1 requests with the same start and other ends of `--follow-up` tokens
arrive at once.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from dataclasses import replace

import torch

from oscarkv.random_models import random_model
from oscarkv.serving.build import build_engine
from oscarkv.serving.engine import EngineConfig, SamplingParams


def run_turn(engine, prompts: list[list[int]], reply: int) -> tuple[dict, list[list[int]]]:
    """Send every prompt at once; (timings, each request's generated tokens)."""
    first: dict[int, float] = {}
    done = threading.Event()
    finished: list[int] = []
    lock = threading.Lock()
    start = time.perf_counter()

    def emit_for(index: int):
        def emit(event) -> None:
            with lock:
                first.setdefault(index, time.perf_counter() - start)
                if event.kind in ("done", "error"):
                    finished.append(index)
                    if len(finished) == len(prompts):
                        done.set()
        return emit

    before = (engine.counters.prompt_tokens, engine.counters.reused_tokens)
    seqs = [engine.submit(p, SamplingParams(max_tokens=reply, ignore_eos=True), emit_for(i))
            for i, p in enumerate(prompts)]
    done.wait(timeout=600)
    timings = dict(last_first_token_s=round(max(first.values()), 3), all_done_s=round(time.perf_counter() - start, 3),
                   prompt_tokens_read=engine.counters.prompt_tokens - before[0],
                   prompt_tokens_reused=engine.counters.reused_tokens - before[1])
    return timings, [s.generated for s in seqs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", default="hadamard")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--reply", type=int, default=128)
    parser.add_argument("--follow-up", type=int, default=512)
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--scenario", choices=("turns", "common-start"), default="turns")
    args = parser.parse_args()
    device = torch.device("cuda")
    model, tokenizer = random_model("random:qwen3-4b", device, torch.bfloat16)
    context = args.prompt + 2 * args.reply + args.follow_up + 64
    config = EngineConfig(max_seqs=args.conversations, max_context=context, prefill_chunk=args.prefill_chunk)
    engine = build_engine(model, tokenizer, args.method, config=config)
    engine.eos_ids = set()
    engine.warm_up()
    engine.start()
    rng = random.Random(0)
    vocab = model.config.vocab_size
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.method}, {args.conversations} "
          f"conversations of {args.prompt} + {args.reply} + {args.follow_up} + {args.reply} tokens")
    try:
        for reuse in (False, True, False, True):
            engine.config = replace(config, prefix_reuse=reuse)
            engine.forget_prefixes()  # engine idle between turns, so this thread may
            if args.scenario == "common-start":
                start = [rng.randrange(vocab) for _ in range(args.prompt)]
                prompts = [start + [rng.randrange(vocab) for _ in range(args.follow_up)]
                           for _ in range(args.conversations)]
                first, _ = run_turn(engine, prompts[:1], args.reply)
                rest, _ = run_turn(engine, prompts[1:], args.reply)
                print(json.dumps(dict(prefix_reuse=reuse, first=first, rest=rest)), flush=True)
                continue
            firsts = [[rng.randrange(vocab) for _ in range(args.prompt)] for _ in range(args.conversations)]
            turn1, replies = run_turn(engine, firsts, args.reply)
            seconds = [p + r + [rng.randrange(vocab) for _ in range(args.follow_up)] for p, r in zip(firsts, replies)]
            turn2, _ = run_turn(engine, seconds, args.reply)
            print(json.dumps(dict(prefix_reuse=reuse, turn1=turn1, turn2=turn2)), flush=True)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
