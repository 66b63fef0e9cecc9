"""Developer tool (GPU): the window rule for large batches (`ops._two_warp_windows`: one two-warp window program of
32-key blocks per (sequence, KV head) beyond 2 pairs per multiprocessor; head_dim 64 since the forty-seventh
session, head_dim 128 too since the forty-eighth) against the four-warp window program before it, alternating in
one process.

    PYTHONPATH=src python scripts/probe_two_warp_windows.py [layer] [model] [qwen] [qwen-model]

`layer`: one layer of SmolLM2's shape (9 query / 3 KV heads, head_dim 64) at batches beyond 88 (the rule's range
on 132 multiprocessors) and several contexts, with each plan's max abs error against the torch reference.
`model`: whole random SmolLM2-135M INT2 steps, BF16 once. `qwen`: one layer of Qwen3's shape (32 / 8, head_dim
128) beyond 2 pairs per multiprocessor, with one four-warp window program and with the two-warp windows.
`qwen-model`: whole random Qwen3-4B steps, the rule at head_dim 64 only ("before") against the shipped rule
("after"). Results: docs/data/two-warp-windows-h200.txt.
"""
from __future__ import annotations

import sys

import torch

from oscarkv.benchmarks.attention import _time_us, decode_case
from oscarkv.kernels import ops, reference

ORIG_RULE = ops._two_warp_windows


def use(old: bool) -> None:
    """The plan before the rule (old: four-warp windows of 64-key blocks) or the shipped one."""
    ops._two_warp_windows = (lambda layer, programs, sms: False) if old else ORIG_RULE


def step_fn(case, hq, d, ctx, plan=None):
    dev = torch.device("cuda")
    b = case.q.shape[0]
    splits = ops.choose_splits(case.layer, b, 1, hq, ctx, dev)
    out = torch.empty_like(case.q)
    ws = (torch.empty(b, hq, splits, d, dtype=torch.float32, device=dev),
          torch.empty(b, hq, splits, dtype=torch.float32, device=dev))

    def step():
        ops.attend_step(case.layer, case.step, case.q, case.k_new, case.v_new, d ** -0.5, num_splits=splits,
                        max_context=ctx, out=out, workspace=ws, validate=False, window_splits=plan)
    return step, out


def layer_ab(shapes, hq, hkv, d):
    from ab_decode import layer_ab as alternate
    for b, ctx in shapes:
        alternate(decode_case(b, ctx, query_heads=hq, kv_heads=hkv, head_dim=d, group=d), hq, ctx, use, f"D{d}")
        torch.cuda.empty_cache()


def qwen():
    """Qwen3 shapes: one four-warp window program per pair (the plan before the forty-eighth session) against the
    two-warp windows."""
    for b, ctx in ((128, 4000), (256, 4000), (128, 8000), (96, 32000)):
        case = decode_case(b, ctx)
        ref = reference.attention_reference(case.layer, case.step, case.q, case.k_new, case.v_new, 128 ** -0.5, 0)
        line = []
        for name, plan in (("four-warp", ops.WindowPlan(1)), ("two-warp", ops.LARGE_BATCH_WINDOW_PLAN)):
            step, out = step_fn(case, 32, 128, ctx, plan)
            step()
            err = (out.float() - ref.float()).abs().max().item()
            line.append(f"{name} {min(_time_us(step), _time_us(step)):6.1f} us (err {err:.1e})")
        print(f"QWEN {b}x{ctx}: " + " | ".join(line), flush=True)
        torch.cuda.empty_cache()


def use_at_qwen(old: bool) -> None:
    """Qwen3 whole-model A/B: the rule at head_dim 64 only (old) against the shipped one."""
    ops._two_warp_windows = (lambda layer, programs, sms: layer.layout.head_dim < 128 and programs > 2 * sms
                             ) if old else ORIG_RULE


def qwen_model_ab():
    from ab_decode import model_ab as alternate
    alternate("random:qwen3-4b", ((128, 4000), (64, 8000)), use_at_qwen)
    ops._two_warp_windows = ORIG_RULE


def model_ab():
    from ab_decode import model_ab as alternate
    alternate("random:smollm2-135m", ((128, 4000), (256, 4000), (256, 1000), (128, 16000)), use)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), flush=True)
    if "layer" in sys.argv:
        layer_ab(((89, 4000), (128, 1000), (128, 4000), (256, 4000), (256, 500), (128, 16000), (512, 2000)),
                 9, 3, 64)
    if "qwen" in sys.argv:
        qwen()
    if "model" in sys.argv:
        model_ab()
    if "qwen-model" in sys.argv:
        qwen_model_ab()
