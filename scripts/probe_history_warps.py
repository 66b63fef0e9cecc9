"""Developer tool (GPU): warps of the decode history programs, and the window programs where the history programs
are few or the context is short (forty-sixth session; docs/data/history-warps-h200.txt).

    PYTHONPATH=src python scripts/probe_history_warps.py sweep   # one layer: history warps 4/1/2, 16 one-warp windows
    PYTHONPATH=src python scripts/probe_history_warps.py short   # one layer, short contexts: window plans
    PYTHONPATH=src python scripts/probe_history_warps.py ab      # the plan before the session against today's:
                                                                 # one layer (with errors), then whole random models

`sweep` times, from the plan before the session, the shapes where it took four-warp history programs (section 2
of the data). `short` times window plans at contexts under 8 history splits (section 6). `ab` alternates the plan
before the session with the shipped one in one process (section 4; its run preceded the short-context change).
The plan before the session is emulated: `launch_attention` wrapped to give history programs one warp from four
programs per multiprocessor, window programs counted; `ops._decode_plan` wrapped to take no few-history windows and
one window program below 8 history splits.
"""
from __future__ import annotations

import sys

import torch

from oscarkv.benchmarks.attention import _time_us, decode_case
from oscarkv.kernels import ops, triton_attention as ta
from oscarkv.kernels.ops import (COMBINE_CHANNELS, WindowPlan, choose_row_groups, choose_splits, history_registers,
                                 window_plan)

SHAPES = {"smol": (9, 3, 64, 64), "qwen": (32, 8, 128, 128)}  # query heads, KV heads, head_dim, group
ORIG_LAUNCH = ta.launch_attention
ORIG_PLAN = ops._decode_plan


def SMS() -> int:  # noqa: N802 - the GPU's multiprocessors
    return ops._multiprocessor_count(torch.device("cuda"))


def old_launch(layer, batch, q, k_new, v_new, out, scale, window, num_splits, workspace, **kw):
    if kw.get("num_warps") is None:
        group = q.shape[1] // layer.layout.kv_heads
        programs = batch.batch * layer.layout.kv_heads * num_splits
        kw["num_warps"] = 1 if batch.max_new * group <= kw.get("block_m", 16) and programs >= 4 * SMS() else 4
    return ORIG_LAUNCH(layer, batch, q, k_new, v_new, out, scale, window, num_splits, workspace, **kw)


def old_plan(layer, programs, max_context, sms):
    history, plan = ORIG_PLAN(layer, programs, max_context, sms)
    if plan == WindowPlan(1, warps=1, block_n=ops.ONE_WARP_WINDOW_BLOCK):  # one-warp windows: unchanged
        return history, plan
    if programs <= ops.SMALL_BATCH_PROGRAMS:
        return history, WindowPlan(ops._small_batch_window_splits(programs) if history >= 8 else 1)
    return history, WindowPlan(ops.MID_BATCH_WINDOW_SPLITS if programs <= 2 * sms else 1)


def use(old: bool) -> None:
    """The plan of before the forty-sixth session (old) or the shipped one."""
    ta.launch_attention = old_launch if old else ORIG_LAUNCH
    ops._decode_plan = old_plan if old else ORIG_PLAN


def layer_ab():
    from ab_decode import layer_ab as alternate
    for shape, runs in (("smol", ((1, 500), (1, 1000), (1, 2000), (1, 4000), (1, 8000), (2, 1000), (2, 2000),
                                  (4, 1000), (8, 500), (8, 1000), (1, 32000))),
                        ("qwen", ((1, 500), (1, 1000), (1, 2000), (1, 4000), (2, 1000), (4, 500), (8, 500),
                                  (1, 32000)))):
        hq, hkv, d, g = SHAPES[shape]
        for b, ctx in runs:
            alternate(decode_case(b, ctx, query_heads=hq, kv_heads=hkv, head_dim=d, group=g), hq, ctx, use, shape)
            torch.cuda.empty_cache()


def model_ab():
    from ab_decode import model_ab as alternate
    alternate("random:smollm2-135m", ((1, 500), (1, 1000), (1, 2000), (1, 4000), (1, 7900), (4, 1000), (8, 500)),
              use, steps=48)
    alternate("random:qwen3-4b", ((1, 500), (1, 1000), (1, 2000), (4, 500)), use, steps=48)


def call(case, hq, d, num_warps=None, plan=None):
    dev = torch.device("cuda")
    b = case.q.shape[0]
    ctx = int(case.cache.lengths[case.slots[0]]) + 1
    splits = choose_splits(case.layer, b, 1, hq, ctx, dev)
    default = window_plan(case.layer, b, 1, hq, splits, ctx, dev)
    plan = plan or default
    splits = splits - default.splits + plan.splits
    rg = choose_row_groups(case.layer, 1, hq, splits, plan.splits, ctx)
    regs = history_registers(case.layer, b, 1, hq, splits, plan, rg, dev)
    out = torch.empty_like(case.q)
    ws = (torch.empty(b, hq, splits, d, dtype=torch.float32, device=dev),
          torch.empty(b, hq, splits, dtype=torch.float32, device=dev))

    def step():
        ta.launch_attention(case.layer, case.step, case.q, case.k_new, case.v_new, out, d ** -0.5, 0, splits, ws,
                            window_splits=plan.splits, row_groups=rg, window_warps=plan.warps,
                            window_block_n=plan.block_n, maxnreg=regs, combine_d_block=min(COMBINE_CHANNELS, d),
                            num_warps=num_warps)
    return step, splits, plan, regs


def sweep():
    use(True)  # the plan before the session: its window plans, and the shapes where it took four warps
    for shape, batches, contexts in (("smol", (1, 2, 4, 8, 16), (1000, 2000, 4000, 8000, 16000)),
                                     ("qwen", (1, 2, 4), (1000, 2000, 4000, 8000, 16000))):
        hq, hkv, d, g = SHAPES[shape]
        for b in batches:
            for ctx in contexts:
                case = decode_case(b, ctx, query_heads=hq, kv_heads=hkv, head_dim=d, group=g)
                step, splits, plan, regs = call(case, hq, d)
                programs = b * hkv * splits
                current = 1 if programs >= 4 * SMS() else 4
                if current == 1:
                    print(f"{shape} {b}x{ctx}: already one warp ({programs} programs)", flush=True)
                    continue
                res = []
                for name, nw, pl in (("nw4", 4, None), ("nw1", 1, None), ("nw2", 2, None),
                                     ("nw1 w16/1/16", 1, WindowPlan(16, 1, 16)),
                                     ("nw4 w16/1/16", 4, WindowPlan(16, 1, 16))):
                    try:
                        fn = call(case, hq, d, nw, pl)[0]
                        fn()
                        res.append(f"{name} {min(_time_us(fn), _time_us(fn)):6.1f}")
                    except Exception as exc:  # noqa: BLE001
                        res.append(f"{name} fail {type(exc).__name__}")
                print(f"{shape} {b}x{ctx} splits {splits} {plan} regs {regs} programs {programs} "
                      f"hist/SM {b * hkv * (splits - plan.splits) / SMS():.2f}: " + " | ".join(res), flush=True)
                del case
                torch.cuda.empty_cache()
    use(False)


SHORT_PLANS = (("W1/4 (before)", WindowPlan(1)), ("W4", WindowPlan(4)), ("W8", WindowPlan(8)),
               ("W16/1/16", WindowPlan(16, 1, 16)), ("W8/1/16", WindowPlan(8, 1, 16)),
               ("W24/1/16", WindowPlan(24, 1, 16)), ("W8/4/32", WindowPlan(8, 4, 32)))


def short():
    """Window plans at short contexts, history as `choose_splits` takes it, history warps as shipped."""
    dev = torch.device("cuda")
    for shape, b, ctx in (("smol", 1, 500), ("qwen", 1, 500), ("smol", 8, 500), ("qwen", 4, 500), ("qwen", 1, 300)):
        hq, hkv, d, g = SHAPES[shape]
        case = decode_case(b, ctx, query_heads=hq, kv_heads=hkv, head_dim=d, group=g)
        splits = choose_splits(case.layer, b, 1, hq, ctx, dev)
        res = [f"shipped {window_plan(case.layer, b, 1, hq, splits, ctx, dev)}"]
        for name, plan in SHORT_PLANS:
            try:
                fn = call(case, hq, d, None, plan)[0]
                fn()
                res.append(f"{name} {_time_us(fn):5.1f}")
            except Exception as exc:  # noqa: BLE001 - a plan that does not compile is reported and skipped
                res.append(f"{name} fail {type(exc).__name__}")
        print(f"{shape} {b}x{ctx}: " + " | ".join(res), flush=True)
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), flush=True)
    if "sweep" in sys.argv:
        sweep()
    if "short" in sys.argv:
        short()
    if "ab" in sys.argv:
        layer_ab()
        model_ab()
