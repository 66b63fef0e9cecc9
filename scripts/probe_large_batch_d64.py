"""Developer tool (GPU): decode attention of one layer at large batches with SmolLM2's shapes (9 query / 3 KV
heads, head_dim 64, group 64), where INT2 whole-model steps are slower than BF16 (256x4K: 8.45 against 7.36 ms
on the H200). The forty-seventh session's timeline put the history launch at 173 µs and the window launch at
122 µs (59 exposed) per layer there, against 182 µs for BF16's dense decode kernel.

    PYTHONPATH=src python scripts/probe_large_batch_d64.py

Times the shipped plan (`ops.attend_step`), then the three launches with other history splits, history warps
and stages, and other window plans, each against the torch reference (max abs error printed once per shape).
"""
from __future__ import annotations

import itertools

import torch

from oscarkv.benchmarks.attention import _time_us, decode_case
from oscarkv.kernels import ops, reference, triton_attention as ta
from oscarkv.kernels.ops import COMBINE_CHANNELS, WindowPlan

SHAPES = {"smol": (9, 3, 64, 64), "qwen": (32, 8, 128, 128)}  # query heads, KV heads, head_dim, group
RUNS = (("smol", 256, 4000), ("smol", 128, 4000), ("smol", 64, 4000), ("smol", 32, 4000), ("smol", 16, 2000),
        ("smol", 64, 8000), ("qwen", 32, 8000), ("qwen", 64, 4000))


def sdpa_us(case, hq, hkv, d, ctx):
    """BF16 SDPA over the same number of keys (random contents), the dense baseline."""
    b = case.q.shape[0]
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    fn()
    return _time_us(fn)


def main():
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    for shape, b, ctx in RUNS:
        hq, hkv, d, g = SHAPES[shape]
        case = decode_case(b, ctx, query_heads=hq, kv_heads=hkv, head_dim=d, group=g)
        scale = d ** -0.5
        ref = reference.attention_reference(case.layer, case.step, case.q, case.k_new, case.v_new, scale, 0)
        splits = ops.choose_splits(case.layer, b, 1, hq, ctx, dev)
        plan = ops.window_plan(case.layer, b, 1, hq, splits, ctx, dev)
        out = torch.empty_like(case.q)

        def shipped():
            ops.attend_step(case.layer, case.step, case.q, case.k_new, case.v_new, scale, num_splits=splits,
                            max_context=ctx, out=out, validate=False)
        shipped()
        err = (out.float() - ref.float()).abs().max().item()
        res = [f"shipped h{splits - plan.splits} {plan} {_time_us(shipped):6.1f}"]
        hist0 = splits - plan.splits
        variants = [(h, nw, st, plan) for h, nw, st in itertools.product(
            sorted({max(1, hist0 // 2), hist0, 2 * hist0, 4 * hist0}), (1, 2, 4), (3,))]
        variants += [(hist0, 1, st, plan) for st in (2, 4)]
        variants += [(hist0, 1, 3, p) for p in (WindowPlan(2), WindowPlan(1, 1, 16), WindowPlan(1, 2, 32),
                                                WindowPlan(1, 4, 32))]
        best = None
        for h, nw, st, pl in variants:
            total = h + pl.splits
            ws = (torch.empty(b, hq, total, d, dtype=torch.float32, device=dev),
                  torch.empty(b, hq, total, dtype=torch.float32, device=dev))

            def step(total=total, ws=ws, nw=nw, st=st, pl=pl):
                ta.launch_attention(case.layer, case.step, case.q, case.k_new, case.v_new, out, scale, 0, total, ws,
                                    num_warps=nw, num_stages=st, window_splits=pl.splits, window_warps=pl.warps,
                                    window_block_n=pl.block_n, combine_d_block=min(COMBINE_CHANNELS, d))
            try:
                step()
                e = (out.float() - ref.float()).abs().max().item()
                us = _time_us(step)
                name = f"h{h} nw{nw} st{st} W{pl.splits}/{pl.warps}/{pl.block_n}"
                res.append(f"{name} {us:6.1f}" + (f" ERR {e:.1e}" if e > 1e-2 else ""))
                if best is None or us < best[0]:
                    best = (us, name)
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile or run is reported
                res.append(f"h{h} nw{nw} st{st} {pl} fail {type(exc).__name__}: {str(exc)[:80]}")
        print(f"== {shape} {b}x{ctx}: max err {err:.1e}; sdpa {sdpa_us(case, hq, hkv, d, ctx):6.1f} us; "
              f"best {best}", flush=True)
        for line in res:
            print("   ", line, flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
