"""Developer tool (GPU): where a prefill's time goes, BF16 cache against INT2, by kernel (torch profiler).
Times `bench decode`'s prefill (`benchmarks.decode.prefill_run`, best of three after a warm-up), then profiles one
more prompt per cache (fed in --chunk-token forwards, as `serve` feeds them; default one) and prints the CUDA
kernels that take the most time, with the prompt's wall time and its summed kernel time (the rest is the host or
gaps between launches), and where that prompt made the host wait for the GPU (torch's sync debug mode).
With --host, it profiles the host instead (cProfile over --repeats prompts) and prints the Python functions that take
the most time of their own and in all. With --timers, it times the host inside the cache layers' functions and
Triton's launcher (`TIMED`) without a profiler, over --rounds rounds of both caches in turn:

    PYTHONPATH=src python scripts/profile_prefill.py [--model random:smollm2-135m] [--tokens 4096] [--top 12]
        [--chunk 512] [--host [--repeats 3]] [--timers [--repeats 3] [--rounds 1]]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time
import traceback
import warnings
from collections import Counter

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
    parser.add_argument("--chunk", type=int, default=0, help="prompt tokens per forward (0: all)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timers", action="store_true",
                        help="time the host inside the attention layers' functions (no profiler) instead")
    parser.add_argument("--rounds", type=int, default=1, help="with --timers: rounds of both caches in turn")
    args = parser.parse_args()
    model, _ = load_model(args.model, device="cuda", dtype=torch.bfloat16)
    if args.timers:
        for _ in range(args.rounds):  # the caches in turn, since this host's speed drifts over a run
            for name in ("bf16", "int2"):
                host_timers(model, name, args.tokens, args.chunk or args.tokens, args.repeats)
        return
    if args.host:
        for name in ("bf16", "int2"):
            host_profile(model, name, args.tokens, args.chunk or args.tokens, args.repeats, args.top)
        return
    chunk = args.chunk or args.tokens
    for name in ("bf16", "int2"):
        timed = prefill_run(model, name, args.tokens, repeats=3)
        cache, prompt = prompt_runner(model, name, args.tokens, chunk)
        plain = min(prompt() for _ in range(2))  # the first also warms
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = prompt()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernel_ms = sum(e.self_device_time_total for e in events) / 1e3
        print(f"== {name}: prefill {timed.ms:.1f} ms (best of 3, one forward); {args.tokens} tokens in chunks of "
              f"{chunk}: {plain:.1f} ms (best of 2), profiled {wall:.1f} ms wall, {kernel_ms:.1f} ms in kernels, "
              f"{len(events)} kernel names")
        report_syncs(prompt)
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


def report_syncs(prompt) -> None:
    """Run prompt() once in torch's sync debug mode and print each project or transformers line whose operation
    synchronised with the GPU (torch's "called a synchronizing CUDA operation" warning), with how often it did, and
    the other warnings raised meanwhile. torch.cuda.synchronize() itself (which prompt() calls) is not reported, and
    the mode does not cover every synchronising operation (torch's docs)."""
    sites: Counter[str] = Counter()
    others: Counter[str] = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            others[f"{filename.rsplit('/', 2)[-1]}:{lineno}: {str(message)[:80]}"] += 1
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "oscarkv" in f.filename or "transformers" in f.filename]
        site = frames[-1] if frames else None
        sites[f"{site.filename.rsplit('/', 2)[-1]}:{site.lineno}" if site else f"{filename}:{lineno}"] += 1

    shown, torch_mode = warnings.showwarning, torch.cuda.get_sync_debug_mode()
    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        prompt()
    finally:
        torch.cuda.set_sync_debug_mode(torch_mode)
        warnings.showwarning = shown
    print(f"  synchronising operations: {sum(sites.values())}" + "".join(
        f"\n    {count:5d}x  {site}" for site, count in sites.most_common(8)) + "".join(
        f"\n  other warning {count}x: {text}" for text, count in others.most_common(3)))


# Functions whose host time --timers reports ("module:qualified name"; inclusive: a function's time holds the
# time of those it calls). The cache layers' entry points, what they call, and every Triton launch.
TIMED = ("transformers.modeling_layers:GradientCheckpointingLayer.__call__",
         "oscarkv.integrations.slots:DenseSlotLayer.update", "oscarkv.integrations.slots:DenseSlotLayer.attend",
         "oscarkv.integrations.paged:PagedOscarLayer.update", "oscarkv.integrations.paged:PagedOscarLayer.attend",
         "oscarkv.integrations.paged:write_step", "oscarkv.integrations.paged:rotate_queries",
         "oscarkv.integrations.paged:attend_step", "oscarkv.kernels.triton_write:launch_write",
         "oscarkv.kernels.triton_write:flush_arguments", "oscarkv.kernels.ops:extend_attention",
         "oscarkv.kernels.extend:stored_kv", "oscarkv.kernels.extend:causal_gqa_attention",
         "oscarkv.integrations.slots:causal_gqa_attention", "oscarkv.integrations.paged:causal_attention",
         "oscarkv.integrations.slots:causal_attention", "oscarkv.cache.paged:PagedKVCache.step",
         "triton.runtime.jit:JITFunction.run")


def host_timers(model, name: str, tokens: int, chunk: int, repeats: int) -> None:
    """Host time per forward inside each of TIMED, summed over the layers, over `repeats` prompts of `tokens`
    tokens fed `chunk` tokens a forward (after one untimed). Each call costs two perf_counter reads, not a
    profiler's per-call hooks, and nothing waits for the GPU."""
    import importlib

    spent: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    restore = []
    for target in TIMED:
        module_name, qualified = target.split(":")
        owner = importlib.import_module(module_name)
        *path, attr = qualified.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, attr)

        def timed(*args, __original=original, __label=qualified, **kwargs):
            started = time.perf_counter()
            try:
                return __original(*args, **kwargs)
            finally:
                spent[__label] += time.perf_counter() - started
                calls[__label] += 1

        setattr(owner, attr, timed)
        restore.append((owner, attr, original))
    cache, prompt = prompt_runner(model, name, tokens, chunk)
    try:
        prompt()
        spent.clear()
        calls.clear()
        walls = [prompt() for _ in range(repeats)]
    finally:
        for owner, attr, original in restore:
            setattr(owner, attr, original)
    forwards = repeats * -(-tokens // chunk)
    print(f"== {name}: {tokens} tokens in chunks of {chunk}: {min(walls):.1f} ms a prompt (best of {repeats}), "
          f"{sum(walls) / forwards:.2f} ms a forward; host ms a forward inside:")
    for label, seconds in sorted(spent.items(), key=lambda item: -item[1]):
        print(f"  {seconds * 1e3 / forwards:8.2f} ms  {calls[label] / forwards:6.1f} calls  {label}")
    del cache
    release_memory()


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
