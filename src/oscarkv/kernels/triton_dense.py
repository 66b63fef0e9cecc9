"""Triton decode attention over a dense BF16 cache: the baseline's read path.

The BF16 baseline of `bench decode` and of the static decode path stores every slot as one
contiguous [Hkv, max_context, D] buffer for K and one for V. Decoding reads each
sequence's first `length` positions; the length comes from a device tensor, so one
compiled launch (and one CUDA graph) serves every step. torch SDPA cannot do that: its
key length is a shape, fixed at capture.

Work split, as in the INT2 kernel (flash-decoding): a program owns one (sequence, KV
head) and one split of the positions; its query rows are the G query heads of the GQA
group, so every key and value row is loaded once for all of them. Splits write a partial
output and log-sum-exp that `_combine_kernel` merges. `dense_decode_reference` in
`oscarkv.kernels.reference` is what it computes.

The dots take the cache's BF16 operands on the GPU. The CPU interpreter computes BF16 dots
wrongly, so there (and only there) the operands are widened to float32 (`DOT_DTYPE`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_attention import LOG2E, _combine_kernel

_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _dense_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, slots_ptr, lengths_ptr,
                         stride_slot, stride_head, scale_log2, window,
                         HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // HKV
    h = pid % HKV
    G: tl.constexpr = HQ // HKV
    slot = tl.load(slots_ptr + b).to(tl.int64)
    length = tl.load(lengths_ptr + b).to(tl.int32)
    lo = 0
    if window > 0:
        lo = tl.maximum(length - window, 0)
    per_split = tl.cdiv(tl.cdiv(length - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, length)

    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < G
    q_row = b.to(tl.int64) * HQ + h * G + rows
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + q_row[:, None] * D + cols[None, :], mask=row_valid[:, None], other=0.0)
    q = (q.to(tl.float32) * scale_log2).to(DOT_DTYPE)

    base = slot * stride_slot + h * stride_head
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for first in range(start, end, BLOCK_N):
        pos = first + tl.arange(0, BLOCK_N)
        valid = pos < end
        offsets = base + pos.to(tl.int64)[:, None] * D + cols[None, :]
        k = tl.load(k_ptr + offsets, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + offsets, mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)))
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE))
        m = m_new

    l_safe = tl.where(l > 0, l, 1.0)
    if NUM_SPLITS == 1:
        tl.store(out_ptr + q_row[:, None] * D + cols[None, :], (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None])
    else:
        part = q_row * NUM_SPLITS + split
        tl.store(part_lse_ptr + part, tl.where(l > 0, m + tl.log2(l_safe), float("-inf")), mask=row_valid)
        tl.store(part_o_ptr + part[:, None] * D + cols[None, :], acc / l_safe[:, None], mask=row_valid[:, None])


def launch_dense_decode(q, keys, values, slots, lengths, out, scale: float, window: int, num_splits: int,
                        workspace: tuple | None, block_n: int = 64, num_warps: int = 4, num_stages: int = 3) -> None:
    """q, out: [B, Hq, D]; keys, values: [slots, Hkv, max_context, D]; slots, lengths: [B] ints on the device
    (lengths counts the positions each query sees, its own included). workspace: (part_o, part_lse)."""
    b, hq, d = q.shape
    hkv = keys.shape[1]
    if b == 0:
        return
    group = hq // hkv
    part_o, part_lse = workspace if num_splits > 1 else (out, out)
    _dense_decode_kernel[(b * hkv, num_splits)](
        q, keys, values, out, part_o, part_lse, slots, lengths, keys.stride(0), keys.stride(1),
        scale * LOG2E, window, HQ=hq, HKV=hkv, D=d, NUM_SPLITS=num_splits,
        BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        DOT_DTYPE=tl.float32 if q.device.type != "cuda" else _DOT_DTYPES[keys.dtype],
        num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        _combine_kernel[(b * hq,)](part_o, part_lse, out, D=d, NUM_SPLITS=num_splits,
                                   SPLIT_BLOCK=triton.next_power_of_2(num_splits))
