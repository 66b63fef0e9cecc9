"""Developer tool (GPU): where a prefill's time goes, BF16 cache against INT2, by kernel (torch profiler).
Times `bench decode`'s prefill (`benchmarks.decode.prefill_run`, best of three after a warm-up), then profiles one
more forward of the same prompt per cache and prints the CUDA kernels that take the most time, with the step's
wall time and its summed kernel time (the rest is the host or gaps between launches). With --host, it profiles the
host instead (cProfile over --repeats forwards of prompts fed in --chunk-token chunks, as `serve` feeds them) and
prints the Python functions that take the most time of their own and in all:

    PYTHONPATH=src python scripts/profile_prefill.py [--model random:smollm2-135m] [--tokens 4096] [--top 12]
        [--host [--chunk 512] [--repeats 3]]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from oscarkv.benchmarks.decode import _patch, prefill_run, release_memory
from oscarkv.integrations.static_decode import forward_slots, slot_cache_for
from oscarkv.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:smollm2-135m")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--host", action="store_true", help="profile the host (cProfile) instead of the kernels")
    parser.add_argument("--chunk", type=int, default=0, help="with --host: prompt tokens per forward (0: all)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, _ = load_model(args.model, device="cuda", dtype=torch.bfloat16)
    if args.host:
        for name in ("bf16", "int2"):
            host_profile(model, name, args.tokens, args.chunk or args.tokens, args.repeats, args.top)
        return
    for name in ("bf16", "int2"):
        timed = prefill_run(model, name, args.tokens, repeats=3)
        cache, prompt = prompt_runner(model, name, args.tokens, args.tokens)
        prompt()  # warm
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = prompt()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernel_ms = sum(e.self_device_time_total for e in events) / 1e3
        print(f"== {name}: prefill {timed.ms:.1f} ms (best of 3); profiled forward {wall:.1f} ms wall, "
              f"{kernel_ms:.1f} ms in kernels, {len(events)} kernel names")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:args.top]:
            print(f"  {e.self_device_time_total / 1e3:8.2f} ms  {e.count:6d}x  {e.key[:110]}")
        if not events:  # a profiler that files kernels under their operators
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.top))
        del cache
        release_memory()


def prompt_runner(model, name: str, tokens: int, chunk: int):
    """(the slot cache, prompt()): the model patched with cache `name`; prompt() reads one random prompt of
    `tokens` tokens into an empty slot, `chunk` tokens a forward, and returns its wall time in ms."""
    release_memory()
    _patch(model, name)
    cache = slot_cache_for(model, 1, tokens + 1)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device="cuda")

    def prompt() -> float:
        slot = cache.open(tokens + 1)
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.inference_mode():
            for first in range(0, tokens, chunk):
                forward_slots(model, cache, [slot], ids[:, first:first + chunk])
        torch.cuda.synchronize()
        cache.close(slot)
        return (time.perf_counter() - started) * 1e3

    return cache, prompt


def host_profile(model, name: str, tokens: int, chunk: int, repeats: int, top: int) -> None:
    """cProfile of `repeats` prompts of `tokens` tokens, fed `chunk` tokens a forward, after two unprofiled."""
    cache, prompt = prompt_runner(model, name, tokens, chunk)
    plain = min(prompt() for _ in range(2))
    profiler = cProfile.Profile()
    profiler.enable()
    profiled = [prompt() for _ in range(repeats)]
    profiler.disable()
    print(f"== {name}: {tokens} tokens in chunks of {chunk}: {plain:.1f} ms a prompt (best of 2), "
          f"{min(profiled):.1f} ms under cProfile; {repeats} prompts profiled")
    stats = pstats.Stats(profiler)
    for key in ("tottime", "cumulative"):
        print(f"-- by {key}")
        stats.sort_stats(key).print_stats(top)
    del cache
    release_memory()


if __name__ == "__main__":
    main()
