"""Triton read path: attention of a step's queries over the paged mixed-precision cache.

One kernel serves decode (one new token per sequence) and prefill/extend (a chunk of
new tokens); `oscarkv.kernels.reference.attention_reference` is what it computes.

Work split. A program owns one (sequence, KV head), a block of query rows and one split
of the sequence. Query rows are (new token, query head of the GQA group) pairs, so every
history page is loaded once for all query heads that share it. Splits 0..N-2 each take
an equal share of the INT2/INT4 history; the last split takes the sink, the stored ring
tokens and the step's own new tokens (causal). With N > 1 each split writes its partial
output and log-sum-exp, and `_combine_kernel` merges them (flash-decoding); with N = 1
one program does everything and writes the output directly (prefill).

Dequantization happens in registers: codes are unpacked quarter by quarter (the planar
layout keeps each quarter a contiguous run of bytes), turned into (c - zero)·scale in
float16 and fed to tensor-core dots with float32 accumulation. The online softmax works
in base 2 with the softmax scale folded into the queries.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_write import _history_end, _load_quarters, _round_to, _sequence

LOG2E = 1.4426950408889634


@triton.jit
def _load_dequantized(codes_ptr, scale_ptr, zero_ptr, base, valid, D: tl.constexpr, NG: tl.constexpr,
                      BITS: tl.constexpr):
    """Quarters [BLOCK_N, D/4] float16 of history rows `base` (row index into the page arrays)."""
    W: tl.constexpr = D // 4
    MASK: tl.constexpr = (1 << BITS) - 1
    src = codes_ptr + base[:, None] * (D * BITS // 8) + tl.arange(0, W)[None, :]
    m = valid[:, None]
    if BITS == 2:
        packed = tl.load(src, mask=m, other=0).to(tl.int32)
        c0 = packed & MASK
        c1 = (packed >> 2) & MASK
        c2 = (packed >> 4) & MASK
        c3 = (packed >> 6) & MASK
    else:
        low = tl.load(src, mask=m, other=0).to(tl.int32)
        high = tl.load(src + W, mask=m, other=0).to(tl.int32)
        c0 = low & MASK
        c2 = low >> 4
        c1 = high & MASK
        c3 = high >> 4
    group = base * NG
    s0 = tl.load(scale_ptr + group, mask=valid, other=0.0).to(tl.float32)
    z0 = tl.load(zero_ptr + group, mask=valid, other=0.0).to(tl.float32)
    if NG == 1:
        s1, s2, s3, z1, z2, z3 = s0, s0, s0, z0, z0, z0
    elif NG == 2:
        s2 = tl.load(scale_ptr + group + 1, mask=valid, other=0.0).to(tl.float32)
        z2 = tl.load(zero_ptr + group + 1, mask=valid, other=0.0).to(tl.float32)
        s1, z1, s3, z3 = s0, z0, s2, z2
    else:
        s1 = tl.load(scale_ptr + group + 1, mask=valid, other=0.0).to(tl.float32)
        z1 = tl.load(zero_ptr + group + 1, mask=valid, other=0.0).to(tl.float32)
        s2 = tl.load(scale_ptr + group + 2, mask=valid, other=0.0).to(tl.float32)
        z2 = tl.load(zero_ptr + group + 2, mask=valid, other=0.0).to(tl.float32)
        s3 = tl.load(scale_ptr + group + 3, mask=valid, other=0.0).to(tl.float32)
        z3 = tl.load(zero_ptr + group + 3, mask=valid, other=0.0).to(tl.float32)
    x0 = ((c0.to(tl.float32) - z0[:, None]) * s0[:, None]).to(tl.float16)
    x1 = ((c1.to(tl.float32) - z1[:, None]) * s1[:, None]).to(tl.float16)
    x2 = ((c2.to(tl.float32) - z2[:, None]) * s2[:, None]).to(tl.float16)
    x3 = ((c3.to(tl.float32) - z3[:, None]) * s3[:, None]).to(tl.float16)
    return x0, x1, x2, x3


@triton.jit
def _scores(q0, q1, q2, q3, k0, k1, k2, k3):
    """[BLOCK_M, BLOCK_N] float32 = Σ_quarters q_i · k_iᵀ, float16 operands (see `_softmax_step`)."""
    s = tl.dot(q0.to(tl.float16), tl.trans(k0.to(tl.float16)))
    s += tl.dot(q1.to(tl.float16), tl.trans(k1.to(tl.float16)))
    s += tl.dot(q2.to(tl.float16), tl.trans(k2.to(tl.float16)))
    s += tl.dot(q3.to(tl.float16), tl.trans(k3.to(tl.float16)))
    return s


@triton.jit
def _softmax_step(s, visible, m, l, a0, a1, a2, a3, v0, v1, v2, v3):
    """One online-softmax step (base 2) over a key block; returns the new m, l, accumulators.

    Dots take float16 operands for every region: exact for BF16 windows within the float16
    range (|x| < 65504), 3 more mantissa bits than BF16 for the probabilities, and one code
    path that the CPU interpreter (whose BF16 dot is wrong) tests as it runs on the GPU.
    """
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    l = l * alpha + tl.sum(p, 1)
    pv = p.to(tl.float16)
    a0 = a0 * alpha[:, None] + tl.dot(pv, v0.to(tl.float16))
    a1 = a1 * alpha[:, None] + tl.dot(pv, v1.to(tl.float16))
    a2 = a2 * alpha[:, None] + tl.dot(pv, v2.to(tl.float16))
    a3 = a3 * alpha[:, None] + tl.dot(pv, v3.to(tl.float16))
    return m_new, l, a0, a1, a2, a3


@triton.jit
def _visible(key_pos, key_valid, query_pos, row_valid, window):
    v = key_valid[None, :] & row_valid[:, None] & (key_pos[None, :] <= query_pos[:, None])
    if window > 0:
        v = v & (query_pos[:, None] - key_pos[None, :] < window)
    return v


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_new_ptr, v_new_ptr, out_ptr, part_o_ptr, part_lse_ptr,
        slots_ptr, cu_ptr, len_ptr, bt_ptr, bt_stride, num_pages,
        kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
        sink_k_ptr, sink_v_ptr, ring_k_ptr, ring_v_ptr,
        qk_scale, window,
        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, BITS: tl.constexpr,
        P: tl.constexpr, S: tl.constexpr, R: tl.constexpr, NUM_SPLITS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINK_BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    m_block = tl.program_id(1)
    split = tl.program_id(2)
    b = pid // HKV
    h = pid % HKV
    G: tl.constexpr = HQ // HKV
    W: tl.constexpr = D // 4
    C: tl.constexpr = R + P
    slot, old, start, count = _sequence(b, slots_ptr, cu_ptr, len_ptr)
    if m_block * BLOCK_M >= count * G:
        return
    r = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = r < count * G
    t = r // G
    head = h * G + r % G
    query_pos = old + t
    q_row = (start + t).to(tl.int64) * HQ + head
    q0, q1, q2, q3 = _load_quarters(q_ptr, q_row, row_valid, D)
    q0 = q0.to(tl.float32) * qk_scale
    q1 = q1.to(tl.float32) * qk_scale
    q2 = q2.to(tl.float32) * qk_scale
    q3 = q3.to(tl.float32) * qk_scale

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    a0 = tl.zeros([BLOCK_M, W], tl.float32)
    a1 = tl.zeros([BLOCK_M, W], tl.float32)
    a2 = tl.zeros([BLOCK_M, W], tl.float32)
    a3 = tl.zeros([BLOCK_M, W], tl.float32)

    end_new = _history_end(old + count, S, R, P)
    history_tokens = tl.maximum(tl.minimum(old, end_new) - S, 0)
    PAGE_SPLITS: tl.constexpr = NUM_SPLITS - 1 if NUM_SPLITS > 1 else 1
    if split < PAGE_SPLITS:
        share = tl.cdiv(tl.cdiv(history_tokens, PAGE_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * share
        hi = tl.minimum(lo + share, history_tokens)
        if window > 0:
            lo = tl.maximum(lo, old + m_block * BLOCK_M // G - window + 1 - S)
        bt_row = bt_ptr + slot.to(tl.int64) * bt_stride
        for first in range(lo, hi, BLOCK_N):
            index = first + tl.arange(0, BLOCK_N)
            key_valid = index < hi
            page = tl.load(bt_row + index // P, mask=key_valid, other=0)
            key_valid = key_valid & (page >= 0) & (page < num_pages)
            base = (page.to(tl.int64) * HKV + h) * P + index % P
            k0, k1, k2, k3 = _load_dequantized(kc_ptr, ks_ptr, kz_ptr, base, key_valid, D, NG, BITS)
            v0, v1, v2, v3 = _load_dequantized(vc_ptr, vs_ptr, vz_ptr, base, key_valid, D, NG, BITS)
            s = _scores(q0, q1, q2, q3, k0, k1, k2, k3)
            visible = _visible(S + index, key_valid, query_pos, row_valid, window)
            m, l, a0, a1, a2, a3 = _softmax_step(s, visible, m, l, a0, a1, a2, a3, v0, v1, v2, v3)

    if split == NUM_SPLITS - 1:
        head_row = slot.to(tl.int64) * HKV + h
        if S > 0:
            key_pos = tl.arange(0, SINK_BLOCK)
            key_valid = key_pos < tl.minimum(old, S)
            row = head_row * S + key_pos
            k0, k1, k2, k3 = _load_quarters(sink_k_ptr, row, key_valid, D)
            v0, v1, v2, v3 = _load_quarters(sink_v_ptr, row, key_valid, D)
            s = _scores(q0, q1, q2, q3, k0, k1, k2, k3)
            visible = _visible(key_pos, key_valid, query_pos, row_valid, window)
            m, l, a0, a1, a2, a3 = _softmax_step(s, visible, m, l, a0, a1, a2, a3, v0, v1, v2, v3)
        for first in range(end_new, old, BLOCK_N):
            key_pos = first + tl.arange(0, BLOCK_N)
            key_valid = key_pos < old
            row = head_row * C + (key_pos - S) % C
            k0, k1, k2, k3 = _load_quarters(ring_k_ptr, row, key_valid, D)
            v0, v1, v2, v3 = _load_quarters(ring_v_ptr, row, key_valid, D)
            s = _scores(q0, q1, q2, q3, k0, k1, k2, k3)
            visible = _visible(key_pos, key_valid, query_pos, row_valid, window)
            m, l, a0, a1, a2, a3 = _softmax_step(s, visible, m, l, a0, a1, a2, a3, v0, v1, v2, v3)
        last_new = tl.minimum(count, (m_block * BLOCK_M + BLOCK_M - 1) // G + 1)
        for first in range(0, last_new, BLOCK_N):
            key_t = first + tl.arange(0, BLOCK_N)
            key_valid = key_t < count
            row = (start + key_t).to(tl.int64) * HKV + h
            k0, k1, k2, k3 = _load_quarters(k_new_ptr, row, key_valid, D)
            v0, v1, v2, v3 = _load_quarters(v_new_ptr, row, key_valid, D)
            window_dtype: tl.constexpr = ring_v_ptr.dtype.element_ty  # new values as the cache stores them
            s = _scores(q0, q1, q2, q3, k0, k1, k2, k3)
            visible = _visible(old + key_t, key_valid, query_pos, row_valid, window)
            m, l, a0, a1, a2, a3 = _softmax_step(
                s, visible, m, l, a0, a1, a2, a3, _round_to(v0.to(tl.float32), window_dtype),
                _round_to(v1.to(tl.float32), window_dtype), _round_to(v2.to(tl.float32), window_dtype),
                _round_to(v3.to(tl.float32), window_dtype))

    cols = tl.arange(0, W)
    l_safe = tl.where(l > 0, l, 1.0)
    if NUM_SPLITS == 1:
        dst = out_ptr + q_row[:, None] * D + cols[None, :]
        mask = row_valid[:, None]
        tl.store(dst, (a0 / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + W, (a1 / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + 2 * W, (a2 / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + 3 * W, (a3 / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = q_row * NUM_SPLITS + split
        lse = tl.where(l > 0, m + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_valid)
        dst = part_o_ptr + part[:, None] * D + cols[None, :]
        mask = row_valid[:, None]
        tl.store(dst, a0 / l_safe[:, None], mask=mask)
        tl.store(dst + W, a1 / l_safe[:, None], mask=mask)
        tl.store(dst + 2 * W, a2 / l_safe[:, None], mask=mask)
        tl.store(dst + 3 * W, a3 / l_safe[:, None], mask=mask)


@triton.jit
def _combine_kernel(part_o_ptr, part_lse_ptr, out_ptr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    SPLIT_BLOCK: tl.constexpr):
    """Merge the splits of one (token, query head): out = Σ w_s o_s / Σ w_s, w_s = 2^(lse_s - max)."""
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, SPLIT_BLOCK)
    in_range = splits < NUM_SPLITS
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + splits, mask=in_range, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - top)
    total = tl.sum(weight, 0)
    cols = tl.arange(0, D)
    o = tl.load(part_o_ptr + (row * NUM_SPLITS + splits)[:, None] * D + cols[None, :], mask=in_range[:, None],
                other=0.0)
    merged = tl.sum(o * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * D + cols, merged.to(out_ptr.dtype.element_ty))


def launch_attention(layer, batch, q, k_new, v_new, out, scale: float, window: int, num_splits: int,
                     workspace: tuple | None, block_m: int = 16, block_n: int = 64, num_warps: int = 4,
                     num_stages: int = 2) -> None:
    """q: [T, Hq, D]; k_new, v_new: [T, Hkv, D]; out: [T, Hq, D]. workspace: (part_o, part_lse) when splitting."""
    lay = layer.layout
    hq, d = q.shape[1], lay.head_dim
    group = hq // lay.kv_heads
    b = batch.batch
    if b == 0 or batch.max_new == 0:
        return
    bt = batch.block_table
    m_blocks = triton.cdiv(batch.max_new * group, block_m)
    part_o, part_lse = workspace if num_splits > 1 else (out, out)
    grid = (b * lay.kv_heads, m_blocks, num_splits)
    _paged_attention_kernel[grid](
        q, k_new, v_new, out, part_o, part_lse,
        batch.slots, batch.cu_new, batch.lengths, bt, bt.stride(0), layer.num_pages,
        layer.k_codes, layer.k_scale, layer.k_zero, layer.v_codes, layer.v_scale, layer.v_zero,
        layer.sink_k, layer.sink_v, layer.ring_k, layer.ring_v,
        scale * LOG2E, window,
        HQ=hq, HKV=lay.kv_heads, D=d, NG=lay.groups, BITS=lay.bits, P=lay.page_size, S=lay.sink_tokens,
        R=lay.recent_tokens, NUM_SPLITS=num_splits, BLOCK_M=block_m, BLOCK_N=block_n,
        SINK_BLOCK=max(16, triton.next_power_of_2(max(lay.sink_tokens, 1))),
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        rows = q.shape[0] * hq
        _combine_kernel[(rows,)](part_o, part_lse, out, D=d, NUM_SPLITS=num_splits,
                                 SPLIT_BLOCK=triton.next_power_of_2(num_splits))
