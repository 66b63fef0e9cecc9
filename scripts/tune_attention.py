"""Developer tool (GPU): sweep the decode kernel's launch parameters on the benchmark shapes.

    PYTHONPATH=src python scripts/tune_attention.py [--shapes 1x131072,32x32768] [--quick]

Prints one line per configuration (time in µs, achieved GB/s, fraction of the measured
copy bandwidth) and the best per shape. The cache is filled as in `oscarkv bench attention`.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from oscarkv.benchmarks.attention import _fill_random, _layout, _time_us, copy_bandwidth_gbs
from oscarkv.cache.paged import PagedKVCache
from oscarkv.kernels import reference
from oscarkv.kernels.ops import choose_splits
from oscarkv.kernels.triton_attention import launch_attention


def case(batch: int, context: int, hq=32, hkv=8, d=128, group=128):
    device = torch.device("cuda")
    layout = _layout(hkv, d, group)
    cache = PagedKVCache([layout], batch * layout.pages_needed(context), batch, context, device)
    gen = torch.Generator().manual_seed(0)
    _fill_random(cache, gen)
    slots = [cache.open_slot() for _ in range(batch)]
    for slot in slots:
        cache.reserve(slot, context)
        cache.lengths[slot] = context - 1
    step = cache.step(slots, [1] * batch)
    q = torch.randn(batch, hq, d, generator=gen).bfloat16().to(device)
    k = torch.randn(batch, hkv, d, generator=gen).bfloat16().to(device)
    v = torch.randn(batch, hkv, d, generator=gen).bfloat16().to(device)
    end = layout.history_end(context)
    nbytes = ((end - layout.sink_tokens) * batch * hkv * layout.history_bytes_per_token()
              + batch * hkv * (context - (end - layout.sink_tokens)) * d * 4 + 2 * q.numel() * 2)
    return cache.layers[0], step, q, k, v, nbytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1x131072,32x32768,1x32768")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    copy = copy_bandwidth_gbs(torch.device("cuda"))
    print(f"copy bandwidth {copy:.0f} GB/s")
    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        layer, step, q, k, v, nbytes = case(batch, context)
        scale = 128 ** -0.5
        expected = reference.attention_reference(layer, step, q, k, v, scale)
        base_splits = choose_splits(layer, batch, 1, 32, context, q.device)
        split_options = sorted({base_splits, base_splits * 2})
        grid = itertools.product((32, 64), (1, 2), (1, 2), split_options)
        if args.quick:
            grid = itertools.product((64,), (4,), (2,), (base_splits,))
        results = []
        for block_n, warps, stages, splits in grid:
            out = torch.empty_like(q)
            ws = (torch.empty(batch, 32, splits, 128, dtype=torch.float32, device=q.device),
                  torch.empty(batch, 32, splits, dtype=torch.float32, device=q.device))

            def fn(block_n=block_n, warps=warps, stages=stages, splits=splits, out=out, ws=ws):
                launch_attention(layer, step, q, k, v, out, scale, 0, splits, ws, block_n=block_n,
                                 num_warps=warps, num_stages=stages)

            try:
                fn()
                err = (out.float() - expected).abs().max().item()
                us = _time_us(fn)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
                print(f"{shape} n{block_n} w{warps} s{stages} sp{splits}: failed {type(exc).__name__}: {exc}"[:200])
                continue
            gbs = nbytes / us / 1e3
            results.append((us, block_n, warps, stages, splits, err))
            print(f"{shape} n{block_n} w{warps} s{stages} sp{splits}: {us:8.1f} us {gbs:7.0f} GB/s "
                  f"{gbs / copy:5.1%} err {err:.1e}", flush=True)
        best = min(results)
        print(f"BEST {shape}: {best[0]:.1f} us ({nbytes / best[0] / 1e3 / copy:.1%} of copy) "
              f"block_n={best[1]} warps={best[2]} stages={best[3]} splits={best[4]} err={best[5]:.1e}")
        del layer, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
