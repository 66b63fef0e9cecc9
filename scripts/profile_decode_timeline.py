"""Developer tool (GPU): where the time of one graph-replayed decode step goes, overlap included.

`bench decode` fills a cache and times whole CUDA-graph steps; this records the kernels of a few
replays of the same graph (torch.profiler, whose CUPTI trace keeps each kernel of a graph with its
own start and end) and attributes every instant of a step to the oldest kernel still running. A
kernel launched early by programmatic dependent launch, which waits for the one before it, is
therefore charged only for the time after that one ends: the "exposed" column is what the kernel
adds to the step. Instants with no kernel running are charged to "idle".

    PYTHONPATH=src:scripts python scripts/profile_decode_timeline.py [--model random:qwen3-4b] \
        [--context 100000] [--batch 1] [--caches int2,bf16] [--layer 18]

A cache name ending in -centered (int2-centered) runs the INT2 cache as an `oscar` artifact does, key shifts
included (`bench decode --centered`).

Prints, per cache: the step time with and without the profiler, the exposed time and the summed
duration per kernel name over one step, and one decoder layer's kernels in launch order.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from oscarkv.benchmarks.decode import _patch, fill, release_memory
from oscarkv.integrations.static_decode import StaticDecoder, _StepBuffers, fast_step_ops, slot_cache_for
from oscarkv.models import load_model


def exposed_times(events: list[tuple[float, float, str]]) -> tuple[list[float], float]:
    """For kernels (start, end, name) sorted by start: the time each one is the oldest kernel running,
    and the time no kernel runs, between the first start and the last end."""
    exposed = [0.0] * len(events)
    idle = 0.0
    points = sorted({t for s, e, _ in events for t in (s, e)})
    first = 0
    for a, b in zip(points, points[1:]):
        while first < len(events) and events[first][1] <= a:
            first += 1
        owner = next((i for i in range(first, len(events)) if events[i][0] <= a < events[i][1]), None)
        if owner is None:
            idle += b - a
        else:
            exposed[owner] += b - a
    return exposed, idle


def short(name: str) -> str:
    for prefix in ("void ", "triton_"):
        name = name.removeprefix(prefix)
    return name.split("(")[0][:60]


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Mean ms of `replays` back-to-back replays of `graph` (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def step_kernels(model, cache_name: str, batch: int, context: int, replays: int):
    """Kernels (start µs, end µs, name) of the middle replay of `replays`, and the mean step ms with and
    without the profiler."""
    release_memory()
    _patch(model, cache_name.removesuffix("-centered"), centered=cache_name.endswith("-centered"))
    steps = 4 + 2 * replays + 8
    cache = slot_cache_for(model, batch, context + steps + 1)
    slots = [cache.open(context + steps + 1) for _ in range(batch)]
    fill(cache, slots, context)
    first = torch.randint(0, model.config.vocab_size, (batch,), device="cuda")
    buffers = _StepBuffers.create(cache, slots, first, steps)
    cache.set_batch(slots)
    cache.freeze(steps)
    done = 0
    try:
        with torch.inference_mode(), fast_step_ops(model):
            decoder = StaticDecoder(model, cache)
            for _ in range(2):
                decoder._step(buffers)
                done += 1
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                decoder._step(buffers)
        plain_ms = replay_ms(graph, replays)
        done += replays
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            profiled_ms = replay_ms(graph, replays)
        done += replays
    finally:
        cache.thaw(done)
        del cache
        release_memory()
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0),
                     key=lambda k: k[0])
    per_step = len(kernels) // replays
    middle = kernels[(replays // 2) * per_step:(replays // 2 + 1) * per_step]
    return middle, plain_ms, profiled_ms


def report(name: str, kernels, plain_ms: float, profiled_ms: float, layers: int, layer: int) -> None:
    exposed, idle = exposed_times(kernels)
    wall = kernels[-1][1] - kernels[0][0]
    print(f"\n== {name}: step {plain_ms:.3f} ms in graph replays, {profiled_ms:.3f} ms profiled; "
          f"{len(kernels)} kernels, first start to last end {wall / 1e3:.3f} ms, idle {idle:.1f} us")
    totals = defaultdict(lambda: [0, 0.0, 0.0])
    for (s, e, kname), x in zip(kernels, exposed):
        row = totals[short(kname)]
        row[0] += 1
        row[1] += x
        row[2] += e - s
    print(f"  {'kernel':60s} {'count':>5s} {'exposed us':>10s} {'sum of durations us':>20s}")
    for kname, (count, x, dur) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"  {kname:60s} {count:5d} {x:10.1f} {dur:20.1f}")
    per_layer = len(kernels) // layers
    print(f"  one layer ({layer}; about {per_layer} kernels per layer): start offset, duration, exposed, us")
    chunk = range(layer * per_layer, (layer + 1) * per_layer + 2)
    t0 = kernels[chunk[0]][0]
    for i in chunk:
        s, e, kname = kernels[i]
        print(f"  {s - t0:8.1f} {e - s:8.1f} {exposed[i]:8.1f}  {short(kname)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:qwen3-4b")
    parser.add_argument("--context", type=int, default=100000)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--caches", default="int2,bf16")
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--layer", type=int, default=18)
    args = parser.parse_args()
    model, _ = load_model(args.model, device="cuda", dtype=torch.bfloat16)
    layers = model.config.num_hidden_layers
    print(torch.cuda.get_device_name(), args.model, f"batch {args.batch} x {args.context}", flush=True)
    for name in args.caches.split(","):
        kernels, plain_ms, profiled_ms = step_kernels(model, name, args.batch, args.context, args.replays)
        report(name, kernels, plain_ms, profiled_ms, layers, args.layer)


if __name__ == "__main__":
    main()
