"""Triton write path: center + rotate + clip + quantize + pack + store, and the ring flush.

Two parts per layer and step:
1. the flush (`_flush_block`) moves the ring tokens that age into the history to their pages;
2. the write (`_write_kernel`) rotates the step's new keys ((k - μ_K)·R_K in float32, rounded to
   the window dtype), returns them for the step's own attention, and stores every new token
   in its region: sink, ring, or quantized straight into a page (long prompts).
A step of many tokens runs them as separate launches, the flush first: a new token may take the ring row
of a token the flush just moved. A decode step (at most one new token per sequence) runs both in one
launch, since its token's row is never one the flush reads (`launch_write`). A prompt's keys and values run
as two launches (STREAM 0 and 1 of `_write_kernel`); other steps take both in one program.

Rows are processed as four contiguous quarters of D/4 channels, the planar packing of
`oscarkv.quant.format`: quarter i of a row is code plane i (INT2), so packing is shifts
and ors of whole tiles and every load and store is contiguous. The quantizer matches
`quantize` bit for bit on the same input: the clip threshold is the order statistic of
rank floor(c·D) (found by bisection, see `_clip_threshold`), divisions round to nearest, and scale and zero
are rounded to float16 before the codes are chosen.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .hardware import register_cap_supported

SCALE_FLOOR_REL = tl.constexpr(2.0**-15)  # = quant.format.ZERO_LIMIT_INV
FP16_SMALLEST = tl.constexpr(2.0**-24)  # smallest float16 subnormal


@triton.jit
def _group_min(a0, a1, a2, a3, NG: tl.constexpr):
    """Per-quarter minima -> the minimum of each quarter's group (NG groups per row)."""
    if NG == 1:
        m = tl.minimum(tl.minimum(a0, a1), tl.minimum(a2, a3))
        return m, m, m, m
    elif NG == 2:
        m01 = tl.minimum(a0, a1)
        m23 = tl.minimum(a2, a3)
        return m01, m01, m23, m23
    else:
        return a0, a1, a2, a3


@triton.jit
def _group_max(a0, a1, a2, a3, NG: tl.constexpr):
    if NG == 1:
        m = tl.maximum(tl.maximum(a0, a1), tl.maximum(a2, a3))
        return m, m, m, m
    elif NG == 2:
        m01 = tl.maximum(a0, a1)
        m23 = tl.maximum(a2, a3)
        return m01, m01, m23, m23
    else:
        return a0, a1, a2, a3


@triton.jit
def _abs_bits(x, SHIFT: tl.constexpr):
    """|x| as int32 bit patterns shifted right by SHIFT (non-negative floats order like their patterns)."""
    return tl.abs(x).to(tl.int32, bitcast=True) >> SHIFT


@triton.jit
def _bisect_step(b0, b1, b2, b3, lo, hi, RANK: tl.constexpr):
    """One bisection step over rows given as four quarters of bit patterns (counted per quarter)."""
    mid = lo + (hi - lo) // 2
    m = mid[:, None]
    count = (tl.sum((b0 <= m).to(tl.int32), 1) + tl.sum((b1 <= m).to(tl.int32), 1)
             + tl.sum((b2 <= m).to(tl.int32), 1) + tl.sum((b3 <= m).to(tl.int32), 1))
    enough = count > RANK
    return tl.where(enough, lo, mid + 1), tl.where(enough, mid, hi)


@triton.jit
def _clip_threshold(x0, x1, x2, x3, RANK: tl.constexpr, SHIFT: tl.constexpr, COMPILED: tl.constexpr):
    """Per row, the value of 0-based rank RANK in ascending |x|, exactly.

    Non-negative floats order like their int32 bit patterns, so a bisection over the patterns
    (a compare-and-count per step) finds the order statistic without a sort. The rows hold values
    of the window dtype, whose float32 patterns end in SHIFT zero bits (16 for bfloat16, 13 for
    float16), so 31 - SHIFT steps over the patterns shifted right by SHIFT are exact. For bfloat16 two
    15-bit patterns share one 32-bit word (`_packed_threshold`)."""
    if SHIFT == 16:
        return _packed_threshold(x0, x1, x2, x3, RANK, COMPILED)
    return _bisect_threshold(x0, x1, x2, x3, RANK, SHIFT)


@triton.jit
def _bisect_threshold(x0, x1, x2, x3, RANK: tl.constexpr, SHIFT: tl.constexpr):
    """`_clip_threshold` for any window dtype: a bisection over the int32 patterns shifted right by SHIFT, counted
    per quarter."""
    lo = tl.zeros([x0.shape[0]], tl.int32)
    hi = tl.full([x0.shape[0]], 0x7F800000 >> SHIFT, tl.int32)
    b0 = _abs_bits(x0, SHIFT)
    b1 = _abs_bits(x1, SHIFT)
    b2 = _abs_bits(x2, SHIFT)
    b3 = _abs_bits(x3, SHIFT)
    for _ in range(31 - SHIFT):
        lo, hi = _bisect_step(b0, b1, b2, b3, lo, hi, RANK)
    return (lo << SHIFT).to(tl.float32, bitcast=True)


@triton.jit
def _pack_patterns(a, b):
    """|a| and |b| (bfloat16 values) as 15-bit patterns in the high and low half of one uint32."""
    return ((_abs_bits(a, 16) << 16) | _abs_bits(b, 16)).to(tl.uint32, bitcast=True)


@triton.jit
def _below_or_equal(mid, p, COMPILED: tl.constexpr):
    """Per half of the packed words: FLAG (in that half) where the pattern is <= that half of `mid` (0x8000 | m in
    each half), else 0. 0x8000 + m - b stays within its half for 15-bit m and b, and its bit 15 says m >= b.
    COMPILED: one byte permute spreads bits 15 and 31 over the low bytes of their halves (FLAG 255, one instruction
    instead of a shift and a mask); the CPU interpreter, which has no inline PTX, shifts and masks (FLAG 1)."""
    if COMPILED:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 0x4B49;", "=r,r", [mid - p], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    else:
        return ((mid - p) >> 15) & 0x10001


@triton.jit
def _row_max_pattern(p0, p1):
    """Per row, the largest pattern of packed words (`_pack_patterns`), either half."""
    high = tl.max(tl.maximum(p0, p1), 1) >> 16  # the high half orders a word
    low = tl.max(tl.maximum(p0 & 0x7FFF, p1 & 0x7FFF), 1)
    return tl.maximum(high, low).to(tl.int32)


@triton.jit
def _packed_count(mid, p0, p1, COMPILED: tl.constexpr):
    """Per row, how many patterns of the packed words p0, p1 are <= mid: one compare per word for both halves and
    one row sum (each half of the sum is at most 255·D/2, so the halves never carry into each other)."""
    half = mid | 0x8000
    both = ((half << 16) | half).to(tl.uint32, bitcast=True)[:, None]
    flags = tl.sum(_below_or_equal(both, p0, COMPILED) + _below_or_equal(both, p1, COMPILED), 1)
    flags = flags.to(tl.int32, bitcast=True)
    total = (flags >> 16) + (flags & 0xFFFF)
    return total // 255 if COMPILED else total


@triton.jit
def _packed_threshold(x0, x1, x2, x3, RANK: tl.constexpr, COMPILED: tl.constexpr):
    """`_clip_threshold` for bfloat16 values: the patterns of quarters 0 and 1 share one word, and of 2 and 3
    another (`_pack_patterns`), so each bisection step is one compare per two values and one row sum
    (`_packed_count`).

    The bisection starts from each row's largest pattern M: the order statistic lies in [M - 511, M] whenever
    fewer than RANK + 1 patterns lie below M - 511 (a clip rank sits within 4 binades of the row's largest value
    unless a few outliers dwarf the rest), and 9 steps cover that window. One count checks it for every row; a
    block where some row fails searches [0, M - 512] for that row instead, in the full 15 steps."""
    WINDOW: tl.constexpr = 511
    p0 = _pack_patterns(x0, x1)
    p1 = _pack_patterns(x2, x3)
    hi = _row_max_pattern(p0, p1)
    lo = tl.maximum(hi - WINDOW, 0)
    inside = (lo == 0) | (_packed_count(tl.maximum(lo - 1, 0), p0, p1, COMPILED) <= RANK)  # the rank's is >= lo
    hi = tl.where(inside, hi, lo - 1)
    lo = tl.where(inside, lo, 0)
    steps = tl.where(tl.min(inside.to(tl.int32), 0) > 0, 9, 15)
    for _ in range(steps):
        mid = lo + (hi - lo) // 2
        enough = _packed_count(mid, p0, p1, COMPILED) > RANK
        lo, hi = tl.where(enough, lo, mid + 1), tl.where(enough, mid, hi)
    return (lo << 16).to(tl.float32, bitcast=True)


@triton.jit
def _clip(x0, x1, x2, x3, threshold):
    """Rows clipped to [-threshold, threshold] (threshold: one per row)."""
    t = threshold[:, None]
    return (tl.minimum(tl.maximum(x0, -t), t), tl.minimum(tl.maximum(x1, -t), t),
            tl.minimum(tl.maximum(x2, -t), t), tl.minimum(tl.maximum(x3, -t), t))


@triton.jit
def _scale_zero(lo, hi, LEVELS: tl.constexpr):
    """float16-rounded (scale, zero) of a group with range [lo, hi], as float32."""
    floor = tl.maximum(tl.maximum(tl.abs(lo), tl.abs(hi)) * SCALE_FLOOR_REL, FP16_SMALLEST)
    scale = tl.maximum(tl.math.div_rn(tl.maximum(hi - lo, 1e-8), LEVELS * 1.0), floor)
    scale = scale.to(tl.float16).to(tl.float32)
    zero = tl.math.div_rn(-lo, scale).to(tl.float16).to(tl.float32)
    return scale, zero


@triton.jit
def _codes(x, scale, zero, LEVELS: tl.constexpr, COMPILED: tl.constexpr):
    """floor(x·(1/s) + z + 0.5), clamped: each operation rounded to float32 (`quant.format.quantize`);
    the launches turn off fused multiply-adds, which would round x·(1/s) + z once. Clamped before the floor
    (the bounds are integers), so that floor and conversion are one instruction; COMPILED: that conversion
    also clamps at 0 (a float-to-unsigned conversion saturates)."""
    inverse = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    u = tl.minimum(x * inverse[:, None] + zero[:, None] + 0.5, LEVELS * 1.0)
    if COMPILED:
        return tl.inline_asm_elementwise("cvt.rmi.u32.f32 $0, $1;", "=r,r", [u], dtype=tl.int32, is_pure=True,
                                         pack=1)
    else:
        return tl.floor(tl.maximum(u, 0.0)).to(tl.int32)


@triton.jit
def _lloyd_codes(x, scale, zero, low, high):
    """INT2 codes at Lloyd–Max levels: [u >= low] + [u >= 1.5] + [u >= high], u = x·(1/s) + z rounded as
    in `_codes` (`quant.format.quantize`; low, high: `inner_thresholds`)."""
    inverse = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    u = x * inverse[:, None] + zero[:, None]
    return (u >= low).to(tl.int32) + (u >= 1.5).to(tl.int32) + (u >= high).to(tl.int32)


@triton.jit
def _quantize_store(x0, x1, x2, x3, valid, page, row, h, codes_ptr, scale_ptr, zero_ptr, low, high,
                    HKV: tl.constexpr, P: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, BITS: tl.constexpr,
                    LLOYD: tl.constexpr, COMPILED: tl.constexpr):
    """Quantize (clipped) rows given as quarters x0..x3 [BLOCK_T, D/4] (float32) into (page, row) of head h.
    LLOYD: INT2 codes at Lloyd–Max levels with thresholds low, 1.5, high (else uniform rounding)."""
    W: tl.constexpr = D // 4
    LEVELS: tl.constexpr = (1 << BITS) - 1
    cols = tl.arange(0, W)
    lo0, lo1, lo2, lo3 = _group_min(tl.min(x0, 1), tl.min(x1, 1), tl.min(x2, 1), tl.min(x3, 1), NG)
    hi0, hi1, hi2, hi3 = _group_max(tl.max(x0, 1), tl.max(x1, 1), tl.max(x2, 1), tl.max(x3, 1), NG)
    s0, z0 = _scale_zero(lo0, hi0, LEVELS)
    s1, z1 = _scale_zero(lo1, hi1, LEVELS)
    s2, z2 = _scale_zero(lo2, hi2, LEVELS)
    s3, z3 = _scale_zero(lo3, hi3, LEVELS)
    if LLOYD:
        c0 = _lloyd_codes(x0, s0, z0, low, high)
        c1 = _lloyd_codes(x1, s1, z1, low, high)
        c2 = _lloyd_codes(x2, s2, z2, low, high)
        c3 = _lloyd_codes(x3, s3, z3, low, high)
    else:
        c0 = _codes(x0, s0, z0, LEVELS, COMPILED)
        c1 = _codes(x1, s1, z1, LEVELS, COMPILED)
        c2 = _codes(x2, s2, z2, LEVELS, COMPILED)
        c3 = _codes(x3, s3, z3, LEVELS, COMPILED)
    base = (page.to(tl.int64) * HKV + h) * P + row  # [BLOCK_T] row index into the page arrays
    code_row = codes_ptr + base[:, None] * (D * BITS // 8) + cols[None, :]
    if BITS == 2:
        packed = c0 + (c1 << 2) + (c2 << 4) + (c3 << 6)  # adds, not ors: a shift and an add are one LEA
        tl.store(code_row, packed.to(tl.uint8), mask=valid[:, None])
    else:
        tl.store(code_row, (c0 + (c2 << 4)).to(tl.uint8), mask=valid[:, None])
        tl.store(code_row + W, (c1 + (c3 << 4)).to(tl.uint8), mask=valid[:, None])
    group = base * NG
    tl.store(scale_ptr + group, s0.to(tl.float16), mask=valid)
    tl.store(zero_ptr + group, z0.to(tl.float16), mask=valid)
    if NG == 2:
        tl.store(scale_ptr + group + 1, s2.to(tl.float16), mask=valid)
        tl.store(zero_ptr + group + 1, z2.to(tl.float16), mask=valid)
    if NG == 4:
        tl.store(scale_ptr + group + 1, s1.to(tl.float16), mask=valid)
        tl.store(zero_ptr + group + 1, z1.to(tl.float16), mask=valid)
        tl.store(scale_ptr + group + 2, s2.to(tl.float16), mask=valid)
        tl.store(zero_ptr + group + 2, z2.to(tl.float16), mask=valid)
        tl.store(scale_ptr + group + 3, s3.to(tl.float16), mask=valid)
        tl.store(zero_ptr + group + 3, z3.to(tl.float16), mask=valid)


@triton.jit
def _clip_quantize_store(x0, x1, x2, x3, valid, page, row, h, codes_ptr, scale_ptr, zero_ptr, low, high,
                         HKV: tl.constexpr, P: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, BITS: tl.constexpr,
                         CLIP: tl.constexpr, SHIFT: tl.constexpr, LLOYD: tl.constexpr, COMPILED: tl.constexpr):
    """Clip one stream's rows at their order statistic of rank CLIP (-1: no clip), quantize and store them into
    (page, row) of head h."""
    if CLIP >= 0:
        x0, x1, x2, x3 = _clip(x0, x1, x2, x3, _clip_threshold(x0, x1, x2, x3, CLIP, SHIFT, COMPILED))
    _quantize_store(x0, x1, x2, x3, valid, page, row, h, codes_ptr, scale_ptr, zero_ptr, low, high, HKV, P, D, NG,
                    BITS, LLOYD, COMPILED)


@triton.jit
def _sequence(b, slots_ptr, cu_ptr, len_ptr):
    """(slot, tokens stored before the step, first new-token row, new-token count) of sequence b."""
    start = tl.load(cu_ptr + b)
    return tl.load(slots_ptr + b), tl.load(len_ptr + b), start, tl.load(cu_ptr + b + 1) - start


@triton.jit
def _history_end(length, S: tl.constexpr, R: tl.constexpr, P: tl.constexpr):
    return S + P * (tl.maximum(length - S - R, 0) // P)


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """float32 x rounded to nearest-even in `dtype`, returned as float32.

    BF16 rounding is done on the bits: the CPU interpreter truncates on .to(tl.bfloat16),
    the GPU rounds, and both must store what the torch reference stores.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _round_quarters(x0, x1, x2, x3, dtype: tl.constexpr):
    """Four quarters rounded to `dtype` (`_round_to`)."""
    return _round_to(x0, dtype), _round_to(x1, dtype), _round_to(x2, dtype), _round_to(x3, dtype)


@triton.jit
def _store_window(ptr, row, valid, x0, x1, x2, x3, D: tl.constexpr):
    """Store quarters [BLOCK_T, D/4] at row offsets `row` (in units of D) of a window buffer."""
    W: tl.constexpr = D // 4
    dst = ptr + row.to(tl.int64)[:, None] * D + tl.arange(0, W)[None, :]
    tl.store(dst, x0.to(ptr.dtype.element_ty), mask=valid[:, None])
    tl.store(dst + W, x1.to(ptr.dtype.element_ty), mask=valid[:, None])
    tl.store(dst + 2 * W, x2.to(ptr.dtype.element_ty), mask=valid[:, None])
    tl.store(dst + 3 * W, x3.to(ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _load_quarters(ptr, row, valid, D: tl.constexpr):
    """Quarters [BLOCK, D/4] of the rows at offsets `row` (units of D), in their stored dtype."""
    W: tl.constexpr = D // 4
    src = ptr + row.to(tl.int64)[:, None] * D + tl.arange(0, W)[None, :]
    m = valid[:, None]
    return (tl.load(src, mask=m, other=0.0), tl.load(src + W, mask=m, other=0.0),
            tl.load(src + 2 * W, mask=m, other=0.0), tl.load(src + 3 * W, mask=m, other=0.0))


@triton.jit
def _load_window(ptr, row, valid, D: tl.constexpr):
    """Quarters [BLOCK_T, D/4] as float32 of the rows at offsets `row` (in units of D)."""
    x0, x1, x2, x3 = _load_quarters(ptr, row, valid, D)
    return x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)


@triton.jit
def _page_of(bt_ptr, bt_stride, slot, pos, valid, num_pages, S: tl.constexpr, P: tl.constexpr):
    """(page id, row in page, valid) of history positions; out-of-range page ids are masked off."""
    index = tl.maximum(pos - S, 0)
    page = tl.load(bt_ptr + slot.to(tl.int64) * bt_stride + index // P, mask=valid, other=0)
    valid = valid & (page >= 0) & (page < num_pages)
    return page, index % P, valid


@triton.jit
def _minus_key_shift(k0, k1, k2, k3, kshift_ptr, num_blocks, pos, valid, h, window_dtype: tl.constexpr,
                     HKV: tl.constexpr, D: tl.constexpr, S: tl.constexpr, P: tl.constexpr,
                     SHIFT_BLOCK: tl.constexpr):
    """History keys minus the shift of the block of their page's first position (key_centering="rope",
    `PagedLayer.shift_index`), rounded back to the window dtype: what the clip bisection expects."""
    W: tl.constexpr = D // 4
    first = S + (tl.maximum(pos - S, 0) // P) * P
    block = tl.minimum(first // SHIFT_BLOCK, num_blocks - 1)
    src = kshift_ptr + (block.to(tl.int64) * HKV + h)[:, None] * D + tl.arange(0, W)[None, :]
    m = valid[:, None]
    k0 = _round_to(k0 - tl.load(src, mask=m, other=0.0), window_dtype)
    k1 = _round_to(k1 - tl.load(src + W, mask=m, other=0.0), window_dtype)
    k2 = _round_to(k2 - tl.load(src + 2 * W, mask=m, other=0.0), window_dtype)
    k3 = _round_to(k3 - tl.load(src + 3 * W, mask=m, other=0.0), window_dtype)
    return k0, k1, k2, k3


@triton.jit
def _flush_block(b, block, h, STREAM: tl.constexpr, slots_ptr, cu_ptr, len_ptr, bt_ptr, bt_stride, num_pages,
                 kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, ring_k_ptr, ring_v_ptr, kshift_ptr, num_blocks,
                 k_low, k_high, v_low, v_high,
                 HKV: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                 P: tl.constexpr, S: tl.constexpr, R: tl.constexpr,
                 CLIP_K: tl.constexpr, CLIP_V: tl.constexpr, SHIFT: tl.constexpr, BLOCK_T: tl.constexpr,
                 KEY_SHIFTS: tl.constexpr, SHIFT_BLOCK: tl.constexpr, K_LLOYD: tl.constexpr, V_LLOYD: tl.constexpr,
                 COMPILED: tl.constexpr):
    """Block `block` of the ring tokens of (sequence b, KV head h) that age into the history this step: their keys
    (STREAM 0), values (1) or both (2) quantized into their pages (nothing for a block past them)."""
    C: tl.constexpr = R + P
    slot, old, start, count = _sequence(b, slots_ptr, cu_ptr, len_ptr)
    first = _history_end(old, S, R, P)
    stop = tl.minimum(old, _history_end(old + count, S, R, P))
    if block * BLOCK_T < stop - first:
        pos = first + block * BLOCK_T + tl.arange(0, BLOCK_T)
        valid = pos < stop
        ring_row = (slot.to(tl.int64) * HKV + h) * C + (pos - S) % C
        page, row, valid = _page_of(bt_ptr, bt_stride, slot, pos, valid, num_pages, S, P)
        if STREAM != 0:
            v0, v1, v2, v3 = _load_window(ring_v_ptr, ring_row, valid, D)  # first, as in `_write_kernel`
        if STREAM != 1:
            k0, k1, k2, k3 = _load_window(ring_k_ptr, ring_row, valid, D)
            if KEY_SHIFTS:
                k0, k1, k2, k3 = _minus_key_shift(k0, k1, k2, k3, kshift_ptr, num_blocks, pos, valid, h,
                                                  ring_k_ptr.dtype.element_ty, HKV, D, S, P, SHIFT_BLOCK)
            _clip_quantize_store(k0, k1, k2, k3, valid, page, row, h, kc_ptr, ks_ptr, kz_ptr, k_low, k_high,
                                 HKV, P, D, NG, K_BITS, CLIP_K, SHIFT, K_LLOYD, COMPILED)
        if STREAM != 0:
            _clip_quantize_store(v0, v1, v2, v3, valid, page, row, h, vc_ptr, vs_ptr, vz_ptr, v_low, v_high,
                                 HKV, P, D, NG, V_BITS, CLIP_V, SHIFT, V_LLOYD, COMPILED)


@triton.jit
def _flush_kernel(slots_ptr, cu_ptr, len_ptr, bt_ptr, bt_stride, num_pages,
                  kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, ring_k_ptr, ring_v_ptr, kshift_ptr, num_blocks,
                  k_low, k_high, v_low, v_high,
                  HKV: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                  P: tl.constexpr, S: tl.constexpr, R: tl.constexpr,
                  CLIP_K: tl.constexpr, CLIP_V: tl.constexpr, SHIFT: tl.constexpr, BLOCK_T: tl.constexpr,
                  KEY_SHIFTS: tl.constexpr, SHIFT_BLOCK: tl.constexpr, K_LLOYD: tl.constexpr = False,
                  V_LLOYD: tl.constexpr = False, COMPILED: tl.constexpr = True):
    """The flush alone (`_flush_block`), keys then values. COMPILED: compiled for a GPU (False in the CPU
    interpreter: no inline PTX)."""
    _flush_block(tl.program_id(0), tl.program_id(1), tl.program_id(2), 2, slots_ptr, cu_ptr, len_ptr, bt_ptr,
                 bt_stride, num_pages, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, ring_k_ptr, ring_v_ptr,
                 kshift_ptr, num_blocks, k_low, k_high, v_low, v_high, HKV, D, NG, K_BITS, V_BITS, P, S, R,
                 CLIP_K, CLIP_V, SHIFT, BLOCK_T, KEY_SHIFTS, SHIFT_BLOCK, K_LLOYD, V_LLOYD, COMPILED)


@triton.jit
def _rotate_by_pieces(x, pieces_ptr, mean_rot_ptr, h, BLOCK_T: tl.constexpr, D: tl.constexpr,
                      CENTER: tl.constexpr, COMPILED: tl.constexpr):
    """k·R_K - μ_K·R_K for bfloat16 keys x [BLOCK_T, D], as quarters [BLOCK_T, D/4] in float32.

    R_K comes as three bfloat16 pieces whose sum is R_K to float32 accuracy, with the columns
    interleaved (column 4j + i of a piece is column j of quarter i; `ops.rotation_pieces`). Products of
    two bfloat16 are exact in float32, so three tensor-core dots with float32 accumulation compute
    the float32 rotation. One full-width dot per piece, then the interleaved columns split into
    the quarters. COMPILED is False in the CPU interpreter, whose bfloat16 dot is wrong: it
    multiplies the same values in float32.
    """
    W: tl.constexpr = D // 4
    cols = tl.arange(0, D)
    acc = tl.zeros([BLOCK_T, D], tl.float32)
    if CENTER:
        acc -= tl.load(mean_rot_ptr + h * D + cols)[None, :]
    if not COMPILED:
        x = x.to(tl.float32)
    for i in tl.static_range(3):  # the smallest piece first
        piece = tl.load(pieces_ptr + (2 - i) * D * D + cols[:, None] * D + cols[None, :])
        if COMPILED:
            acc = tl.dot(x, piece, acc)
        else:
            acc = tl.dot(x, piece.to(tl.float32), acc, input_precision="ieee")
    even, odd = tl.split(tl.reshape(acc, [BLOCK_T, W, 2, 2]))
    k0, k2 = tl.split(even)
    k1, k3 = tl.split(odd)
    return k0, k1, k2, k3


@triton.jit
def _write_kernel(k_ptr, v_ptr, k_rot_ptr, rot_ptr, rot_head_stride, mean_ptr, pieces_ptr, mean_rot_ptr,
                  slots_ptr, cu_ptr, len_ptr, bt_ptr, bt_stride, num_pages,
                  kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                  sink_k_ptr, sink_v_ptr, ring_k_ptr, ring_v_ptr, kshift_ptr, num_blocks,
                  k_low, k_high, v_low, v_high,
                  HKV: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                  P: tl.constexpr, S: tl.constexpr, R: tl.constexpr,
                  CLIP_K: tl.constexpr, CLIP_V: tl.constexpr, SHIFT: tl.constexpr,
                  ROTATE: tl.constexpr, CENTER: tl.constexpr, BLOCK_T: tl.constexpr,
                  KEY_SHIFTS: tl.constexpr, SHIFT_BLOCK: tl.constexpr, COMPILED: tl.constexpr = True,
                  K_LLOYD: tl.constexpr = False, V_LLOYD: tl.constexpr = False, FLUSH_BLOCKS: tl.constexpr = 0,
                  STREAM: tl.constexpr = 2):
    """One token block of KV head `program_id(2)`: its keys (STREAM 0), its values (STREAM 1), or both, one after
    the other (STREAM 2). STREAM 3: axis 2 runs over 2·HKV, the keys of head h at h and its values at HKV + h, so
    one launch holds both streams in separate programs (`_write_block`).

    ROTATE: 0 none; 1 (k - μ_K)·R_K with float32 dots (tf32x3), R_K at rot_ptr; 2 bfloat16 keys by
    the pieces of R_K at pieces_ptr (`_rotate_by_pieces`). rot_head_stride is 0 for one R_K per
    layer and the elements between two KV heads' matrices (rot_ptr or pieces_ptr) for one per head.

    COMPILED: compiled for a GPU; False in the CPU interpreter (no bfloat16 dots, no inline PTX).

    FLUSH_BLOCKS > 0: block 0 of axis 1 is the write's and blocks 1..FLUSH_BLOCKS the flush's
    (`_flush_block`), in one launch. Only for steps of at most one new token per sequence, whose
    ring row is never one that the flush reads (see `launch_write`)."""
    b = tl.program_id(0)
    block = tl.program_id(1)
    h = tl.program_id(2)
    if FLUSH_BLOCKS > 0:
        if block > 0:
            _flush_block(b, block - 1, h, STREAM, slots_ptr, cu_ptr, len_ptr, bt_ptr, bt_stride, num_pages, kc_ptr,
                         ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, ring_k_ptr, ring_v_ptr, kshift_ptr, num_blocks, k_low,
                         k_high, v_low, v_high, HKV, D, NG, K_BITS, V_BITS, P, S, R, CLIP_K, CLIP_V, SHIFT,
                         BLOCK_T, KEY_SHIFTS, SHIFT_BLOCK, K_LLOYD, V_LLOYD, COMPILED)
            return
    if STREAM == 3:
        if h >= HKV:  # a values program
            _write_block(b, block, h - HKV, k_ptr, v_ptr, k_rot_ptr, rot_ptr, rot_head_stride, mean_ptr, pieces_ptr,
                         mean_rot_ptr, slots_ptr, cu_ptr, len_ptr, bt_ptr, bt_stride, num_pages, kc_ptr, ks_ptr,
                         kz_ptr, vc_ptr, vs_ptr, vz_ptr, sink_k_ptr, sink_v_ptr, ring_k_ptr, ring_v_ptr, kshift_ptr,
                         num_blocks, k_low, k_high, v_low, v_high, HKV, D, NG, K_BITS, V_BITS, P, S, R, CLIP_K,
                         CLIP_V, SHIFT, ROTATE, CENTER, BLOCK_T, KEY_SHIFTS, SHIFT_BLOCK, COMPILED, K_LLOYD, V_LLOYD,
                         1)
            return
    OWN_STREAM: tl.constexpr = 0 if STREAM == 3 else STREAM  # STREAM 3's keys programs
    _write_block(b, block, h, k_ptr, v_ptr, k_rot_ptr, rot_ptr, rot_head_stride, mean_ptr, pieces_ptr, mean_rot_ptr,
                 slots_ptr, cu_ptr, len_ptr, bt_ptr, bt_stride, num_pages, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr,
                 vz_ptr, sink_k_ptr, sink_v_ptr, ring_k_ptr, ring_v_ptr, kshift_ptr, num_blocks, k_low, k_high, v_low,
                 v_high, HKV, D, NG, K_BITS, V_BITS, P, S, R, CLIP_K, CLIP_V, SHIFT, ROTATE, CENTER, BLOCK_T,
                 KEY_SHIFTS, SHIFT_BLOCK, COMPILED, K_LLOYD, V_LLOYD, OWN_STREAM)


@triton.jit
def _write_block(b, block, h, k_ptr, v_ptr, k_rot_ptr, rot_ptr, rot_head_stride, mean_ptr, pieces_ptr, mean_rot_ptr,
                 slots_ptr, cu_ptr, len_ptr, bt_ptr, bt_stride, num_pages,
                 kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                 sink_k_ptr, sink_v_ptr, ring_k_ptr, ring_v_ptr, kshift_ptr, num_blocks,
                 k_low, k_high, v_low, v_high,
                 HKV: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                 P: tl.constexpr, S: tl.constexpr, R: tl.constexpr,
                 CLIP_K: tl.constexpr, CLIP_V: tl.constexpr, SHIFT: tl.constexpr,
                 ROTATE: tl.constexpr, CENTER: tl.constexpr, BLOCK_T: tl.constexpr,
                 KEY_SHIFTS: tl.constexpr, SHIFT_BLOCK: tl.constexpr, COMPILED: tl.constexpr,
                 K_LLOYD: tl.constexpr, V_LLOYD: tl.constexpr, STREAM: tl.constexpr):
    """Token block `block` of sequence b and KV head h (`_write_kernel`): keys (STREAM 0), values (1) or both (2)."""
    W: tl.constexpr = D // 4
    C: tl.constexpr = R + P
    slot, old, start, count = _sequence(b, slots_ptr, cu_ptr, len_ptr)
    if block * BLOCK_T < count:
        t = block * BLOCK_T + tl.arange(0, BLOCK_T)
        valid = t < count
        pos = old + t
        end_new = _history_end(old + count, S, R, P)
        row_in = (start + t).to(tl.int64) * HKV + h  # row of the [T, Hkv, D] inputs, in units of D
        window_dtype = ring_k_ptr.dtype.element_ty
        in_sink = valid & (pos < S)
        sink_row = (slot.to(tl.int64) * HKV + h) * S + pos
        in_ring = valid & (pos >= end_new)
        ring_row = (slot.to(tl.int64) * HKV + h) * C + (pos - S) % C
        # Straight into pages only for long prompts; decode tokens always land in the ring, and the
        # quantizer (the clip bisection) is skipped for blocks with no history row.
        first_pos = old + block * BLOCK_T
        last_pos = old + tl.minimum(count, block * BLOCK_T + BLOCK_T) - 1
        to_pages = (first_pos < end_new) & (last_pos >= S)
        in_history = valid & (pos >= S) & (pos < end_new)

        if STREAM != 0:
            # Values are loaded first: in one program (STREAM 2) their load then overlaps the keys' rotation and
            # stores instead of waiting behind them (a decode step's write is mostly that latency).
            v0, v1, v2, v3 = _load_window(v_ptr, row_in, valid, D)
            if v_ptr.dtype.element_ty != window_dtype:
                v0, v1, v2, v3 = _round_quarters(v0, v1, v2, v3, window_dtype)
        if STREAM != 1:
            # Keys: center and rotate in float32, round to the window dtype (what every region holds).
            if ROTATE == 2:
                cols = tl.arange(0, D)
                x = tl.load(k_ptr + row_in[:, None] * D + cols[None, :], mask=valid[:, None], other=0.0)
                k0, k1, k2, k3 = _rotate_by_pieces(x, pieces_ptr + h * rot_head_stride, mean_rot_ptr, h, BLOCK_T, D,
                                                   CENTER, COMPILED)
            elif ROTATE == 1:
                cols = tl.arange(0, D)
                x = tl.load(k_ptr + row_in[:, None] * D + cols[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
                if CENTER:
                    x = x - tl.load(mean_ptr + h * D + cols)[None, :]
                r_rows = rot_ptr + h * rot_head_stride + cols[:, None] * D + tl.arange(0, W)[None, :]
                k0 = tl.dot(x, tl.load(r_rows), input_precision="tf32x3")
                k1 = tl.dot(x, tl.load(r_rows + W), input_precision="tf32x3")
                k2 = tl.dot(x, tl.load(r_rows + 2 * W), input_precision="tf32x3")
                k3 = tl.dot(x, tl.load(r_rows + 3 * W), input_precision="tf32x3")
            else:
                k0, k1, k2, k3 = _load_window(k_ptr, row_in, valid, D)
                if CENTER:
                    mean = mean_ptr + h * D + tl.arange(0, W)
                    k0 = k0 - tl.load(mean)[None, :]
                    k1 = k1 - tl.load(mean + W)[None, :]
                    k2 = k2 - tl.load(mean + 2 * W)[None, :]
                    k3 = k3 - tl.load(mean + 3 * W)[None, :]
            k0, k1, k2, k3 = _round_quarters(k0, k1, k2, k3, window_dtype)
            _store_window(k_rot_ptr, row_in, valid, k0, k1, k2, k3, D)
            _store_window(sink_k_ptr, sink_row, in_sink, k0, k1, k2, k3, D)
            _store_window(ring_k_ptr, ring_row, in_ring, k0, k1, k2, k3, D)
            if to_pages:
                if ROTATE > 0:
                    # The dots leave the keys in their accumulator layout, where the quantizer's row sums cost about
                    # 2.4x the instructions and the kernel 239 registers instead of 154: read the rows just stored
                    # back instead (k_rot holds the window dtype, so they are the same values).
                    tl.debug_barrier()
                    k0, k1, k2, k3 = _load_window(k_rot_ptr, row_in, valid, D)
                page, row, stored = _page_of(bt_ptr, bt_stride, slot, pos, in_history, num_pages, S, P)
                if KEY_SHIFTS:
                    k0, k1, k2, k3 = _minus_key_shift(k0, k1, k2, k3, kshift_ptr, num_blocks, pos, stored, h,
                                                      window_dtype, HKV, D, S, P, SHIFT_BLOCK)
                _clip_quantize_store(k0, k1, k2, k3, stored, page, row, h, kc_ptr, ks_ptr, kz_ptr, k_low, k_high,
                                     HKV, P, D, NG, K_BITS, CLIP_K, SHIFT, K_LLOYD, COMPILED)
        if STREAM != 0:
            _store_window(sink_v_ptr, sink_row, in_sink, v0, v1, v2, v3, D)
            _store_window(ring_v_ptr, ring_row, in_ring, v0, v1, v2, v3, D)
            if to_pages:
                page, row, stored = _page_of(bt_ptr, bt_stride, slot, pos, in_history, num_pages, S, P)
                _clip_quantize_store(v0, v1, v2, v3, stored, page, row, h, vc_ptr, vs_ptr, vz_ptr, v_low, v_high,
                                     HKV, P, D, NG, V_BITS, CLIP_V, SHIFT, V_LLOYD, COMPILED)


def lloyd_thresholds(inner: float | None) -> tuple[float, float]:
    """(low, high) decision thresholds of a stream's INT2 codes (`quant.format.inner_thresholds`);
    unused (0, 0) for the uniform grid."""
    from ..quant.format import inner_thresholds

    return inner_thresholds(inner) if inner is not None else (0.0, 0.0)


def clip_rank(clip_ratio: float, head_dim: int) -> int:
    """0-based rank of the clip threshold in ascending |x| (as `quant.format.clip_rows`); -1 = no clip."""
    if clip_ratio <= 0:
        return -1
    return min(int(clip_ratio * head_dim), head_dim - 1)


def pattern_shift(dtype) -> int:
    """Trailing zero bits of the float32 pattern of every value of the window dtype `dtype`."""
    import torch

    return {torch.bfloat16: 16, torch.float16: 13}.get(dtype, 0)


# Register cap of a prompt's write launch (STREAM 3), whose keys' and values' programs share one kernel and so one
# register count: 157 with Triton 3.6 for sm_90, under the cap, so three programs share a multiprocessor. A guard
# for compilers that allocate more: a prototype of this launch took 182 registers and ran 227 µs for a 32K-token
# prompt against 192 µs capped at 168 (docs/kernels-log.md, "Write: keys and values in separate programs").
PROMPT_WRITE_REGISTERS = 168
# Warps per program of a decode step's merged flush-and-write launch: 1, 2 and 8 were slower or no faster on the
# H100 (docs/data/combine-write-warps-h100.txt).
DECODE_WRITE_WARPS = 4


# The cache arguments of the write and flush kernels, which a decode step's query/key launch takes too
# (`triton_decode_qk`); `flush_arguments` gives them by name.
WRITE_POINTERS = ("slots_ptr", "cu_ptr", "len_ptr", "bt_ptr", "bt_stride", "num_pages", "kc_ptr", "ks_ptr", "kz_ptr",
                  "vc_ptr", "vs_ptr", "vz_ptr", "sink_k_ptr", "sink_v_ptr", "ring_k_ptr", "ring_v_ptr", "kshift_ptr",
                  "num_blocks", "k_low", "k_high", "v_low", "v_high")
FLUSH_TOKENS = 16  # tokens per flush program (the smallest dot), also the write's block for short steps


def flush_arguments(layer, batch, clip_k: float, clip_v: float, decode: bool) -> tuple[int, dict]:
    """(flush programs per sequence and KV head, the cache arguments and constexprs of the flush by name:
    `WRITE_POINTERS` and the layout's). decode: a step of one token per sequence ages at most one page out of the
    ring; a longer one up to the whole ring."""
    from .ops import interpreting

    lay = layer.layout
    d = lay.head_dim
    bt = batch.block_table
    shifts = layer.key_shifts if layer.key_shifts is not None else layer.ring_k  # (unused without key shifts)
    k_low, k_high = lloyd_thresholds(lay.key_inner)
    v_low, v_high = lloyd_thresholds(lay.value_inner)
    arguments = dict(
        slots_ptr=batch.slots, cu_ptr=batch.cu_new, len_ptr=batch.lengths, bt_ptr=bt, bt_stride=bt.stride(0),
        num_pages=layer.num_pages, kc_ptr=layer.k_codes, ks_ptr=layer.k_scale, kz_ptr=layer.k_zero,
        vc_ptr=layer.v_codes, vs_ptr=layer.v_scale, vz_ptr=layer.v_zero, sink_k_ptr=layer.sink_k,
        sink_v_ptr=layer.sink_v, ring_k_ptr=layer.ring_k, ring_v_ptr=layer.ring_v, kshift_ptr=shifts,
        num_blocks=shifts.shape[0] if layer.key_shifts is not None else 1, k_low=k_low, k_high=k_high, v_low=v_low,
        v_high=v_high,
        HKV=lay.kv_heads, D=d, NG=lay.groups, K_BITS=lay.key_bits, V_BITS=lay.value_bits, P=lay.page_size,
        S=lay.sink_tokens, R=lay.recent_tokens, CLIP_K=clip_rank(clip_k, d), CLIP_V=clip_rank(clip_v, d),
        SHIFT=pattern_shift(layer.ring_k.dtype), BLOCK_T=FLUSH_TOKENS, KEY_SHIFTS=layer.key_shifts is not None,
        SHIFT_BLOCK=max(layer.shift_block, 1), K_LLOYD=lay.key_inner is not None,
        V_LLOYD=lay.value_inner is not None, COMPILED=not interpreting())
    return triton.cdiv(lay.page_size if decode else lay.ring_capacity, FLUSH_TOKENS), arguments


def launch_write(layer, batch, k, v, k_rot, rotation, mean, clip_k: float, clip_v: float, pieces=None,
                 merge: bool = True) -> None:
    """Run flush then write on the GPU (or under TRITON_INTERPRET=1); a longer step's flush launch only where a ring
    token ages out (`StepBatch.ages_out`). Shapes as in `reference`;
    pieces: `ops.RotationPieces` to rotate bfloat16 keys by (ROTATE=2), else float32 dots.

    A step of at most one new token per sequence (decode) runs both in one launch: its new token
    sits at ring row (old - S) mod (R + P), and the tokens that age out lie in
    [history_end(old), history_end(old + 1)), after old - R - P, so none of them shares that row.
    Longer steps may reuse a row the flush reads: two launches, the flush first (also with merge=False).

    The launches start when the one before them has ended. Launched early instead (programmatic
    dependent launch, waiting first), the merged launch made the Qwen3-4B decode step 0.08 ms slower
    at 30K and 0.06 ms faster at 100K on the H100 (docs/data/write-launch-ablation-h100.txt)."""
    from .ops import interpreting

    lay = layer.layout
    d = lay.head_dim
    b = batch.batch
    if b == 0:
        return
    merged = merge and batch.max_new == 1
    flush_blocks, cache = flush_arguments(layer, batch, clip_k, clip_v, decode=merged)
    cache["enable_fp_fusion"] = False  # the quantizer rounds x·(1/s) and + z apart, as the reference
    if not merged:
        if batch.ages_out:
            flush_only = {name: value for name, value in cache.items() if name not in ("sink_k_ptr", "sink_v_ptr")}
            _flush_kernel[(b, flush_blocks, lay.kv_heads)](**flush_only)
        if batch.max_new == 0:
            return
    # Long steps (prompts) with D <= 128 take blocks of 64 tokens: a quarter of the programs, each
    # loading R_K once. A sweep on the H100 (32K tokens, 8 KV heads, D = 128, 2 to 8 warps, blocks of
    # 16 to 128 tokens) found 64 tokens with 4 warps fastest, 2.0x faster than 16; 32 tokens spill.
    # Short steps (decode) keep blocks of 16 for latency.
    # Prompts run keys and values in separate programs of one launch (STREAM 3, capped at PROMPT_WRITE_REGISTERS): a
    # program for both streams needs 238 registers (two programs per multiprocessor), one for either 157 (three).
    # On the H100 one launch took 181.3-182.0 us for a 32K-token prompt against 188.1-189.3 us for two (STREAM 0,
    # then 1; docs/kernels-log.md), which a Triton without register caps still takes. Other steps keep both streams in
    # one program (STREAM 2): a decode step's write is mostly the rotation of one key per head, and twice the
    # programs made the whole-model step slower.
    write_block = 64 if batch.max_new >= 64 and d <= 128 else FLUSH_TOKENS
    write_blocks = triton.cdiv(batch.max_new, write_block)
    if write_block != 64:
        launches = ((2, lay.kv_heads, {}),)
    elif interpreting():
        launches = ((3, 2 * lay.kv_heads, {}),)
    elif register_cap_supported():
        launches = ((3, 2 * lay.kv_heads, dict(maxnreg=PROMPT_WRITE_REGISTERS)),)
    else:
        launches = ((0, lay.kv_heads, {}), (1, lay.kv_heads, {}))
    if pieces is not None:
        rotate, stride = 2, pieces.head_stride
        mean_rotated = pieces.mean_rotated if pieces.mean_rotated is not None else k
    else:
        rotate = 0 if rotation is None else 1
        stride = d * d if rotation is not None and rotation.dim() == 3 else 0
        mean_rotated = k
    for stream, heads, registers in launches:
        grid = (b, write_blocks + (flush_blocks if merged else 0), heads)
        _write_kernel[grid](k, v, k_rot, rotation if rotation is not None else k, stride,
                            mean if mean is not None else k,
                            pieces.pieces if pieces is not None else k, mean_rotated,
                            ROTATE=rotate, CENTER=mean is not None,
                            FLUSH_BLOCKS=flush_blocks if merged else 0, STREAM=stream,
                            **dict(cache, BLOCK_T=write_block), **registers,
                            **(dict(num_warps=DECODE_WRITE_WARPS) if merged else {}))
