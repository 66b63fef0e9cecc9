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

Dequantization costs no conversion instructions. The codes of a (page, KV head) are one
contiguous run of bytes; each code c becomes the float16 with the same bits, c·2^-24 (an exact
subnormal), with a shift and a mask. The dots run on those raw codes with float16
queries/probabilities and float32 accumulation, and each token's scale s and zero z are
applied to the small score tile (s·2^24·(q·c) - s·z·Σq) and folded into the probabilities
for the values (Σ p·s·c·2^24 - Σ p·s·z), never to the [tokens, D] tiles. The online
softmax works in base 2 with the softmax scale folded into the queries.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .hardware import multiprocessors as _multiprocessors
from .triton_write import _history_end, _load_quarters, _round_to, _sequence

LOG2E = 1.4426950408889634
UNIT_INV = tl.constexpr(16777216.0)  # 2^24: codes enter the dots as c·2^-24 (see _as_float16_units)


@triton.jit
def _as_float16_units(c):
    """Small integer codes as float16 with the same bits: c·2^-24, an exact subnormal."""
    return c.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _page_codes(codes_ptr, row0, P: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Codes of one (page, KV head), P rows from row `row0`, as four [P, D/4] float16 quarters in
    units of 2^-24 (`_as_float16_units`). The P rows are one contiguous run of bytes, read with
    wide loads; turning a code into a float16 costs a shift and a mask, no conversion."""
    W: tl.constexpr = D // 4
    ROW_BYTES: tl.constexpr = D * BITS // 8
    MASK: tl.constexpr = (1 << BITS) - 1
    src = codes_ptr + row0 * ROW_BYTES + (tl.arange(0, P) * ROW_BYTES)[:, None] + tl.arange(0, W)[None, :]
    if BITS == 2:
        packed = tl.load(src)
        c0 = packed & MASK
        c1 = (packed >> 2) & MASK
        c2 = (packed >> 4) & MASK
        c3 = packed >> 6
    else:
        low = tl.load(src)
        high = tl.load(src + W)
        c0 = low & MASK
        c2 = low >> 4
        c1 = high & MASK
        c3 = high >> 4
    return _as_float16_units(c0), _as_float16_units(c1), _as_float16_units(c2), _as_float16_units(c3)


@triton.jit
def _page_params(scale_ptr, zero_ptr, row0, g: tl.constexpr, NG: tl.constexpr, P: tl.constexpr):
    """Scale and zero [P] float32 of group g for the P rows of one (page, KV head)."""
    at = (row0 + tl.arange(0, P)) * NG + g
    return tl.load(scale_ptr + at).to(tl.float32), tl.load(zero_ptr + at).to(tl.float32)


@triton.jit
def _group_scores(d, scale_ptr, zero_ptr, row0, g: tl.constexpr, NG: tl.constexpr, P: tl.constexpr, q_sum):
    """Scores of group g from d = q·c (units of 2^-24): Σ_d q·(c - z)·s = s·2^24·d - s·z·Σq."""
    scale, zero = _page_params(scale_ptr, zero_ptr, row0, g, NG, P)
    return d * (scale * UNIT_INV)[None, :] - q_sum[:, None] * (scale * zero)[None, :]


@triton.jit
def _history_scores(q0, q1, q2, q3, qs0, qs1, qs2, qs3, kc_ptr, ks_ptr, kz_ptr, row0,
                    P: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, BITS: tl.constexpr):
    """[BLOCK_M, P] float32 scores of the queries (float16 quarters q_i, their sums qs_i) against
    one page of quantized keys. The dots run on the raw codes; the scale and zero of each token
    and group are applied to the [BLOCK_M, P] result, not to the [P, D] keys."""
    k0, k1, k2, k3 = _page_codes(kc_ptr, row0, P, D, BITS)
    d = tl.dot(q0, tl.trans(k0))
    if NG == 4:
        s = _group_scores(d, ks_ptr, kz_ptr, row0, 0, NG, P, qs0)
        s += _group_scores(tl.dot(q1, tl.trans(k1)), ks_ptr, kz_ptr, row0, 1, NG, P, qs1)
        s += _group_scores(tl.dot(q2, tl.trans(k2)), ks_ptr, kz_ptr, row0, 2, NG, P, qs2)
        s += _group_scores(tl.dot(q3, tl.trans(k3)), ks_ptr, kz_ptr, row0, 3, NG, P, qs3)
    elif NG == 2:
        d = tl.dot(q1, tl.trans(k1), d)
        s = _group_scores(d, ks_ptr, kz_ptr, row0, 0, NG, P, qs0 + qs1)
        d = tl.dot(q3, tl.trans(k3), tl.dot(q2, tl.trans(k2)))
        s += _group_scores(d, ks_ptr, kz_ptr, row0, 1, NG, P, qs2 + qs3)
    else:
        d = tl.dot(q3, tl.trans(k3), tl.dot(q2, tl.trans(k2), tl.dot(q1, tl.trans(k1), d)))
        s = _group_scores(d, ks_ptr, kz_ptr, row0, 0, NG, P, qs0 + qs1 + qs2 + qs3)
    return s


@triton.jit
def _softmax_weights(s, visible, m, l):
    """Base-2 online softmax over one key block: the new running max, the block's probabilities
    p = 2^(s - max), the factor alpha that rescales the earlier sums, and the new sum l."""
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    return m_new, p, alpha, l * alpha + tl.sum(p, 1)


@triton.jit
def _weighted_codes(p, alpha, corr, vs_ptr, vz_ptr, row0, g: tl.constexpr, NG: tl.constexpr, P: tl.constexpr):
    """Probabilities of group g weighted by the value scales (float16) and the new zero correction
    corr·alpha + Σ_n p_n·s_n·z_n, computed from the same rounded weights as the dots."""
    scale, zero = _page_params(vs_ptr, vz_ptr, row0, g, NG, P)
    weight = (p * scale[None, :]).to(tl.float16)
    return weight, corr * alpha + tl.sum(weight.to(tl.float32) * zero[None, :], 1)


@triton.jit
def _history_step(s, visible, m, l, a0, a1, a2, a3, z0, z1, z2, z3, vc_ptr, vs_ptr, vz_ptr, row0,
                  P: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, BITS: tl.constexpr):
    """Online-softmax step over one page of quantized values. The accumulators a_i hold
    Σ p·s·c in units of 2^-24 and z_g holds Σ p·s·z, so that the output is a·2^24 - z."""
    m_new, p, alpha, l = _softmax_weights(s, visible, m, l)
    v0, v1, v2, v3 = _page_codes(vc_ptr, row0, P, D, BITS)
    w0, z0 = _weighted_codes(p, alpha, z0, vs_ptr, vz_ptr, row0, 0, NG, P)
    if NG == 1:
        w1, w2, w3 = w0, w0, w0
        z1, z2, z3 = z0, z0, z0
    elif NG == 2:
        w2, z2 = _weighted_codes(p, alpha, z2, vs_ptr, vz_ptr, row0, 1, NG, P)
        w1, z1, w3, z3 = w0, z0, w2, z2
    else:
        w1, z1 = _weighted_codes(p, alpha, z1, vs_ptr, vz_ptr, row0, 1, NG, P)
        w2, z2 = _weighted_codes(p, alpha, z2, vs_ptr, vz_ptr, row0, 2, NG, P)
        w3, z3 = _weighted_codes(p, alpha, z3, vs_ptr, vz_ptr, row0, 3, NG, P)
    a0 = tl.dot(w0, v0, a0 * alpha[:, None])
    a1 = tl.dot(w1, v1, a1 * alpha[:, None])
    a2 = tl.dot(w2, v2, a2 * alpha[:, None])
    a3 = tl.dot(w3, v3, a3 * alpha[:, None])
    return m_new, l, a0, a1, a2, a3, z0, z1, z2, z3


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
    m_new, p, alpha, l = _softmax_weights(s, visible, m, l)
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
def _window_block(k_ptr, v_ptr, row, key_valid, key_pos, q0, q1, q2, q3, query_pos, row_valid, window,
                  m, l, a0, a1, a2, a3, D: tl.constexpr, ROUND_V: tl.constexpr):
    """Online-softmax step over a block of full-precision keys/values (sink, ring or the step's
    own tokens) at rows `row`; ROUND_V: round the values to that dtype first (or None)."""
    k0, k1, k2, k3 = _load_quarters(k_ptr, row, key_valid, D)
    v0, v1, v2, v3 = _load_quarters(v_ptr, row, key_valid, D)
    if ROUND_V is not None:
        v0 = _round_to(v0.to(tl.float32), ROUND_V)
        v1 = _round_to(v1.to(tl.float32), ROUND_V)
        v2 = _round_to(v2.to(tl.float32), ROUND_V)
        v3 = _round_to(v3.to(tl.float32), ROUND_V)
    s = _scores(q0, q1, q2, q3, k0, k1, k2, k3)
    visible = _visible(key_pos, key_valid, query_pos, row_valid, window)
    return _softmax_step(s, visible, m, l, a0, a1, a2, a3, v0, v1, v2, v3)


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
    q0 = (q0.to(tl.float32) * qk_scale).to(tl.float16)
    q1 = (q1.to(tl.float32) * qk_scale).to(tl.float16)
    q2 = (q2.to(tl.float32) * qk_scale).to(tl.float16)
    q3 = (q3.to(tl.float32) * qk_scale).to(tl.float16)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    a0 = tl.zeros([BLOCK_M, W], tl.float32)
    a1 = tl.zeros([BLOCK_M, W], tl.float32)
    a2 = tl.zeros([BLOCK_M, W], tl.float32)
    a3 = tl.zeros([BLOCK_M, W], tl.float32)

    end_new = _history_end(old + count, S, R, P)
    history_pages = tl.maximum(tl.minimum(old, end_new) - S, 0) // P  # the history is whole pages
    PAGE_SPLITS: tl.constexpr = NUM_SPLITS - 1 if NUM_SPLITS > 1 else 1
    if split < PAGE_SPLITS:
        # Sums of the rounded query quarters, for the zero points (see _group_scores).
        qs0 = tl.sum(q0.to(tl.float32), 1)
        qs1 = tl.sum(q1.to(tl.float32), 1)
        qs2 = tl.sum(q2.to(tl.float32), 1)
        qs3 = tl.sum(q3.to(tl.float32), 1)
        z0 = tl.zeros([BLOCK_M], tl.float32)
        z1 = tl.zeros([BLOCK_M], tl.float32)
        z2 = tl.zeros([BLOCK_M], tl.float32)
        z3 = tl.zeros([BLOCK_M], tl.float32)
        share = tl.cdiv(history_pages, PAGE_SPLITS)
        lo = split * share
        hi = tl.minimum(lo + share, history_pages)
        if window > 0:  # pages wholly before the window of the first query row are skipped
            lo = tl.maximum(lo, tl.maximum(old + m_block * BLOCK_M // G - window + 1 - S, 0) // P)
        bt_row = bt_ptr + slot.to(tl.int64) * bt_stride
        KEYS: tl.constexpr = BLOCK_N if BLOCK_N < P else P  # keys per step: a page or a part of one
        PARTS: tl.constexpr = P // KEYS
        for index in range(lo * PARTS, hi * PARTS):
            page = tl.load(bt_row + index // PARTS)
            page_ok = (page >= 0) & (page < num_pages)
            row0 = (tl.where(page_ok, page, 0).to(tl.int64) * HKV + h) * P + (index % PARTS) * KEYS
            s = _history_scores(q0, q1, q2, q3, qs0, qs1, qs2, qs3, kc_ptr, ks_ptr, kz_ptr, row0, KEYS, D, NG,
                                BITS)
            hist_pos = S + index * KEYS + tl.arange(0, KEYS)
            visible = page_ok & row_valid[:, None] & (hist_pos >= 0)[None, :]
            if window > 0:
                visible = visible & (query_pos[:, None] - hist_pos[None, :] < window)
            m, l, a0, a1, a2, a3, z0, z1, z2, z3 = _history_step(
                s, visible, m, l, a0, a1, a2, a3, z0, z1, z2, z3, vc_ptr, vs_ptr, vz_ptr, row0, KEYS, D, NG, BITS)
        # Back to plain units for the full-precision regions below and the output.
        a0 = a0 * UNIT_INV - z0[:, None]
        a1 = a1 * UNIT_INV - z1[:, None]
        a2 = a2 * UNIT_INV - z2[:, None]
        a3 = a3 * UNIT_INV - z3[:, None]

    if split == NUM_SPLITS - 1:
        head_row = slot.to(tl.int64) * HKV + h
        if S > 0:
            sink_pos = tl.arange(0, SINK_BLOCK)
            m, l, a0, a1, a2, a3 = _window_block(
                sink_k_ptr, sink_v_ptr, head_row * S + sink_pos, sink_pos < tl.minimum(old, S), sink_pos,
                q0, q1, q2, q3, query_pos, row_valid, window, m, l, a0, a1, a2, a3, D, None)
        for first in range(end_new, old, BLOCK_N):
            key_pos = first + tl.arange(0, BLOCK_N)
            m, l, a0, a1, a2, a3 = _window_block(
                ring_k_ptr, ring_v_ptr, head_row * C + (key_pos - S) % C, key_pos < old, key_pos,
                q0, q1, q2, q3, query_pos, row_valid, window, m, l, a0, a1, a2, a3, D, None)
        last_new = tl.minimum(count, (m_block * BLOCK_M + BLOCK_M - 1) // G + 1)
        for first in range(0, last_new, BLOCK_N):
            key_t = first + tl.arange(0, BLOCK_N)
            m, l, a0, a1, a2, a3 = _window_block(
                k_new_ptr, v_new_ptr, (start + key_t).to(tl.int64) * HKV + h, key_t < count, old + key_t,
                q0, q1, q2, q3, query_pos, row_valid, window, m, l, a0, a1, a2, a3, D,
                ring_v_ptr.dtype.element_ty)  # the step's values as the cache stores them

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
                     workspace: tuple | None, block_m: int = 16, block_n: int = 64, num_warps: int | None = None,
                     num_stages: int = 2) -> None:
    """q: [T, Hq, D]; k_new, v_new: [T, Hkv, D]; out: [T, Hq, D]. workspace: (part_o, part_lse) when splitting.

    num_warps None: one warp when a program's query rows fit one block and there are at least
    four programs per multiprocessor (decode at long context or large batch: measured fastest on
    the H100 with scripts/tune_attention.py), else four."""
    lay = layer.layout
    hq, d = q.shape[1], lay.head_dim
    group = hq // lay.kv_heads
    b = batch.batch
    if b == 0 or batch.max_new == 0:
        return
    if num_warps is None:
        programs = b * lay.kv_heads * num_splits
        many = q.device.type != "cuda" or programs >= 4 * _multiprocessors(q.device.index or 0)
        num_warps = 1 if batch.max_new * group <= block_m and many else 4
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
