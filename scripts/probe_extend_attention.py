"""Developer tool (GPU): extend steps (a chunk of new tokens over a stored history, as `oscarkv serve`
prefills prompts in chunks): the INT2 cache's two paths (`attend_step(extend="fused")`, the attention
kernel; `extend="dequantize"`, `kernels.extend`) against the BF16 slot cache's extend attention over the same
contents (`causal_gqa_attention` for one sequence; the masked `gqa_attention` of batched steps and sliding
windows), one layer of Qwen3 shapes, batch 1.

    PYTHONPATH=src python scripts/probe_extend_attention.py [--cases HISTORY:NEW,...]
    PYTHONPATH=src python scripts/probe_extend_attention.py --prefill [TOKENS] [--chunk N] [--profile]   # whole Qwen3-4B

The fused kernel runs with 16 and with 32 query rows per program (`attend_step(block_m=...)`; "auto" picks
`ops.choose_block_m`). With --prefill: a random Qwen3-4B prefills a TOKENS-token prompt (16384) in N-token
chunks (512), BF16 cache, then INT2 with each `CacheConfig.extend_attention` (and --profile: the GPU kernels
of one chunk half-way).
"""
from __future__ import annotations

import argparse

import torch

from oscarkv.benchmarks.attention import _fill_random, _layout, _time_us
from oscarkv.cache.paged import PagedKVCache
from oscarkv.kernels import reference
from oscarkv.kernels.extend import causal_gqa_attention, gqa_attention
from oscarkv.kernels.ops import attend_step

HQ, HKV, D = 32, 8, 128


def extend_case(history: int, new: int, seed: int = 0):
    device = torch.device("cuda")
    layout = _layout(HKV, D, 128)
    cache = PagedKVCache([layout], layout.pages_needed(history + new), 1, history + new, device)
    gen = torch.Generator().manual_seed(seed)
    _fill_random(cache, gen)
    slot = cache.open_slot()
    cache.reserve(slot, history + new)
    cache.lengths[slot] = history
    step = cache.step([slot], [new])
    q = torch.randn(new, HQ, D, generator=gen).bfloat16().to(device)
    k = torch.randn(new, HKV, D, generator=gen).bfloat16().to(device)
    v = torch.randn(new, HKV, D, generator=gen).bfloat16().to(device)
    return cache, slot, step, q, k, v


def timed(fn) -> float:
    """µs in CUDA graphs, or launched one after another where a graph cannot capture fn."""
    try:
        return _time_us(fn)
    except Exception:  # noqa: BLE001
        torch.cuda.synchronize()
        return _time_us(fn, graph=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="8192:16,8192:32,8192:64,8192:128,8192:512,32768:64,32768:512,32768:2048")
    parser.add_argument("--prefill", type=int, nargs="?", const=16384, default=0,
                        help="instead: a whole Qwen3-4B prefilling a prompt of this many tokens in 512-token chunks")
    parser.add_argument("--chunk", type=int, default=512, help="with --prefill: tokens per forward")
    parser.add_argument("--paths", default="bf16,fused,dequantize,auto",
                        help="with --prefill: bf16 and the INT2 cache's extend_attention settings to run")
    parser.add_argument("--profile", action="store_true", help="with --prefill: the GPU kernels of one chunk")
    parser.add_argument("--host", action="store_true",
                        help="with --prefill: also the host's time to enqueue each chunk, and where a chunk synchronises")
    parser.add_argument("--copies", type=int, default=0, metavar="ROUNDS",
                        help="with --prefill: also ROUNDS alternating prefills with the small host-to-device copies "
                             "pinned and non-blocking (transfer.to_device) and plain (pageable, synchronising)")
    args = parser.parse_args()
    if args.prefill:
        chunked_prefill("random:qwen3-4b", args.prefill, args.chunk, args.profile, args.paths.split(","), args.host,
                        args.copies)
        return
    print(torch.cuda.get_device_name(), flush=True)
    for case in args.cases.split(","):
        history, new = (int(x) for x in case.split(":"))
        cache, slot, step, q, k, v = extend_case(history, new)
        layer = cache.layers[0]
        scale = D ** -0.5
        small = new * history <= 512 * 40000
        expected = reference.attention_reference(layer, step, q, k, v, scale).float() if small else None
        end = layer.layout.history_end(history + new)
        ks, vs = reference.stored_kv_reference(layer, cache.block_table, slot, history, end)
        keys = torch.cat([ks, k.float().transpose(0, 1)], 1).bfloat16()[None]
        values = torch.cat([vs, v.float().transpose(0, 1)], 1).bfloat16()[None]
        q4 = q.transpose(0, 1)[None]
        pos = history + torch.arange(new, device="cuda")[None]
        rows = []
        outputs = {}
        for name, fn in (
                ("BF16 cache: causal_gqa_attention (the slot cache's)",
                 lambda: causal_gqa_attention(q4, keys, values, scale)[0].transpose(0, 1)),
                ("BF16, masked gqa_attention (batched steps, windows)",
                 lambda: gqa_attention(q4, keys, values, pos, scale)[0].transpose(0, 1)),
                ("INT2 fused kernel, 16-row blocks",
                 lambda: attend_step(layer, step, q, k, v, scale, validate=False, extend="fused", block_m=16)),
                ("INT2 fused kernel, 32-row blocks",
                 lambda: attend_step(layer, step, q, k, v, scale, validate=False, extend="fused", block_m=32)),
                ("INT2 dequantize + gqa_attention",
                 lambda: attend_step(layer, step, q, k, v, scale, validate=False, extend="dequantize"))):
            outputs[name] = fn().float()
            rows.append((name, timed(fn)))
        ref = expected if expected is not None else outputs["INT2 fused kernel, 16-row blocks"]
        for name, us in rows:
            err = (outputs[name] - ref).abs().max().item()
            print(f"history {history:6d} + {new:5d} new  {name:52s} {us:9.1f} us  err vs "
                  f"{'reference' if expected is not None else 'fused'} {err:.1e}", flush=True)
        del cache, outputs, expected
        torch.cuda.empty_cache()


def chunked_prefill(model_name: str, tokens: int, chunk: int, profile: bool = False,
                    paths: tuple[str, ...] = ("bf16", "fused", "dequantize", "auto"), host: bool = False,
                    copies: int = 0) -> None:
    """Whole-model chunked prefill (as `oscarkv serve --prefill-chunk`): a `tokens`-token prompt in `chunk`-token
    forwards into one slot, BF16 cache, then INT2 with each extend path; best of two after a warm-up."""
    import oscarkv
    from oscarkv.benchmarks.decode import release_memory
    from oscarkv.config import CacheConfig
    from oscarkv.integrations.static_decode import forward_slots, slot_cache_for
    from oscarkv.models import load_model

    model, _ = load_model(model_name, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device="cuda")
    for method, path in [("bf16", "auto") if p == "bf16" else ("hadamard", p) for p in paths]:
        release_memory()
        oscarkv.patch(model, method=method, cache=CacheConfig(extend_attention=path))
        cache = slot_cache_for(model, 1, tokens + 1)
        timed_prefill(model, cache, ids, chunk)  # warm-up
        best = min(timed_prefill(model, cache, ids, chunk) for _ in range(2))
        name = "bf16" if method == "bf16" else f"int2 extend_attention={path}"
        print(f"{model_name} chunked prefill {tokens} tokens in {chunk}-token chunks, {name}: "
              f"{best * 1e3:.0f} ms", flush=True)
        if host:
            host_report(model, cache, ids, chunk)
        if copies:
            compare_copies(model, cache, ids, chunk, copies)
        if profile:  # the GPU kernels of the chunks after the first half of the prompt
            slot = cache.open(tokens + 1)
            with torch.inference_mode():
                for lo in range(0, tokens // 2, chunk):
                    forward_slots(model, cache, [slot], ids[:, lo:lo + chunk])
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                        torch.profiler.ProfilerActivity.CPU]) as prof:
                    forward_slots(model, cache, [slot], ids[:, tokens // 2:tokens // 2 + chunk])
                    torch.cuda.synchronize()
            for key in ("cuda_time_total", "self_cpu_time_total"):
                print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=60), flush=True)
            cache.close(slot)
        del cache


def timed_prefill(model, cache, ids, chunk: int) -> float:
    """Seconds to prefill ids [1, T] into a fresh slot of `cache` in `chunk`-token forwards (the slot is closed after)."""
    import time

    from oscarkv.integrations.static_decode import forward_slots

    slot = cache.open(ids.shape[1] + 1)
    torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.inference_mode():
        for lo in range(0, ids.shape[1], chunk):
            forward_slots(model, cache, [slot], ids[:, lo:lo + chunk])
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    cache.close(slot)
    return seconds


def host_report(model, cache, ids, chunk: int) -> None:
    """The host's time to enqueue each chunk's forward (no synchronisation between chunks), against the
    whole prefill; then the call sites where one chunk's forward synchronises with the device."""
    import collections
    import time
    import warnings

    from oscarkv.integrations.static_decode import forward_slots

    tokens = ids.shape[1]
    slot = cache.open(tokens + 1)
    enqueue = []
    torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.inference_mode():
        for lo in range(0, tokens, chunk):
            t = time.perf_counter()
            forward_slots(model, cache, [slot], ids[:, lo:lo + chunk])
            enqueue.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    total = time.perf_counter() - started
    cache.close(slot)
    print(f"  host: {sum(enqueue) * 1e3:.0f} ms enqueueing of {total * 1e3:.0f} ms in all; per chunk median "
          f"{sorted(enqueue)[len(enqueue) // 2] * 1e3:.1f} ms, last {enqueue[-1] * 1e3:.1f} ms", flush=True)
    slot = cache.open(tokens + 1)
    sites = collections.Counter()
    with torch.inference_mode():
        for lo in range(0, tokens // 2, chunk):
            forward_slots(model, cache, [slot], ids[:, lo:lo + chunk])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            forward_slots(model, cache, [slot], ids[:, tokens // 2:tokens // 2 + chunk])
        torch.cuda.set_sync_debug_mode(0)
    for w in caught:  # a synchronising operation warns at the Python line that called it
        if "synchroniz" in str(w.message):
            sites[f"{w.filename}:{w.lineno}"] += 1
    print(f"  synchronisations in one chunk: {sum(sites.values())}", flush=True)
    for site, count in sites.most_common(8):
        print(f"    {count:4d}  {site}", flush=True)
    cache.close(slot)


def compare_copies(model, cache, ids, chunk: int, rounds: int) -> None:
    """Whole prefills, alternating: the small host-to-device copies of each chunk (step metadata, positions,
    new pages) through `transfer.to_device` (pinned, non-blocking) and as plain `torch.tensor(..., device=)`
    copies from pageable memory (each waits for the device)."""
    import statistics
    import time

    from oscarkv import transfer
    from oscarkv.cache import paged
    from oscarkv.integrations import slots, static_decode

    modules = (paged, slots, static_decode)
    plain = lambda values, dtype, device: torch.tensor(values, dtype=dtype, device=device)  # noqa: E731
    times = {"pinned": [], "plain": []}
    for _ in range(rounds):
        for name, fn in (("pinned", transfer.to_device), ("plain", plain)):
            for module in modules:
                module.to_device = fn
            times[name].append(timed_prefill(model, cache, ids, chunk) * 1e3)
    for module in modules:
        module.to_device = transfer.to_device
    for name, values in times.items():
        print(f"  copies {name:6s}: median {statistics.median(values):.0f} ms of {rounds} "
              f"({', '.join(f'{v:.0f}' for v in values)})", flush=True)
    torch.cuda.synchronize()
    for name, fn in (("pinned", transfer.to_device), ("plain", plain)):
        started = time.perf_counter()
        for _ in range(1000):
            fn([1, 2, 3, 4, 5, 6, 7, 8], torch.int32, "cuda")
        torch.cuda.synchronize()
        print(f"  one small copy, {name}: {(time.perf_counter() - started) * 1e3:.1f} us (idle GPU, mean of 1000)",
              flush=True)


if __name__ == "__main__":
    main()
