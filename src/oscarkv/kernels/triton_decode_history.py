"""Triton decode history launch with transposed tiles: history tokens are the rows, query heads the columns.

The decode step's history splits (`triton_attention`, REGIONS=1) compute a [16, P] score tile per
page: 16 rows because that is the smallest tensor-core tile Triton gives the query side, of which a
GQA group of 4 uses 4. This launch computes the transposed tile [P, N] instead, N = the group's
query heads rounded up to 8 (the narrow side of the m16n8k16 tensor-core instruction):

- scores: for each of the eight code slices s (`triton_attention._slice_layout`), codes [P, D/8] (the
  page's int16 words masked, read as float16 units) times the query slice [D/8, N];
- the online softmax runs down the columns (one running max and sum per query head);
- values: for each slice, the transposed code words [D/8, P] times the weights [P, N], into
  accumulators [D/8, N];
- the zero correction: the value zero points broadcast to [16, P], times the weights.

Each thread then holds half the score elements and half the accumulator registers of the
[16, P] orientation, and the tensor cores run half the instructions. What it computes is what
the REGIONS=1 launch computes (`attention_reference`), for the case it serves: one new token
per sequence, INT2 keys and values with uniform levels, head_dim >= 128, no sliding window.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_attention import (UNIT_INV, _high_bytes, _masked_units, _page_param_offsets, _page_row,
                               _slice_layout)
from .triton_pdl import gdc_launch_dependents as _gdc_launch_dependents, gdc_wait as _gdc_wait
from .triton_write import _history_end, _sequence


@triton.jit
def _query_columns(q_ptr, q_row, column_valid, qk_scale, s: tl.constexpr, D: tl.constexpr):
    """Query slice s as columns [D/8, N] float16 (scaled, divided by the slice's multiplier) and the
    column sums of that float16 slice times the multiplier [N] (exact: powers of two)."""
    offset, parity, mult = _slice_layout(s, D, 2)
    channels = 2 * tl.arange(0, D // 8) + parity + offset
    q = tl.load(q_ptr + q_row[None, :] * D + channels[:, None], mask=column_valid[None, :], other=0.0)
    q = (q.to(tl.float32) * (qk_scale / mult)).to(tl.float16)
    return q, tl.sum(q.to(tl.float32), 0) * mult


@triton.jit
def _code_tile(w0, h0, s: tl.constexpr, ASM: tl.constexpr):
    """INT2 slice s of a page's words as float16 units [P, D/8] (`triton_attention._slice_codes`)."""
    return _masked_units(w0 if s < 4 else h0, 3 << (2 * (s % 4)), ASM)


@triton.jit
def _group_dot(d0, d1, d2, d3, a, b, s: tl.constexpr, NG: tl.constexpr):
    """d_g += a·b for g = the group of slice s."""
    g: tl.constexpr = (s % 4) * NG // 4  # the quantization group of slice s's channels
    if g == 0:
        d0 = tl.dot(a, b, d0)
    elif g == 1:
        d1 = tl.dot(a, b, d1)
    elif g == 2:
        d2 = tl.dot(a, b, d2)
    else:
        d3 = tl.dot(a, b, d3)
    return d0, d1, d2, d3


@triton.jit
def _group_scores(d, scale_ptr, zero_ptr, row0, g: tl.constexpr, NG: tl.constexpr, P: tl.constexpr, q_sum):
    """Scores [P, N] of group g from d = codes·q (units of 2^-24): s·2^24·d - s·z·Σq."""
    at = _page_param_offsets(row0, g, NG, P)
    scale = tl.load(scale_ptr + at).to(tl.float32)
    zero = tl.load(zero_ptr + at).to(tl.float32)
    return d * (scale * UNIT_INV)[:, None] - (scale * zero)[:, None] * q_sum[None, :]


@triton.jit
def _page_scores(w0, h0, qc0, qc1, qc2, qc3, qc4, qc5, qc6, qc7, g0, g1, g2, g3, ks_ptr, kz_ptr, row0,
                 N: tl.constexpr, P: tl.constexpr, NG: tl.constexpr, ASM: tl.constexpr):
    """[P, N] float32 scores of one page of INT2 keys (words w0, high bytes h0) against the query columns."""
    d0 = tl.zeros([P, N], tl.float32)
    d1 = d0
    d2 = d0
    d3 = d0
    d0, d1, d2, d3 = _group_dot(d0, d1, d2, d3, _code_tile(w0, h0, 0, ASM), qc0, 0, NG)
    d0, d1, d2, d3 = _group_dot(d0, d1, d2, d3, _code_tile(w0, h0, 1, ASM), qc1, 1, NG)
    d0, d1, d2, d3 = _group_dot(d0, d1, d2, d3, _code_tile(w0, h0, 2, ASM), qc2, 2, NG)
    d0, d1, d2, d3 = _group_dot(d0, d1, d2, d3, _code_tile(w0, h0, 3, ASM), qc3, 3, NG)
    d0, d1, d2, d3 = _group_dot(d0, d1, d2, d3, _code_tile(w0, h0, 4, ASM), qc4, 4, NG)
    d0, d1, d2, d3 = _group_dot(d0, d1, d2, d3, _code_tile(w0, h0, 5, ASM), qc5, 5, NG)
    d0, d1, d2, d3 = _group_dot(d0, d1, d2, d3, _code_tile(w0, h0, 6, ASM), qc6, 6, NG)
    d0, d1, d2, d3 = _group_dot(d0, d1, d2, d3, _code_tile(w0, h0, 7, ASM), qc7, 7, NG)
    s = _group_scores(d0, ks_ptr, kz_ptr, row0, 0, NG, P, g0)
    if NG >= 2:
        s += _group_scores(d1, ks_ptr, kz_ptr, row0, 1, NG, P, g1)
    if NG == 4:
        s += _group_scores(d2, ks_ptr, kz_ptr, row0, 2, NG, P, g2)
        s += _group_scores(d3, ks_ptr, kz_ptr, row0, 3, NG, P, g3)
    return s


@triton.jit
def _weights(p, vs_ptr, vz_ptr, row0, g: tl.constexpr, NG: tl.constexpr, P: tl.constexpr, z):
    """Group g's probabilities times the value scales, float16 [P, N], and the zero correction
    z [16, N] + (zero points broadcast to [16, P])·weights: every row holds Σ p·s·z, from the same
    rounded weights as the value dots (products of float16 are exact in float32, so they cancel)."""
    at = _page_param_offsets(row0, g, NG, P)
    scale = tl.load(vs_ptr + at).to(tl.float32)
    zero = tl.load(vz_ptr + at)  # float16, as the dot takes it
    weight = (p * scale[:, None]).to(tl.float16)
    return weight, tl.dot(tl.broadcast_to(zero[None, :], (16, P)), weight, z)


@triton.jit
def _value_dot(acc, v0, vh0, s: tl.constexpr, wt0, wt1, wt2, wt3, NG: tl.constexpr, ASM: tl.constexpr):
    """acc [D/8, N] + (value codes of slice s)ᵀ · (the weights of its group)."""
    g: tl.constexpr = (s % 4) * NG // 4  # the quantization group of slice s's channels
    if g == 0:
        weight = wt0
    elif g == 1:
        weight = wt1
    elif g == 2:
        weight = wt2
    else:
        weight = wt3
    return tl.dot(tl.trans(_code_tile(v0, vh0, s, ASM)), weight, acc)


@triton.jit
def _store_slice(part_o_ptr, part, column_valid, acc, s: tl.constexpr, z0, z1, z2, z3, l_safe, D: tl.constexpr,
                 NG: tl.constexpr):
    """Stores slice s of the split's output, (acc·2^24/mult - Σ p·s·z) / l, into its channels."""
    offset, parity, mult = _slice_layout(s, D, 2)
    g: tl.constexpr = (s % 4) * NG // 4  # the quantization group of slice s's channels
    if g == 0:
        z = z0
    elif g == 1:
        z = z1
    elif g == 2:
        z = z2
    else:
        z = z3
    channels = 2 * tl.arange(0, D // 8) + parity + offset
    out = (acc * (UNIT_INV / mult) - z[None, :]) / l_safe[None, :]
    tl.store(part_o_ptr + part[None, :] * D + channels[:, None], out, mask=column_valid[None, :])


@triton.jit
def _decode_history_kernel(
        q_ptr, part_o_ptr, part_lse_ptr, slots_ptr, cu_ptr, len_ptr, bt_ptr, bt_stride, num_pages,
        kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, qk_scale, shift_ptr, num_blocks,
        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, P: tl.constexpr, S: tl.constexpr,
        R: tl.constexpr, NUM_SPLITS: tl.constexpr, WINDOW_SPLITS: tl.constexpr, N: tl.constexpr,
        ASM: tl.constexpr = True, KEY_SHIFTS: tl.constexpr = False, SHIFT_BLOCK: tl.constexpr = 1,
        OVERLAP: tl.constexpr = 0):
    """History split `program_id(2)` of (sequence, KV head) `program_id(0)`: partial output and log-sum-exp
    of the sequence's new token's G query heads over its share of the INT2 history pages, stored as split
    WINDOW_SPLITS + program_id(2) of NUM_SPLITS for `_combine_kernel`. OVERLAP as in `_paged_attention_kernel`."""
    if OVERLAP >= 1:
        _gdc_launch_dependents()
    pid = tl.program_id(0)
    history_split = tl.program_id(2)
    b = pid // HKV
    h = pid % HKV
    G: tl.constexpr = HQ // HKV
    U: tl.constexpr = D // 8
    slot, old, start, count = _sequence(b, slots_ptr, cu_ptr, len_ptr)
    if count == 0:
        if OVERLAP == 2:
            _gdc_wait()
        return
    c = tl.arange(0, N)
    column_valid = c < G
    q_row = start.to(tl.int64) * HQ + h * G + c
    qc0, qsum0 = _query_columns(q_ptr, q_row, column_valid, qk_scale, 0, D)
    qc1, qsum1 = _query_columns(q_ptr, q_row, column_valid, qk_scale, 1, D)
    qc2, qsum2 = _query_columns(q_ptr, q_row, column_valid, qk_scale, 2, D)
    qc3, qsum3 = _query_columns(q_ptr, q_row, column_valid, qk_scale, 3, D)
    qc4, qsum4 = _query_columns(q_ptr, q_row, column_valid, qk_scale, 4, D)
    qc5, qsum5 = _query_columns(q_ptr, q_row, column_valid, qk_scale, 5, D)
    qc6, qsum6 = _query_columns(q_ptr, q_row, column_valid, qk_scale, 6, D)
    qc7, qsum7 = _query_columns(q_ptr, q_row, column_valid, qk_scale, 7, D)
    # query sums per group, for the key zero points (slice s: group (s % 4)·NG/4, parities s and s + 4)
    if NG == 1:
        g0 = qsum0 + qsum1 + qsum2 + qsum3 + qsum4 + qsum5 + qsum6 + qsum7
        g1, g2, g3 = g0, g0, g0
    elif NG == 2:
        g0 = qsum0 + qsum1 + qsum4 + qsum5
        g1 = qsum2 + qsum3 + qsum6 + qsum7
        g2, g3 = g0, g0
    else:
        g0 = qsum0 + qsum4
        g1 = qsum1 + qsum5
        g2 = qsum2 + qsum6
        g3 = qsum3 + qsum7

    # One new token (count == 1 <= R): the history it reads ends at a page edge.
    hist_limit = tl.minimum(old, _history_end(old + count, S, R, P))
    history_pages = tl.cdiv(tl.maximum(hist_limit - S, 0), P)
    PAGE_SPLITS: tl.constexpr = NUM_SPLITS - WINDOW_SPLITS
    share = tl.cdiv(history_pages, PAGE_SPLITS)
    lo = history_split * share
    hi = tl.minimum(lo + share, history_pages)
    bt_row = bt_ptr + slot.to(tl.int64) * bt_stride

    m = tl.full([N], float("-inf"), tl.float32)
    l = tl.zeros([N], tl.float32)
    acc0 = tl.zeros([U, N], tl.float32)
    acc1 = tl.zeros([U, N], tl.float32)
    acc2 = tl.zeros([U, N], tl.float32)
    acc3 = tl.zeros([U, N], tl.float32)
    acc4 = tl.zeros([U, N], tl.float32)
    acc5 = tl.zeros([U, N], tl.float32)
    acc6 = tl.zeros([U, N], tl.float32)
    acc7 = tl.zeros([U, N], tl.float32)
    z0 = tl.zeros([16, N], tl.float32)  # zero corrections, every row the same
    z1 = tl.zeros([16, N], tl.float32)
    z2 = tl.zeros([16, N], tl.float32)
    z3 = tl.zeros([16, N], tl.float32)
    NW: tl.constexpr = D // 8  # int16 words per row (INT2)
    words = tl.arange(0, P)[:, None] * NW + tl.arange(0, U)[None, :]
    for index in range(lo, hi):
        row0, page_ok = _page_row(bt_row, index, hi, num_pages, h, HKV, P, False)
        kw = tl.load(kc_ptr.to(tl.pointer_type(tl.int16)) + row0 * NW + words)
        s = _page_scores(kw, _high_bytes(kw, ASM), qc0, qc1, qc2, qc3, qc4, qc5, qc6, qc7, g0, g1, g2, g3,
                         ks_ptr, kz_ptr, row0, N, P, NG, ASM)
        if KEY_SHIFTS:
            block = tl.minimum((S + index * P) // SHIFT_BLOCK, num_blocks - 1)
            s += tl.load(shift_ptr + q_row * num_blocks + block, mask=column_valid, other=0.0)[None, :]
        s += tl.where(page_ok, 0.0, float("-inf"))  # an invalid page id: the whole page masked
        m_new = tl.maximum(m, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[None, :])
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(p, 0)
        if tl.max((m_new > m).to(tl.int32), 0) > 0:  # alpha is exactly 1 on columns whose max did not grow
            acc0 *= alpha[None, :]
            acc1 *= alpha[None, :]
            acc2 *= alpha[None, :]
            acc3 *= alpha[None, :]
            acc4 *= alpha[None, :]
            acc5 *= alpha[None, :]
            acc6 *= alpha[None, :]
            acc7 *= alpha[None, :]
            z0 *= alpha[None, :]
            if NG >= 2:
                z1 *= alpha[None, :]
            if NG == 4:
                z2 *= alpha[None, :]
                z3 *= alpha[None, :]
        m = m_new
        vw = tl.load(vc_ptr.to(tl.pointer_type(tl.int16)) + row0 * NW + words)
        vh = _high_bytes(vw, ASM)
        wt0, z0 = _weights(p, vs_ptr, vz_ptr, row0, 0, NG, P, z0)
        wt1, wt2, wt3 = wt0, wt0, wt0
        if NG >= 2:
            wt1, z1 = _weights(p, vs_ptr, vz_ptr, row0, 1, NG, P, z1)
        if NG == 4:
            wt2, z2 = _weights(p, vs_ptr, vz_ptr, row0, 2, NG, P, z2)
            wt3, z3 = _weights(p, vs_ptr, vz_ptr, row0, 3, NG, P, z3)
        acc0 = _value_dot(acc0, vw, vh, 0, wt0, wt1, wt2, wt3, NG, ASM)
        acc1 = _value_dot(acc1, vw, vh, 1, wt0, wt1, wt2, wt3, NG, ASM)
        acc2 = _value_dot(acc2, vw, vh, 2, wt0, wt1, wt2, wt3, NG, ASM)
        acc3 = _value_dot(acc3, vw, vh, 3, wt0, wt1, wt2, wt3, NG, ASM)
        acc4 = _value_dot(acc4, vw, vh, 4, wt0, wt1, wt2, wt3, NG, ASM)
        acc5 = _value_dot(acc5, vw, vh, 5, wt0, wt1, wt2, wt3, NG, ASM)
        acc6 = _value_dot(acc6, vw, vh, 6, wt0, wt1, wt2, wt3, NG, ASM)
        acc7 = _value_dot(acc7, vw, vh, 7, wt0, wt1, wt2, wt3, NG, ASM)

    za = tl.max(z0, 0)
    zb = tl.max(z1, 0) if NG >= 2 else za
    zc = tl.max(z2, 0) if NG == 4 else za
    zd = tl.max(z3, 0) if NG == 4 else za
    l_safe = tl.where(l > 0, l, 1.0)
    part = q_row * NUM_SPLITS + WINDOW_SPLITS + history_split
    tl.store(part_lse_ptr + part, tl.where(l > 0, m + tl.log2(l_safe), float("-inf")), mask=column_valid)
    _store_slice(part_o_ptr, part, column_valid, acc0, 0, za, zb, zc, zd, l_safe, D, NG)
    _store_slice(part_o_ptr, part, column_valid, acc1, 1, za, zb, zc, zd, l_safe, D, NG)
    _store_slice(part_o_ptr, part, column_valid, acc2, 2, za, zb, zc, zd, l_safe, D, NG)
    _store_slice(part_o_ptr, part, column_valid, acc3, 3, za, zb, zc, zd, l_safe, D, NG)
    _store_slice(part_o_ptr, part, column_valid, acc4, 4, za, zb, zc, zd, l_safe, D, NG)
    _store_slice(part_o_ptr, part, column_valid, acc5, 5, za, zb, zc, zd, l_safe, D, NG)
    _store_slice(part_o_ptr, part, column_valid, acc6, 6, za, zb, zc, zd, l_safe, D, NG)
    _store_slice(part_o_ptr, part, column_valid, acc7, 7, za, zb, zc, zd, l_safe, D, NG)
    if OVERLAP == 2:
        _gdc_wait()


def history_columns(group: int) -> int:
    """N: the query heads of a GQA group rounded up to a power of two, at least 8."""
    return max(8, triton.next_power_of_2(group))
