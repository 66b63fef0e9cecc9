"""Triton read path: attention of a step's queries over the paged mixed-precision cache.

One kernel serves decode (one new token per sequence) and prefill/extend (a chunk of
new tokens); `oscarkv.kernels.reference.attention_reference` is what it computes.

Work split. A program owns one (sequence, KV head), a block of query rows and one split
of the sequence. Query rows are (new token, query head of the GQA group) pairs, so every
history page is loaded once for all query heads that share it. With N > 1 splits, the first
WS splits share the BF16 windows (sink, stored ring tokens, the step's own tokens, causal)
and the other N - WS share the INT2/INT4 history; each writes its partial output and
log-sum-exp, and `_combine_kernel` merges them (flash-decoding). Decode launches the history
splits and the window splits separately, so that the history programs (one warp each where there
are at least as many as multiprocessors, `ops.history_warps`) keep a small register footprint.
With N = 1 one program does everything and writes the output directly (prefill).

Dequantization costs no conversion instructions: each code c becomes a float16 with the same
bits (an exact subnormal), and the dots run on those raw codes with float16
queries/probabilities and float32 accumulation. Each token's scale s and zero z are applied
to the small score tile (s·2^24·(q·c) - s·z·Σq) and folded into the probabilities for the
values (Σ p·s·c·2^24 - Σ p·s·z), never to the [tokens, D] tiles. For D >= 128 the history
is read as int16 words and split into eight "slices" with one 32-bit AND per pair of words
(see the comment above `_slice_layout`); D = 64 widens the bytes to 16-bit lanes once and
takes four "quarter slices" with the same AND. The online softmax works in base 2 with the
softmax scale folded into the queries. With key shifts (key_centering="rope") each history page's scores get the term
q·shift of its block, computed once per step by `_score_shift_kernel`. INT2 streams with
Lloyd–Max levels (`quant.format`) add one high-bit dot per code tile (`_lloyd_dot`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..errors import OscarError
from . import gluon_history
from .arrival_counts import arrival_counts
from .gluon_history import HistoryKernel
from .hardware import programmatic_launch_supported, register_cap_supported
from .triton_pdl import gdc_launch_dependents as _gdc_launch_dependents, gdc_wait as _gdc_wait
from .triton_pdl import programmatic as _programmatic
from .triton_write import _history_end, _load_quarters, _round_to, _sequence

LOG2E = 1.4426950408889634
COMBINE_WARPS = 4  # 2 and 8 were slower or no faster on the H100 (docs/data/combine-write-warps-h100.txt)
BLOCK_M_CHOICES = (8, 16, 32)  # query rows per program that `launch_attention` takes (16: every decode and prefill)

UNIT_INV = tl.constexpr(16777216.0)  # 2^24: codes enter the dots as c·mult·2^-24 (see `_slice_layout`)
# Columns of the value zero corrections' tile (`_weighted_codes_mma`): every column holds the same sums, and 8 is the
# narrow side of the m16n8k16 tile, so the correction takes 4 tensor-core dots per page and group instead of 8.
ZERO_COLUMNS = tl.constexpr(8)


@triton.jit
def _page_param_offsets(row0, g: tl.constexpr, NG: tl.constexpr, P: tl.constexpr):
    """Offsets [P] of group g's scale and zero for the P rows of one (page, KV head)."""
    return (row0 + tl.arange(0, P)) * NG + g


@triton.jit
def _page_params(scale_ptr, zero_ptr, row0, g: tl.constexpr, NG: tl.constexpr, P: tl.constexpr):
    """Scale and zero [P] float32 of group g for the P rows of one (page, KV head)."""
    at = _page_param_offsets(row0, g, NG, P)
    return tl.load(scale_ptr + at).to(tl.float32), tl.load(zero_ptr + at).to(tl.float32)


# History scores stay in the units of the dots until the softmax: d = q·c of the unscaled float16 queries counts
# in units of 2^-24 (the codes' float16 bits, `_masked_units`), and q·(c - z)·s = s·(2^24·d - z·Σq) is kept
# as s·(d - z·Σq/unit), unit being 2^24 (UNIT_INV) or 3a·2^24 for Lloyd–Max levels, where d = q·(c + kappa·b1)
# (`_lloyd_dot`). Two fused multiply-adds per element and group give it (Σq/unit is one number per query row),
# and the softmax multiplies by unit times the softmax scale (the kernel's `score_units`) in the fused
# multiply-add that feeds exp2 (`_softmax_weights`). A bias (-inf for a masked key, or a key-shift term divided
# by the score units) joins the last one.


@triton.jit
def _group_scores(d, scale_ptr, zero_ptr, row0, g: tl.constexpr, NG: tl.constexpr, P: tl.constexpr, q_sum,
                  acc=None):
    """acc + the scores of group g of one page in units of the dots, s·(d - z·Σq/unit) (see above; q_sum:
    [BLOCK_M], Σq/unit of the group's channels)."""
    scale, zero = _page_params(scale_ptr, zero_ptr, row0, g, NG, P)
    s = scale[None, :] * (d - q_sum[:, None] * zero[None, :])
    if acc is not None:
        s = acc + s
    return s


# Lloyd–Max levels (INT2, `quant.format`): level(c) = 3a·(c + kappa·b1), b1 the code's high bit. The
# dots keep running on raw codes: one more dot per code tile, of the high bits against the query
# (or the probabilities) times kappa, and 3a joins the 2^24 that turns units back into values.


@triton.jit
def _lloyd_dot(a, b, hb, a_kappa, acc, LLOYD: tl.constexpr):
    """a·b (+ acc) and, with LLOYD, + a_kappa·hb: the dot of one code tile b whose high bits are hb,
    a_kappa being the operand a times kappa (float16)."""
    acc = tl.dot(a, b, acc)
    if LLOYD:
        acc = tl.dot(a_kappa, hb, acc)
    return acc


@triton.jit
def _times(x, factor, LLOYD: tl.constexpr):
    """x·factor as float16 (the kappa operand of `_lloyd_dot`); x itself without LLOYD (unused there)."""
    if LLOYD:
        return (x.to(tl.float32) * factor).to(tl.float16)
    else:
        return x


@triton.jit
def _unit(unit, LLOYD: tl.constexpr):
    """The factor from dot units to values: `unit` (3a·2^24) with LLOYD, else 2^24."""
    if LLOYD:
        return unit
    else:
        return UNIT_INV


# Sliced history path. D >= 128: the codes of a history row, read as int16 words, hold 8
# "slices" of D/8 channels each (INT2: one slice per 2-bit field of the word; INT4: 4 fields
# of each half of the row). A slice is extracted from a [P, D/8] word tile with one AND (and,
# for the high byte, one shift shared by its slices), and read as float16 with the same
# bits: c·mult·2^-24, an exact subnormal, where mult = 2^(field's bit offset) is folded into
# the query (scores) or divided out of the accumulator (values). Because the word and the
# float16 have the same width, each pair of adjacent words in a thread's mma fragment
# becomes a pair of float16 with one 32-bit instruction: no byte permutes, and the multipliers
# stay <= 64 so that the scaled queries stay normal float16 numbers. Slice s covers channels
# 2u + parity(s) + offset(s), u < D/8.
#
# D = 64 (D/8 = 8 is below the smallest dot): 4 "quarter slices" of D/4 channels. A row's bytes
# [P, D/4] (INT4: two such tiles) are widened once to 16-bit lanes, one byte each, and slice s
# is one field of every lane, extracted with the same AND: channels offset(s) + u, u < D/4.
# Until the forty-seventh session D = 64 shifted each field down and converted it byte by byte:
# 1544 SASS instructions per page of its history loop against 1097 for the sliced D = 128 page
# of twice the codes (`scripts/count_history_instructions.py`).


@triton.jit
def _slice_layout(s: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """(channel offset, parity, multiplier) of slice s; see the comment above (quarter slices: parity 0)."""
    if D < 128:  # quarter slices; INT4: the first D/4 bytes hold quarters 0 (low) and 2, the next 1 and 3
        if BITS == 2:
            offset: tl.constexpr = s * (D // 4)
            mult: tl.constexpr = 4 ** s
        else:
            offset: tl.constexpr = ((s // 2) + (s % 2) * 2) * (D // 4)
            mult: tl.constexpr = 16 if s % 2 == 1 else 1
        parity: tl.constexpr = 0
    elif BITS == 2:
        offset: tl.constexpr = (s % 4) * (D // 4)
        parity: tl.constexpr = s // 4
        mult: tl.constexpr = 4 ** (s % 4)
    else:
        offset: tl.constexpr = (s // 4) * (D // 4) + (s % 2) * (D // 2)
        parity: tl.constexpr = (s % 4) // 2
        mult: tl.constexpr = 16 if s % 2 == 1 else 1
    return offset, parity, mult


@triton.jit
def _masked_units(w, MASK: tl.constexpr, ASM: tl.constexpr):
    """(w & MASK) of int16 words, read as float16 with the same bits. ASM: one 32-bit AND per pair
    of words (the compiler otherwise masks each 16-bit half and re-packs them with byte permutes);
    the CPU interpreter, which has no inline assembly, takes the plain expression."""
    if ASM:
        mask = tl.full(w.shape, MASK, tl.int16)
        return tl.inline_asm_elementwise("and.b32 $0, $1, $2;", "=r,r,r", [w, mask], dtype=tl.float16,
                                         is_pure=True, pack=2)
    else:
        return (w & MASK).to(tl.float16, bitcast=True)


@triton.jit
def _high_bytes(w, ASM: tl.constexpr):
    """w >> 8 of int16 words; only the low 8 bits of the result are used (see `_slice_codes`)."""
    if ASM:
        return tl.inline_asm_elementwise("shr.b32 $0, $1, 8;", "=r,r", [w], dtype=tl.int16, is_pure=True, pack=2)
    else:
        return w >> 8


@triton.jit
def _slice_codes(w0, w1, h0, h1, s: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """Slice s as float16 units, from the word tiles w0 (words [0, D/8)) and w1 (INT4: [D/8, D/4))
    and their high bytes h0, h1 (`_high_bytes`); quarter slices: from the widened byte tiles w0, w1."""
    if D < 128 and BITS == 4:
        return _masked_units(w0 if s < 2 else w1, 240 if s % 2 == 1 else 15, ASM)
    elif BITS == 2:  # slices 0-3 are fields of w0 (both layouts), 4-7 of the high bytes h0
        return _masked_units(w0 if s < 4 else h0, 3 << (2 * (s % 4)), ASM)
    else:
        if s % 4 >= 2:
            w = h0 if s < 4 else h1
        else:
            w = w0 if s < 4 else w1
        return _masked_units(w, 240 if s % 2 == 1 else 15, ASM)


@triton.jit
def _slice_high_bits(w0, h0, s: tl.constexpr, ASM: tl.constexpr):
    """The high bits of INT2 slice s's codes as float16 units (2·b1·mult·2^-24; see `_slice_codes`)."""
    return _masked_units(w0 if s < 4 else h0, 2 << (2 * (s % 4)), ASM)


@triton.jit
def _page_words(codes_ptr, row0, P: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """Word tiles [P, D/8] int16 of one (page, KV head) from row `row0`: w0 and, for INT4, w1,
    and their high bytes (see `_slice_codes`). Quarter slices (D = 64): the byte tiles [P, D/4] widened to
    int16, w0 and (INT4) w1, returned again in place of the high bytes."""
    if D < 128:
        W: tl.constexpr = D // 4
        ROW_BYTES: tl.constexpr = D * BITS // 8
        src = codes_ptr + row0 * ROW_BYTES + (tl.arange(0, P) * ROW_BYTES)[:, None] + tl.arange(0, W)[None, :]
        b0 = tl.load(src).to(tl.int16)
        b1 = tl.load(src + W).to(tl.int16) if BITS == 4 else b0
        return b0, b1, b0, b1
    else:
        U: tl.constexpr = D // 8
        NW: tl.constexpr = D * BITS // 16
        src = codes_ptr.to(tl.pointer_type(tl.int16)) + row0 * NW + (tl.arange(0, P) * NW)[:, None] + \
            tl.arange(0, U)[None, :]
        w0 = tl.load(src)
        w1 = tl.load(src + U) if BITS == 4 else w0
        return w0, w1, _high_bytes(w0, ASM), _high_bytes(w1, ASM) if BITS == 4 else w0


@triton.jit
def _add_to_group(d0, d1, d2, d3, x, s: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, BITS: tl.constexpr):
    """Adds x to d_g, g the group of slice s's channels."""
    if BITS == 2:
        g: tl.constexpr = (s % 4) * NG // 4
    elif D < 128:  # INT4 quarter slices (`_slice_layout`)
        g: tl.constexpr = ((s // 2) + (s % 2) * 2) * NG // 4
    else:
        g: tl.constexpr = ((s // 4) + (s % 2) * 2) * NG // 4
    if g == 0:
        d0 += x
    elif g == 1:
        d1 += x
    elif g == 2:
        d2 += x
    else:
        d3 += x
    return d0, d1, d2, d3


@triton.jit
def _query_slice(q_ptr, q_row, row_valid, s: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Query channels of slice s divided by the slice's multiplier, as float16, and the row sums of the
    float16 query times the multiplier (exact: powers of two). Not scaled: the softmax scale joins the
    scores' unit (`_softmax_weights`), so that a bfloat16 query stays exact in float16."""
    offset, parity, mult = _slice_layout(s, D, BITS)
    if D < 128:
        cols = offset + tl.arange(0, D // 4)
    else:
        cols = 2 * tl.arange(0, D // 8) + parity + offset
    q = tl.load(q_ptr + q_row[:, None] * D + cols[None, :], mask=row_valid[:, None], other=0.0)
    q = (q.to(tl.float32) * (1.0 / mult)).to(tl.float16)
    return q, tl.sum(q.to(tl.float32), 1) * mult


@triton.jit
def _slice_scores(qs, qk, w0, w1, h0, h1, s: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                  ASM: tl.constexpr, LLOYD: tl.constexpr, acc=None):
    """q·c (+ acc) of one slice: [BLOCK_M, P] in units of 2^-24; with LLOYD, q·(c + kappa·b1), qk being
    the slice's query times kappa/2 (its high bits read as 2·b1)."""
    high = tl.trans(_slice_high_bits(w0, h0, s, ASM)) if LLOYD else None
    return _lloyd_dot(qs, tl.trans(_slice_codes(w0, w1, h0, h1, s, D, BITS, ASM)), high, qk, acc, LLOYD)


@triton.jit
def _sliced_scores(qs0, qs1, qs2, qs3, qs4, qs5, qs6, qs7, qk0, qk1, qk2, qk3, qk4, qk5, qk6, qk7,
                   qsum0, qsum1, qsum2, qsum3, w0, w1, h0, h1, ks_ptr, kz_ptr, row0, bias, P: tl.constexpr,
                   D: tl.constexpr, NG: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, LLOYD: tl.constexpr):
    """bias + the [BLOCK_M, P] float32 scores, in units of the dots, against one page of quantized keys (sliced
    path; qsum_g: Σq/unit of group g; qk_s: the slices times kappa/2 for Lloyd–Max levels)."""
    if NG == 1:
        d = _slice_scores(qs0, qk0, w0, w1, h0, h1, 0, D, BITS, ASM, LLOYD)
        d = _slice_scores(qs1, qk1, w0, w1, h0, h1, 1, D, BITS, ASM, LLOYD, d)
        d = _slice_scores(qs2, qk2, w0, w1, h0, h1, 2, D, BITS, ASM, LLOYD, d)
        d = _slice_scores(qs3, qk3, w0, w1, h0, h1, 3, D, BITS, ASM, LLOYD, d)
        if D >= 128:
            d = _slice_scores(qs4, qk4, w0, w1, h0, h1, 4, D, BITS, ASM, LLOYD, d)
            d = _slice_scores(qs5, qk5, w0, w1, h0, h1, 5, D, BITS, ASM, LLOYD, d)
            d = _slice_scores(qs6, qk6, w0, w1, h0, h1, 6, D, BITS, ASM, LLOYD, d)
            d = _slice_scores(qs7, qk7, w0, w1, h0, h1, 7, D, BITS, ASM, LLOYD, d)
        return _group_scores(d, ks_ptr, kz_ptr, row0, 0, NG, P, qsum0, bias)
    else:
        d0 = tl.zeros([qs0.shape[0], P], tl.float32)
        d1 = tl.zeros([qs0.shape[0], P], tl.float32)
        d2 = tl.zeros([qs0.shape[0], P], tl.float32)
        d3 = tl.zeros([qs0.shape[0], P], tl.float32)
        d0, d1, d2, d3 = _add_to_group(d0, d1, d2, d3, _slice_scores(qs0, qk0, w0, w1, h0, h1, 0, D, BITS, ASM,
                                                                     LLOYD), 0, D, NG, BITS)
        d0, d1, d2, d3 = _add_to_group(d0, d1, d2, d3, _slice_scores(qs1, qk1, w0, w1, h0, h1, 1, D, BITS, ASM,
                                                                     LLOYD), 1, D, NG, BITS)
        d0, d1, d2, d3 = _add_to_group(d0, d1, d2, d3, _slice_scores(qs2, qk2, w0, w1, h0, h1, 2, D, BITS, ASM,
                                                                     LLOYD), 2, D, NG, BITS)
        d0, d1, d2, d3 = _add_to_group(d0, d1, d2, d3, _slice_scores(qs3, qk3, w0, w1, h0, h1, 3, D, BITS, ASM,
                                                                     LLOYD), 3, D, NG, BITS)
        if D >= 128:
            d0, d1, d2, d3 = _add_to_group(d0, d1, d2, d3, _slice_scores(qs4, qk4, w0, w1, h0, h1, 4, D, BITS, ASM,
                                                                         LLOYD), 4, D, NG, BITS)
            d0, d1, d2, d3 = _add_to_group(d0, d1, d2, d3, _slice_scores(qs5, qk5, w0, w1, h0, h1, 5, D, BITS, ASM,
                                                                         LLOYD), 5, D, NG, BITS)
            d0, d1, d2, d3 = _add_to_group(d0, d1, d2, d3, _slice_scores(qs6, qk6, w0, w1, h0, h1, 6, D, BITS, ASM,
                                                                         LLOYD), 6, D, NG, BITS)
            d0, d1, d2, d3 = _add_to_group(d0, d1, d2, d3, _slice_scores(qs7, qk7, w0, w1, h0, h1, 7, D, BITS, ASM,
                                                                         LLOYD), 7, D, NG, BITS)
        s = _group_scores(d0, ks_ptr, kz_ptr, row0, 0, NG, P, qsum0, bias)
        s = _group_scores(d1, ks_ptr, kz_ptr, row0, 1, NG, P, qsum1, s)
        if NG == 4:
            s = _group_scores(d2, ks_ptr, kz_ptr, row0, 2, NG, P, qsum2, s)
            s = _group_scores(d3, ks_ptr, kz_ptr, row0, 3, NG, P, qsum3, s)
        return s


@triton.jit
def _sliced_values(s: tl.constexpr, wz0, wz1, wz2, wz3, wk0, wk1, wk2, wk3, acc, v0, v1, vh0, vh1,
                   D: tl.constexpr, NG: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, LLOYD: tl.constexpr):
    """acc + (weights of slice s's group) · (value codes of slice s); with LLOYD also + (the weights
    times kappa/2, wk_g) · (their high bits)."""
    if BITS == 2:
        g: tl.constexpr = (s % 4) * NG // 4
    elif D < 128:  # INT4 quarter slices (`_slice_layout`)
        g: tl.constexpr = ((s // 2) + (s % 2) * 2) * NG // 4
    else:
        g: tl.constexpr = ((s // 4) + (s % 2) * 2) * NG // 4
    if g == 0:
        weight, weight_k = wz0, wk0
    elif g == 1:
        weight, weight_k = wz1, wk1
    elif g == 2:
        weight, weight_k = wz2, wk2
    else:
        weight, weight_k = wz3, wk3
    high = _slice_high_bits(v0, vh0, s, ASM) if LLOYD else None
    return _lloyd_dot(weight, _slice_codes(v0, v1, vh0, vh1, s, D, BITS, ASM), high, weight_k, acc, LLOYD)


@triton.jit
def _rescaled(alpha, grew, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, z0, z1, z2, z3, NG: tl.constexpr,
              D: tl.constexpr):
    """The sliced path's sums times alpha where a row's running max grew (`grew`; alpha is exactly 1
    on the other rows, so the common case skips the work); acc4..acc7 only with 8 slices (D >= 128)."""
    if grew:
        z0 *= alpha[:, None]
        if NG >= 2:
            z1 *= alpha[:, None]
        if NG == 4:
            z2 *= alpha[:, None]
            z3 *= alpha[:, None]
        acc0 *= alpha[:, None]
        acc1 *= alpha[:, None]
        acc2 *= alpha[:, None]
        acc3 *= alpha[:, None]
        if D >= 128:
            acc4 *= alpha[:, None]
            acc5 *= alpha[:, None]
            acc6 *= alpha[:, None]
            acc7 *= alpha[:, None]
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, z0, z1, z2, z3


@triton.jit
def _page_values(p, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, z0, z1, z2, z3, vc_ptr, vs_ptr, vz_ptr, row0,
                 half_kappa, P: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, BITS: tl.constexpr,
                 ASM: tl.constexpr, LLOYD: tl.constexpr):
    """Adds one page of quantized values, weighted by the probabilities p [BLOCK_M, P], to the slice
    sums acc_s (Σ p·s·c·mult_s in units of 2^-24; LLOYD: Σ p·s·(c + kappa·b1)·mult_s) and to the zero
    corrections z_g (every column of [BLOCK_M, ZERO_COLUMNS] holds Σ p·s·z of group g)."""
    v0, v1, vh0, vh1 = _page_words(vc_ptr, row0, P, D, BITS, ASM)
    w0, z0 = _weighted_codes_mma(p, z0, vs_ptr, vz_ptr, row0, 0, NG, P)
    w1, w2, w3 = w0, w0, w0
    if NG >= 2:
        w1, z1 = _weighted_codes_mma(p, z1, vs_ptr, vz_ptr, row0, 1, NG, P)
    if NG == 4:
        w2, z2 = _weighted_codes_mma(p, z2, vs_ptr, vz_ptr, row0, 2, NG, P)
        w3, z3 = _weighted_codes_mma(p, z3, vs_ptr, vz_ptr, row0, 3, NG, P)
    k0 = _times(w0, half_kappa, LLOYD)
    k1, k2, k3 = k0, k0, k0
    if NG >= 2:
        k1 = _times(w1, half_kappa, LLOYD)
    if NG == 4:
        k2 = _times(w2, half_kappa, LLOYD)
        k3 = _times(w3, half_kappa, LLOYD)
    acc0 = _sliced_values(0, w0, w1, w2, w3, k0, k1, k2, k3, acc0, v0, v1, vh0, vh1, D, NG, BITS, ASM, LLOYD)
    acc1 = _sliced_values(1, w0, w1, w2, w3, k0, k1, k2, k3, acc1, v0, v1, vh0, vh1, D, NG, BITS, ASM,
                          LLOYD)
    acc2 = _sliced_values(2, w0, w1, w2, w3, k0, k1, k2, k3, acc2, v0, v1, vh0, vh1, D, NG, BITS, ASM,
                          LLOYD)
    acc3 = _sliced_values(3, w0, w1, w2, w3, k0, k1, k2, k3, acc3, v0, v1, vh0, vh1, D, NG, BITS, ASM,
                          LLOYD)
    if D >= 128:  # quarter slices (D = 64) have four
        acc4 = _sliced_values(4, w0, w1, w2, w3, k0, k1, k2, k3, acc4, v0, v1, vh0, vh1, D, NG, BITS, ASM,
                              LLOYD)
        acc5 = _sliced_values(5, w0, w1, w2, w3, k0, k1, k2, k3, acc5, v0, v1, vh0, vh1, D, NG, BITS, ASM,
                              LLOYD)
        acc6 = _sliced_values(6, w0, w1, w2, w3, k0, k1, k2, k3, acc6, v0, v1, vh0, vh1, D, NG, BITS, ASM,
                              LLOYD)
        acc7 = _sliced_values(7, w0, w1, w2, w3, k0, k1, k2, k3, acc7, v0, v1, vh0, vh1, D, NG, BITS, ASM,
                              LLOYD)
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, z0, z1, z2, z3


@triton.jit
def _sliced_history_step(s, m, l, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, z0, z1, z2, z3,
                         vc_ptr, vs_ptr, vz_ptr, row0, half_kappa, unit, P: tl.constexpr, D: tl.constexpr,
                         NG: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, LLOYD: tl.constexpr):
    """Online-softmax step over one page of quantized values (sliced path; `_page_values`).
    s: masked scores in units of the dots; unit: the score units (the keys' unit times the softmax scale)."""
    m_new, p, alpha, l = _softmax_weights(s, None, m, l, unit)
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, z0, z1, z2, z3 = _rescaled(
        alpha, tl.max((m_new > m).to(tl.int32), 0) > 0, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
        z0, z1, z2, z3, NG, D)
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, z0, z1, z2, z3 = _page_values(
        p, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, z0, z1, z2, z3, vc_ptr, vs_ptr, vz_ptr, row0,
        half_kappa, P, D, NG, BITS, ASM, LLOYD)
    return m_new, l, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, z0, z1, z2, z3


@triton.jit
def _slice_output(acc, s: tl.constexpr, z0, z1, z2, z3, unit, D: tl.constexpr, NG: tl.constexpr,
                  BITS: tl.constexpr):
    """Slice s of the output in plain units: acc·unit/mult - Σ p·s·z of its group (unit: 2^24, or
    3a·2^24 for Lloyd–Max levels)."""
    offset, parity, mult = _slice_layout(s, D, BITS)
    if BITS == 2:
        g: tl.constexpr = (s % 4) * NG // 4
    elif D < 128:  # INT4 quarter slices (`_slice_layout`)
        g: tl.constexpr = ((s // 2) + (s % 2) * 2) * NG // 4
    else:
        g: tl.constexpr = ((s // 4) + (s % 2) * 2) * NG // 4
    if g == 0:
        z = z0
    elif g == 1:
        z = z1
    elif g == 2:
        z = z2
    else:
        z = z3
    return acc * (unit / mult) - z[:, None]


@triton.jit
def _interleave(even, odd):
    """[M, U] even and odd channels -> [M, 2U] in channel order."""
    return tl.reshape(tl.join(even, odd), (even.shape[0], 2 * even.shape[1]))


@triton.jit
def _sliced_quarters(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, z0, z1, z2, z3, unit,
                     D: tl.constexpr, NG: tl.constexpr, BITS: tl.constexpr):
    """The slice accumulators (eight, or four quarter slices) as the four output quarters [M, D/4] (plain units)."""
    o0 = _slice_output(acc0, 0, z0, z1, z2, z3, unit, D, NG, BITS)
    o1 = _slice_output(acc1, 1, z0, z1, z2, z3, unit, D, NG, BITS)
    o2 = _slice_output(acc2, 2, z0, z1, z2, z3, unit, D, NG, BITS)
    o3 = _slice_output(acc3, 3, z0, z1, z2, z3, unit, D, NG, BITS)
    if D < 128:  # quarter slices: INT2 slice s is quarter s; INT4 slices 0..3 are quarters 0, 2, 1, 3
        if BITS == 2:
            return o0, o1, o2, o3
        else:
            return o0, o2, o1, o3
    else:
        o4 = _slice_output(acc4, 4, z0, z1, z2, z3, unit, D, NG, BITS)
        o5 = _slice_output(acc5, 5, z0, z1, z2, z3, unit, D, NG, BITS)
        o6 = _slice_output(acc6, 6, z0, z1, z2, z3, unit, D, NG, BITS)
        o7 = _slice_output(acc7, 7, z0, z1, z2, z3, unit, D, NG, BITS)
        if BITS == 2:  # slice s: quarter s % 4, parity s // 4
            return _interleave(o0, o4), _interleave(o1, o5), _interleave(o2, o6), _interleave(o3, o7)
        else:  # slice s = 4c + p: quarter c + 2·(p % 2), parity p // 2
            return _interleave(o0, o2), _interleave(o4, o6), _interleave(o1, o3), _interleave(o5, o7)


@triton.jit
def _softmax_weights(s, visible, m, l, unit):
    """Base-2 online softmax over one key block: the new running max, the block's probabilities
    p = 2^(s·unit - max), the factor alpha that rescales the earlier sums, and the new sum l. unit: the scores
    are s·unit (the softmax scale of unscaled queries, times the dots' unit for history scores), and the max
    and sum stay in plain units."""
    if visible is not None:  # None: s is masked already
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1) * unit)  # unit > 0 keeps the max where it is
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * unit - m_safe[:, None])  # one fused multiply-add
    alpha = tl.exp2(m - m_safe)
    return m_new, p, alpha, l * alpha + tl.sum(p, 1)


@triton.jit
def _weighted_codes_mma(p, corr, vs_ptr, vz_ptr, row0, g: tl.constexpr, NG: tl.constexpr, P: tl.constexpr):
    """As `_weighted_codes` for the sliced path, with the zero correction on the tensor cores:
    corr [BLOCK_M, ZERO_COLUMNS] += weight · z (z broadcast over the columns; every column holds the same
    sums). The products of two float16 are exact in float32, so the correction still cancels the
    zero term of the value dots exactly. corr is rescaled by the caller."""
    at = _page_param_offsets(row0, g, NG, P)
    scale = tl.load(vs_ptr + at).to(tl.float32)
    zero = tl.load(vz_ptr + at)  # float16, as the dot takes it
    weight = (p * scale[None, :]).to(tl.float16)
    return weight, tl.dot(weight, tl.broadcast_to(zero[:, None], (P, ZERO_COLUMNS)), corr)


@triton.jit
def _scores(q0, q1, q2, q3, k0, k1, k2, k3):
    """[BLOCK_M, BLOCK_N] float32 = Σ_quarters q_i · k_iᵀ, float16 operands (see `_softmax_step`)."""
    s = tl.dot(q0.to(tl.float16), tl.trans(k0.to(tl.float16)))
    s += tl.dot(q1.to(tl.float16), tl.trans(k1.to(tl.float16)))
    s += tl.dot(q2.to(tl.float16), tl.trans(k2.to(tl.float16)))
    s += tl.dot(q3.to(tl.float16), tl.trans(k3.to(tl.float16)))
    return s


@triton.jit
def _softmax_step(s, visible, m, l, a0, a1, a2, a3, v0, v1, v2, v3, unit):
    """One online-softmax step (base 2) over a key block; returns the new m, l, accumulators.

    Dots take float16 operands for every region: exact for BF16 windows within the float16
    range (|x| < 65504), 3 more mantissa bits than BF16 for the probabilities, and one code
    path that the CPU interpreter (whose BF16 dot is wrong) tests as it runs on the GPU.
    """
    m_new, p, alpha, l = _softmax_weights(s, visible, m, l, unit)
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
def _window_block(k_ptr, v_ptr, row, key_valid, key_pos, q0, q1, q2, q3, qk_scale, query_pos, row_valid, window,
                  m, l, a0, a1, a2, a3, D: tl.constexpr, ROUND_V: tl.constexpr):
    """Online-softmax step over a block of full-precision keys/values (sink, ring or the step's
    own tokens) at rows `row`, for unscaled queries (qk_scale: the softmax scale, base 2); ROUND_V: round
    the values to that dtype first (or None)."""
    k0, k1, k2, k3 = _load_quarters(k_ptr, row, key_valid, D)
    v0, v1, v2, v3 = _load_quarters(v_ptr, row, key_valid, D)
    if ROUND_V is not None:
        v0 = _round_to(v0.to(tl.float32), ROUND_V)
        v1 = _round_to(v1.to(tl.float32), ROUND_V)
        v2 = _round_to(v2.to(tl.float32), ROUND_V)
        v3 = _round_to(v3.to(tl.float32), ROUND_V)
    s = _scores(q0, q1, q2, q3, k0, k1, k2, k3)
    visible = _visible(key_pos, key_valid, query_pos, row_valid, window)
    return _softmax_step(s, visible, m, l, a0, a1, a2, a3, v0, v1, v2, v3, qk_scale)


# key_centering="rope": the history keys of a page were stored minus the key shift of the block of
# the page's first position (`PagedLayer.shift_index`). The score term q·shift restores them:
# `_score_shift_kernel` computes it once per step for every (query row, block), and the history
# loops add the page's entry to its scores (one load per row and page, no branch in the loop).


@triton.jit
def _score_shift_kernel(q_ptr, shift_ptr, out_ptr, qk_scale, num_blocks, HQ: tl.constexpr, HKV: tl.constexpr,
                        D: tl.constexpr, BLOCK_B: tl.constexpr):
    """out[row, b] = qk_scale · q[row]·shift[b, KV head of row] (row = token·HQ + query head), float32."""
    row = tl.program_id(0).to(tl.int64)
    blocks = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    h = (row % HQ) // (HQ // HKV)
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + row * D + cols).to(tl.float32)
    ok = blocks < num_blocks
    shift = tl.load(shift_ptr + (blocks.to(tl.int64)[:, None] * HKV + h) * D + cols[None, :], mask=ok[:, None],
                    other=0.0)
    tl.store(out_ptr + row * num_blocks + blocks, tl.sum(shift * q[None, :], 1) * qk_scale, mask=ok)


@triton.jit
def _score_shift(terms_ptr, num_blocks, q_row, row_valid, page_index, S: tl.constexpr, P: tl.constexpr,
                 SHIFT_BLOCK: tl.constexpr):
    """[BLOCK_M] score term of a history page's block for each query row (see above)."""
    block = tl.minimum((S + page_index * P) // SHIFT_BLOCK, num_blocks - 1)
    return tl.load(terms_ptr + q_row * num_blocks + block, mask=row_valid, other=0.0)


@triton.jit
def _page_row(bt_row, index, end, num_pages, h, HKV: tl.constexpr, P: tl.constexpr, CHECK_END: tl.constexpr):
    """(first pool row of history page `index` for KV head h, whether the page is valid). An id out of
    range reads page 0 and is reported invalid; CHECK_END: so is an index at or after `end`, whose
    block-table entry is not read."""
    if CHECK_END:
        page = tl.load(bt_row + index, mask=index < end, other=-1)
    else:
        page = tl.load(bt_row + index)
    page_ok = (page >= 0) & (page < num_pages)
    return (tl.where(page_ok, page, 0).to(tl.int64) * HKV + h) * P, page_ok


@triton.jit
def _history_page_scores(index, end, bt_row, num_pages, h, qs0, qs1, qs2, qs3, qs4, qs5, qs6, qs7, qk0, qk1, qk2,
                         qk3, qk4, qk5, qk6, qk7, g0, g1, g2, g3, unit, kc_ptr, ks_ptr, kz_ptr, shift_ptr,
                         num_blocks, q_row, row_valid, hist_limit, query_pos, window, HKV: tl.constexpr,
                         P: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr,
                         LLOYD: tl.constexpr, S: tl.constexpr, KEY_SHIFTS: tl.constexpr,
                         SHIFT_BLOCK: tl.constexpr, PART_PAGE: tl.constexpr, CHECK_END: tl.constexpr):
    """Masked scores [BLOCK_M, P] of history page `index` in units of the dots (sliced path; g_i: Σq/unit per
    group) and the page's first pool row."""
    row0, page_ok = _page_row(bt_row, index, end, num_pages, h, HKV, P, CHECK_END)
    kw0, kw1, kh0, kh1 = _page_words(kc_ptr, row0, P, D, BITS, ASM)
    hist_pos = S + index * P + tl.arange(0, P)
    # Padding rows have zero queries, so finite scores; their outputs are never stored. An invalid page
    # and the rows at or after hist_limit get -inf from a bias that joins the scores' last fused
    # multiply-add: one scalar per page where the history ends at a page edge (a per-key bias costs 4% at
    # 32x32K on the H100, a [BLOCK_M, P] mask tile ~140 instructions per page). A window masks after.
    bias = tl.where(page_ok, 0.0, float("-inf"))
    if KEY_SHIFTS:
        bias = bias + _score_shift(shift_ptr, num_blocks, q_row, row_valid, index, S, P, SHIFT_BLOCK)[:, None] / unit
    if PART_PAGE:
        bias = bias + tl.where(hist_pos < hist_limit, 0.0, float("-inf"))[None, :]
    s = _sliced_scores(qs0, qs1, qs2, qs3, qs4, qs5, qs6, qs7, qk0, qk1, qk2, qk3, qk4, qk5, qk6, qk7,
                       g0, g1, g2, g3, kw0, kw1, kh0, kh1, ks_ptr, kz_ptr, row0, bias, P, D, NG, BITS, ASM, LLOYD)
    if window > 0:
        s = tl.where((hist_pos < hist_limit)[None, :] & (query_pos[:, None] - hist_pos[None, :] < window),
                     s, float("-inf"))
    return s, row0


@triton.jit
def _merge_row_groups(m, l, a0, a1, a2, a3, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """Merges the row groups of a decode history split (rows r and r' hold the same query head when
    r ≡ r' mod G) by their running maxima, as `_combine_kernel` merges splits. Returns every row's
    head's max, sum and the four output quarters (plain units, unnormalised), so that row i < G holds
    query head i."""
    r = tl.arange(0, BLOCK_M)
    same = (r[:, None] % G) == (r[None, :] % G)
    top = tl.max(tl.where(same, m[None, :], float("-inf")), 1)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    # weight[r, r'] = 2^(m_r' - top_r) for the rows r' of r's head (0 for a row that saw no key)
    weight = tl.where(same, tl.exp2(m[None, :] - top_safe[:, None]), 0.0)
    l = tl.sum(weight * l[None, :], 1)
    a0 = tl.dot(weight, a0, input_precision="ieee")
    a1 = tl.dot(weight, a1, input_precision="ieee")
    a2 = tl.dot(weight, a2, input_precision="ieee")
    a3 = tl.dot(weight, a3, input_precision="ieee")
    return top, l, a0, a1, a2, a3


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_new_ptr, v_new_ptr, out_ptr, part_o_ptr, part_lse_ptr,
        slots_ptr, cu_ptr, len_ptr, bt_ptr, bt_stride, num_pages,
        kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
        sink_k_ptr, sink_v_ptr, ring_k_ptr, ring_v_ptr,
        qk_scale, window, shift_ptr, num_blocks, k_kappa, k_unit, v_kappa, v_unit,
        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, K_BITS: tl.constexpr,
        V_BITS: tl.constexpr, P: tl.constexpr, S: tl.constexpr, R: tl.constexpr, NUM_SPLITS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINK_BLOCK: tl.constexpr, ASM: tl.constexpr = True,
        REGIONS: tl.constexpr = 0, WINDOW_SPLITS: tl.constexpr = 1, KEY_SHIFTS: tl.constexpr = False,
        SHIFT_BLOCK: tl.constexpr = 1, OVERLAP: tl.constexpr = 0, K_LLOYD: tl.constexpr = False,
        V_LLOYD: tl.constexpr = False, PART_PAGE: tl.constexpr = True, ROW_GROUPS: tl.constexpr = 1,
        count_ptr=None, MERGE: tl.constexpr = 0):
    """With N = NUM_SPLITS > 1, splits 0..WS-1 (WS = WINDOW_SPLITS) share the windows (every WS-th
    block of the ring; the sink goes to split 0, the step's own tokens to split WS-1) and splits
    WS..N-1 share the history pages. REGIONS 0: every split of the grid; 1: only the history splits
    (a grid of N - WS); 2: only the window splits (a grid of WS).

    OVERLAP (programmatic dependent launch, see `launch_attention`): 1 lets the next launch start
    at once; 2 also waits, before the program ends, for the launch before it to finish, so that
    this launch finishing implies that both have.

    PART_PAGE: some sequence's history may end part-way into its last page (see hist_limit below);
    the launcher passes False for steps of at most recent_tokens new tokens, where it cannot.

    K_LLOYD, V_LLOYD: the INT2 keys / values use Lloyd–Max levels, level(c) = 3a·(c + kappa·b1), with
    k_kappa = kappa and k_unit = 3a·2^24 for the keys (v_ for the values; see `_lloyd_dot`).

    ROW_GROUPS > 1 (decode history splits, sliced path): the BLOCK_M rows are ROW_GROUPS copies of the
    G query heads of one new token, each copy reading its own pages, so that one softmax step on the
    [BLOCK_M, P] tile serves ROW_GROUPS pages instead of one page with BLOCK_M - G padding rows.

    MERGE > 0 (window launches after the history launch, REGIONS 2): the window programs also merge the splits, in
    place of `_combine_kernel`. After its partial is stored (and, with OVERLAP 2, the history launch has ended), the
    last of a (sequence, KV head, query block)'s WS window programs to arrive (an atomic count at count_ptr, which it
    sets back to 0) merges every split of the block's first MERGE rows (a power of two covering its query rows) into
    out (`_merge_splits`)."""
    if OVERLAP >= 1:
        _gdc_launch_dependents()
    pid = tl.program_id(0)
    m_block = tl.program_id(1)
    WS: tl.constexpr = WINDOW_SPLITS
    split = tl.program_id(2) + (WS if REGIONS == 1 else 0)
    history_split = split - WS if NUM_SPLITS > 1 else 0
    has_history = (split >= WS or NUM_SPLITS == 1) and REGIONS != 2
    b = pid // HKV
    h = pid % HKV
    G: tl.constexpr = HQ // HKV
    W: tl.constexpr = D // 4
    C: tl.constexpr = R + P
    slot, old, start, count = _sequence(b, slots_ptr, cu_ptr, len_ptr)
    if m_block * BLOCK_M >= count * G:
        if OVERLAP == 2:
            _gdc_wait()
        return
    r = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    if ROW_GROUPS > 1:  # decode history split: every row group holds the G query heads (see the loop)
        row_valid = r < ROW_GROUPS * G
        t = r * 0
    else:
        row_valid = r < count * G
        t = r // G
    head = h * G + r % G
    query_pos = old + t
    q_row = (start + t).to(tl.int64) * HQ + head
    q0, q1, q2, q3 = _load_quarters(q_ptr, q_row, row_valid, D)
    # float16 queries, unscaled (a bfloat16 query is exact in float16; times the scale it would not be): every
    # region's softmax multiplies its scores by the scale where it subtracts the running max (`_softmax_weights`).
    q0 = q0.to(tl.float16)
    q1 = q1.to(tl.float16)
    q2 = q2.to(tl.float16)
    q3 = q3.to(tl.float16)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    a0 = tl.zeros([BLOCK_M, W], tl.float32)
    a1 = tl.zeros([BLOCK_M, W], tl.float32)
    a2 = tl.zeros([BLOCK_M, W], tl.float32)
    a3 = tl.zeros([BLOCK_M, W], tl.float32)

    end_new = _history_end(old + count, S, R, P)
    # The stored tokens this step reads from the history: those before min(old, end_new) (the step's
    # own tokens come from k_new). A step longer than the recent window can end the history part-way
    # into a page whose other rows it fills itself: that page is read up to hist_limit. (end_new <=
    # old + count - R, so with count <= R the limit is end_new, a page edge.)
    hist_limit = tl.minimum(old, end_new)
    history_pages = tl.cdiv(tl.maximum(hist_limit - S, 0), P)
    PAGE_SPLITS: tl.constexpr = NUM_SPLITS - WS if NUM_SPLITS > 1 else 1
    if has_history:  # the sliced path: eight slices of D/8 channels, or four quarter slices of D/4 (D = 64)
        qs0, qsum0 = _query_slice(q_ptr, q_row, row_valid, 0, D, K_BITS)
        qs1, qsum1 = _query_slice(q_ptr, q_row, row_valid, 1, D, K_BITS)
        qs2, qsum2 = _query_slice(q_ptr, q_row, row_valid, 2, D, K_BITS)
        qs3, qsum3 = _query_slice(q_ptr, q_row, row_valid, 3, D, K_BITS)
        g0 = tl.zeros([BLOCK_M], tl.float32)  # query sums per group, for the zero points
        g1 = tl.zeros([BLOCK_M], tl.float32)
        g2 = tl.zeros([BLOCK_M], tl.float32)
        g3 = tl.zeros([BLOCK_M], tl.float32)
        g0, g1, g2, g3 = _add_to_group(g0, g1, g2, g3, qsum0, 0, D, NG, K_BITS)
        g0, g1, g2, g3 = _add_to_group(g0, g1, g2, g3, qsum1, 1, D, NG, K_BITS)
        g0, g1, g2, g3 = _add_to_group(g0, g1, g2, g3, qsum2, 2, D, NG, K_BITS)
        g0, g1, g2, g3 = _add_to_group(g0, g1, g2, g3, qsum3, 3, D, NG, K_BITS)
        if D >= 128:
            qs4, qsum4 = _query_slice(q_ptr, q_row, row_valid, 4, D, K_BITS)
            qs5, qsum5 = _query_slice(q_ptr, q_row, row_valid, 5, D, K_BITS)
            qs6, qsum6 = _query_slice(q_ptr, q_row, row_valid, 6, D, K_BITS)
            qs7, qsum7 = _query_slice(q_ptr, q_row, row_valid, 7, D, K_BITS)
            g0, g1, g2, g3 = _add_to_group(g0, g1, g2, g3, qsum4, 4, D, NG, K_BITS)
            g0, g1, g2, g3 = _add_to_group(g0, g1, g2, g3, qsum5, 5, D, NG, K_BITS)
            g0, g1, g2, g3 = _add_to_group(g0, g1, g2, g3, qsum6, 6, D, NG, K_BITS)
            g0, g1, g2, g3 = _add_to_group(g0, g1, g2, g3, qsum7, 7, D, NG, K_BITS)
        else:  # placeholders: quarter slices never read them
            qs4, qs5, qs6, qs7 = qs0, qs0, qs0, qs0
        k_units = _unit(k_unit, K_LLOYD)  # the scores stay in units of the dots (see `_group_scores`)
        score_units = k_units * qk_scale  # and the queries unscaled
        g0 = g0 / k_units
        g1 = g1 / k_units
        g2 = g2 / k_units
        g3 = g3 / k_units
        qk0 = _times(qs0, k_kappa * 0.5, K_LLOYD)  # the high bits read as 2·b1
        qk1 = _times(qs1, k_kappa * 0.5, K_LLOYD)
        qk2 = _times(qs2, k_kappa * 0.5, K_LLOYD)
        qk3 = _times(qs3, k_kappa * 0.5, K_LLOYD)
        qk4 = _times(qs4, k_kappa * 0.5, K_LLOYD)
        qk5 = _times(qs5, k_kappa * 0.5, K_LLOYD)
        qk6 = _times(qs6, k_kappa * 0.5, K_LLOYD)
        qk7 = _times(qs7, k_kappa * 0.5, K_LLOYD)
        U: tl.constexpr = D // 8 if D >= 128 else D // 4  # channels per slice
        acc0 = tl.zeros([BLOCK_M, U], tl.float32)
        acc1 = tl.zeros([BLOCK_M, U], tl.float32)
        acc2 = tl.zeros([BLOCK_M, U], tl.float32)
        acc3 = tl.zeros([BLOCK_M, U], tl.float32)
        acc4 = tl.zeros([BLOCK_M, U], tl.float32)
        acc5 = tl.zeros([BLOCK_M, U], tl.float32)
        acc6 = tl.zeros([BLOCK_M, U], tl.float32)
        acc7 = tl.zeros([BLOCK_M, U], tl.float32)
        z0 = tl.zeros([BLOCK_M, ZERO_COLUMNS], tl.float32)  # zero corrections, every column the same
        z1 = tl.zeros([BLOCK_M, ZERO_COLUMNS], tl.float32)
        z2 = tl.zeros([BLOCK_M, ZERO_COLUMNS], tl.float32)
        z3 = tl.zeros([BLOCK_M, ZERO_COLUMNS], tl.float32)
        share = tl.cdiv(history_pages, PAGE_SPLITS)
        lo = history_split * share
        hi = tl.minimum(lo + share, history_pages)
        if window > 0:  # pages wholly before the window of the first query row are skipped
            lo = tl.maximum(lo, tl.maximum(old + m_block * BLOCK_M // G - window + 1 - S, 0) // P)
        bt_row = bt_ptr + slot.to(tl.int64) * bt_stride
        if ROW_GROUPS > 1:
            # Decode with row groups: rows a·G .. a·G + G - 1 are copy a of the G query heads, and copy a
            # reads pages lo + a, lo + a + ROW_GROUPS, ...: one softmax step on the [BLOCK_M, P] tile
            # covers ROW_GROUPS pages instead of one page on G useful rows (`_merge_row_groups` after).
            group = tl.arange(0, BLOCK_M) // G
            for base in range(lo, hi, ROW_GROUPS):
                s = tl.full([BLOCK_M, P], float("-inf"), tl.float32)
                for a in tl.static_range(ROW_GROUPS):
                    s_a, row0 = _history_page_scores(
                        base + a, hi, bt_row, num_pages, h, qs0, qs1, qs2, qs3, qs4, qs5, qs6, qs7, qk0, qk1, qk2,
                        qk3, qk4, qk5, qk6, qk7, g0, g1, g2, g3, score_units, kc_ptr, ks_ptr, kz_ptr,
                        shift_ptr, num_blocks, q_row, row_valid, hist_limit, query_pos, window, HKV, P, D, NG,
                        K_BITS, ASM, K_LLOYD, S, KEY_SHIFTS, SHIFT_BLOCK, PART_PAGE, True)
                    s = tl.where((group == a)[:, None], s_a, s)
                m_new, p, alpha, l = _softmax_weights(s, None, m, l, score_units)
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, z0, z1, z2, z3 = _rescaled(
                    alpha, tl.max((m_new > m).to(tl.int32), 0) > 0, acc0, acc1, acc2, acc3, acc4, acc5, acc6,
                    acc7, z0, z1, z2, z3, NG, D)
                m = m_new
                for a in tl.static_range(ROW_GROUPS):
                    row0, page_ok = _page_row(bt_row, base + a, hi, num_pages, h, HKV, P, True)
                    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, z0, z1, z2, z3 = _page_values(
                        tl.where((group == a)[:, None], p, 0.0), acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                        z0, z1, z2, z3, vc_ptr, vs_ptr, vz_ptr, row0, v_kappa * 0.5, P, D, NG, V_BITS, ASM,
                        V_LLOYD)
        else:
            for index in range(lo, hi):
                s, row0 = _history_page_scores(
                    index, hi, bt_row, num_pages, h, qs0, qs1, qs2, qs3, qs4, qs5, qs6, qs7, qk0, qk1, qk2, qk3,
                    qk4, qk5, qk6, qk7, g0, g1, g2, g3, score_units, kc_ptr, ks_ptr, kz_ptr, shift_ptr,
                    num_blocks, q_row, row_valid, hist_limit, query_pos, window, HKV, P, D, NG, K_BITS, ASM,
                    K_LLOYD, S, KEY_SHIFTS, SHIFT_BLOCK, PART_PAGE, False)
                m, l, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, z0, z1, z2, z3 = _sliced_history_step(
                    s, m, l, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, z0, z1, z2, z3,
                    vc_ptr, vs_ptr, vz_ptr, row0, v_kappa * 0.5, score_units, P, D, NG, V_BITS, ASM, V_LLOYD)
        a0, a1, a2, a3 = _sliced_quarters(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, tl.max(z0, 1),
                                          tl.max(z1, 1), tl.max(z2, 1), tl.max(z3, 1), _unit(v_unit, V_LLOYD),
                                          D, NG, V_BITS)
        if ROW_GROUPS > 1:
            m, l, a0, a1, a2, a3 = _merge_row_groups(m, l, a0, a1, a2, a3, G, BLOCK_M)
            row_valid = r < count * G  # row i < G holds query head h·G + i; the copies are not stored

    if split < WS and REGIONS != 1:
        head_row = slot.to(tl.int64) * HKV + h
        if S > 0:
            if SINK_BLOCK <= BLOCK_N:  # the sink in one block, read by split 0
                if split == 0:
                    sink_pos = tl.arange(0, SINK_BLOCK)
                    m, l, a0, a1, a2, a3 = _window_block(
                        sink_k_ptr, sink_v_ptr, head_row * S + sink_pos, sink_pos < tl.minimum(old, S), sink_pos,
                        q0, q1, q2, q3, qk_scale, query_pos, row_valid, window, m, l, a0, a1, a2, a3, D, None)
            else:  # key blocks smaller than the sink (one-warp window programs): its blocks go round the splits
                for first in range(split * BLOCK_N, tl.minimum(old, S), WS * BLOCK_N):
                    sink_pos = first + tl.arange(0, BLOCK_N)
                    m, l, a0, a1, a2, a3 = _window_block(
                        sink_k_ptr, sink_v_ptr, head_row * S + sink_pos, sink_pos < tl.minimum(old, S), sink_pos,
                        q0, q1, q2, q3, qk_scale, query_pos, row_valid, window, m, l, a0, a1, a2, a3, D, None)
        for first in range(end_new + split * BLOCK_N, old, WS * BLOCK_N):
            key_pos = first + tl.arange(0, BLOCK_N)
            m, l, a0, a1, a2, a3 = _window_block(
                ring_k_ptr, ring_v_ptr, head_row * C + (key_pos - S) % C, key_pos < old, key_pos,
                q0, q1, q2, q3, qk_scale, query_pos, row_valid, window, m, l, a0, a1, a2, a3, D, None)
        last_new = tl.minimum(count, (m_block * BLOCK_M + BLOCK_M - 1) // G + 1)
        last_new = tl.where(split == WS - 1, last_new, 0)
        for first in range(0, last_new, BLOCK_N):
            key_t = first + tl.arange(0, BLOCK_N)
            m, l, a0, a1, a2, a3 = _window_block(
                k_new_ptr, v_new_ptr, (start + key_t).to(tl.int64) * HKV + h, key_t < count, old + key_t,
                q0, q1, q2, q3, qk_scale, query_pos, row_valid, window, m, l, a0, a1, a2, a3, D,
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
    if OVERLAP == 2:
        _gdc_wait()
    if MERGE > 0:
        tl.debug_barrier()  # every thread's partial stored before the merge reads it (or the count releases it)
        last = True
        if WS > 1:
            counter = count_ptr + pid * tl.num_programs(1) + m_block
            last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == WS - 1
        if last:
            rows = m_block * BLOCK_M + tl.arange(0, MERGE)
            _merge_splits(part_o_ptr, part_lse_ptr, out_ptr, (start + rows // G).to(tl.int64) * HQ + h * G + rows % G,
                          rows < count * G, D, NUM_SPLITS)
            if WS > 1:
                tl.atomic_xchg(counter, 0)


@triton.jit
def _merge_splits(part_o_ptr, part_lse_ptr, out_ptr, q_row, row_valid, D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """The splits of the rows q_row merged into out as `_combine_kernel` merges them (the sums in split order), read
    past the caches (other programs wrote them)."""
    SPLIT_BLOCK: tl.constexpr = triton.next_power_of_2(NUM_SPLITS)
    splits = tl.arange(0, SPLIT_BLOCK)
    part = q_row * NUM_SPLITS
    in_range = row_valid[:, None] & (splits < NUM_SPLITS)[None, :]
    lse = tl.load(part_lse_ptr + part[:, None] + splits[None, :], mask=in_range, other=float("-inf"),
                  cache_modifier=".cg")
    top = tl.max(lse, 1)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp2(lse - top[:, None]), 1)
    cols = tl.arange(0, D)
    merged = tl.zeros([q_row.shape[0], D], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        weight = tl.exp2(tl.load(part_lse_ptr + part + s, mask=row_valid, other=float("-inf"),
                                 cache_modifier=".cg") - top)
        merged += tl.load(part_o_ptr + (part + s)[:, None] * D + cols[None, :], mask=row_valid[:, None], other=0.0,
                          cache_modifier=".cg") * weight[:, None]
    merged = merged / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + q_row[:, None] * D + cols[None, :], merged.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None])


@triton.jit
def _combine_kernel(part_o_ptr, part_lse_ptr, out_ptr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    SPLIT_BLOCK: tl.constexpr, WAIT: tl.constexpr = False, D_BLOCK: tl.constexpr = 0):
    """Merge the splits of one (token, query head): out = Σ w_s o_s / Σ w_s, w_s = 2^(lse_s - max).
    WAIT: launched early (programmatic dependent launch), so wait for the splits first; the launch
    after it (the output projection's matrix-vector product at batch 1) may start early in turn and
    load its weights meanwhile. D_BLOCK (0: D): the channels of one program, program_id(1) saying
    which block of them."""
    if WAIT:
        _gdc_launch_dependents()
        _gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, SPLIT_BLOCK)
    in_range = splits < NUM_SPLITS
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + splits, mask=in_range, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - top)
    total = tl.sum(weight, 0)
    DB: tl.constexpr = D if D_BLOCK == 0 else D_BLOCK
    cols = tl.program_id(1) * DB + tl.arange(0, DB)
    o = tl.load(part_o_ptr + (row * NUM_SPLITS + splits)[:, None] * D + cols[None, :], mask=in_range[:, None],
                other=0.0)
    merged = tl.sum(o * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * D + cols, merged.to(out_ptr.dtype.element_ty))


def score_shift_terms(layer, q, scale: float):
    """[T, Hq, blocks] float32: q·shift of every key-shift block for the queries q [T, Hq, D], in the
    kernel's base-2 score units (`_score_shift_kernel`)."""
    import torch

    blocks = layer.key_shifts.shape[0]
    terms = torch.empty(q.shape[0], q.shape[1], blocks, dtype=torch.float32, device=q.device)
    block_b = 32
    _score_shift_kernel[(q.shape[0] * q.shape[1], triton.cdiv(blocks, block_b))](
        q, layer.key_shifts, terms, scale * LOG2E, blocks, HQ=q.shape[1], HKV=layer.layout.kv_heads,
        D=layer.layout.head_dim, BLOCK_B=block_b)
    return terms


def launch_attention(layer, batch, q, k_new, v_new, out, scale: float, window: int, num_splits: int,
                     workspace: tuple | None, block_m: int = 16, block_n: int = 64, num_warps: int | None = None,
                     num_stages: int = 3, separate_windows: bool = True, window_warps: int = 4,
                     maxnreg: int | None = None, window_splits: int = 1, overlap: bool | None = None,
                     window_first: bool = False, row_groups: int = 1, window_block_n: int | None = None,
                     combine_d_block: int | None = None, history: HistoryKernel = "auto",
                     merge: bool | None = None) -> None:
    """q: [T, Hq, D]; k_new, v_new: [T, Hkv, D]; out: [T, Hq, D]. workspace: (part_o, part_lse) when splitting.

    With splits, the history splits and the window split are two launches (REGIONS 1 and 2), so
    that the history programs get their own small footprint: num_warps (None: one warp when a
    program's query rows fit one block and there are at least as many history programs as
    multiprocessors, `ops.history_warps`, else four), num_stages of load pipelining, and an optional
    register cap `maxnreg` (None: the compiler's choice, about 206 registers, 9 one-warp programs per multiprocessor;
    `ops.history_registers` takes 168 where four-warp window programs need room beside a full wave of
    history programs). Without splits (prefill: `choose_splits` gives decode at least two) one launch
    does everything with two stages.

    overlap (None: where `programmatic_launch_supported`): the three decode launches (history
    splits, window splits, combine; `window_first` swaps the first two) overlap by
    programmatic dependent launch. The second starts as soon as the first has started, since
    the two read nothing the other writes; it waits for the first before it ends. The combine
    starts early and waits for both. Without it each launch waits for the one before.

    row_groups (decode history launch; `ops.choose_row_groups`): pages per softmax step, each
    read by its own copy of the query heads (see ROW_GROUPS in the kernel); 1 where they do not fit
    the block's rows.

    window_warps, window_block_n (None: block_n): the window programs' warps and keys per block
    (`ops.window_plan`: one warp and 16 keys fit beside the one-warp history programs; a sink longer
    than the block goes round the window splits block by block). combine_d_block (None: head_dim):
    the channels each combine program merges.

    history: the kernel of a decode step's history launch: "gluon" (`gluon_history`: half the tensor-core dots;
    an error where the step is outside its scope), "triton" (this module's kernel), or "auto" (Gluon where
    `gluon_history.takes`, else Triton).

    merge (None: `merges_in_windows`): the window programs merge the splits (MERGE in the kernel) instead of a
    combine launch; only where the windows launch second, one query block of a decode step holds a sequence's
    rows, and the plan has at most MAX_MERGE_WINDOW_SPLITS window splits and MAX_MERGE_SPLITS splits."""
    if block_m not in BLOCK_M_CHOICES:
        raise ValueError(f"block_m={block_m}: the attention kernel takes query blocks of {BLOCK_M_CHOICES} rows "
                         "(64 or more failed on the H100 with an illegal memory access).")
    lay = layer.layout
    hq, d = q.shape[1], lay.head_dim
    group = hq // lay.kv_heads
    b = batch.batch
    if b == 0 or batch.max_new == 0:
        return
    windows = window_splits if num_splits > window_splits else 1
    if num_warps is None:
        from .ops import history_warps

        history_splits = num_splits - windows if num_splits > 1 and separate_windows else num_splits
        num_warps = (history_warps(b * lay.kv_heads * history_splits, q.device) if batch.max_new * group <= block_m
                     else 4)
    bt = batch.block_table
    m_blocks = triton.cdiv(batch.max_new * group, block_m)
    part_o, part_lse = workspace if num_splits > 1 else (out, out)
    split_launches = num_splits > 1 and separate_windows
    gluon = split_launches and history != "triton" and gluon_history.takes(layer, batch, hq, window, q.device)
    if history == "gluon" and split_launches and not gluon:
        raise OscarError("history='gluon': this step, layout or Triton is outside the Gluon history kernel's "
                         "scope (see oscarkv.kernels.gluon_history); use history='auto'.")
    # key shifts: the Gluon programs compute their blocks' score terms where their splits span few enough blocks
    terms_in_programs = gluon and gluon_history.terms_in_programs(layer, batch, num_splits - windows)
    if layer.key_shifts is None:
        shifts = (q, 1)
    else:
        shifts = (layer.key_shifts if terms_in_programs else score_shift_terms(layer, q, scale),
                  layer.key_shifts.shape[0])
    args = (q, k_new, v_new, out, part_o, part_lse,
            batch.slots, batch.cu_new, batch.lengths, bt, bt.stride(0), layer.num_pages,
            layer.k_codes, layer.k_scale, layer.k_zero, layer.v_codes, layer.v_scale, layer.v_zero,
            layer.sink_k, layer.sink_v, layer.ring_k, layer.ring_v,
            scale * LOG2E, window, *shifts, *lloyd_factors(lay.key_inner), *lloyd_factors(lay.value_inner))
    cuda = q.device.type == "cuda"
    shape = dict(HQ=hq, HKV=lay.kv_heads, D=d, NG=lay.groups, K_BITS=lay.key_bits, V_BITS=lay.value_bits,
                 P=lay.page_size, S=lay.sink_tokens,
                 R=lay.recent_tokens, NUM_SPLITS=num_splits, BLOCK_M=block_m, BLOCK_N=block_n,
                 SINK_BLOCK=max(16, triton.next_power_of_2(max(lay.sink_tokens, 1))), ASM=cuda,
                 WINDOW_SPLITS=windows,
                 KEY_SHIFTS=layer.key_shifts is not None, SHIFT_BLOCK=max(layer.shift_block, 1),
                 K_LLOYD=lay.key_inner is not None, V_LLOYD=lay.value_inner is not None,
                 PART_PAGE=batch.max_new > lay.recent_tokens)
    overlap = split_launches and cuda and (
        overlap if overlap is not None else programmatic_launch_supported(q.device.index or 0))
    if split_launches:
        ws = shape["WINDOW_SPLITS"]
        registers = dict(maxnreg=maxnreg) if maxnreg is not None and cuda and register_cap_supported() else {}
        grouped = row_groups if batch.max_new == 1 and row_groups * group <= block_m else 1

        def launch_history(mode: int, launch_options: dict) -> None:
            if gluon:
                key_shifts = 0 if layer.key_shifts is None else 2 if terms_in_programs else 1
                settings = gluon_history.launch_settings(hq, lay.kv_heads, lay.sink_tokens, lay.recent_tokens,
                                                         num_splits, ws, mode, key_shifts, max(layer.shift_block, 1))
                gluon_history.launch((b * lay.kv_heads, num_splits - ws), args, settings, launch_options)
            else:
                _paged_attention_kernel[(b * lay.kv_heads, m_blocks, num_splits - ws)](
                    *args, **shape, REGIONS=1, num_warps=num_warps, num_stages=num_stages, ROW_GROUPS=grouped,
                    **registers, OVERLAP=mode, **launch_options)

        if merge is None:
            merge = merges_in_windows(num_splits, ws, m_blocks, window_first)
        elif merge and (window_first or m_blocks > 1):
            raise ValueError("merge=True needs the windows launched second and one query block per sequence.")
        merging = dict(count_ptr=arrival_counts(q.device, b * lay.kv_heads, "window-merge") if ws > 1 else None,
                       MERGE=triton.next_power_of_2(min(block_m, batch.max_new * group))) if merge else {}

        def launch_windows(mode: int, launch_options: dict) -> None:
            _paged_attention_kernel[(b * lay.kv_heads, m_blocks, ws)](
                *args, **{**shape, "BLOCK_N": window_block_n or block_n}, REGIONS=2, num_warps=window_warps,
                num_stages=2, OVERLAP=mode, **launch_options, **merging)

        first, second = (launch_windows, launch_history) if window_first else (launch_history, launch_windows)
        first(int(overlap), {})
        second(2 * int(overlap), _programmatic(overlap))
        if merge:
            return
    else:
        _paged_attention_kernel[(b * lay.kv_heads, m_blocks, num_splits)](
            *args, **shape, REGIONS=0, num_warps=num_warps, num_stages=2)
    if num_splits > 1:
        rows = q.shape[0] * hq
        d_block = combine_d_block or d
        _combine_kernel[(rows, d // d_block)](part_o, part_lse, out, D=d, NUM_SPLITS=num_splits,
                                              SPLIT_BLOCK=triton.next_power_of_2(num_splits), WAIT=overlap,
                                              D_BLOCK=d_block, num_warps=COMBINE_WARPS, **_programmatic(overlap))


# Decode plans whose window programs merge the splits (`merges_in_windows`): at most this many window splits per
# (sequence, KV head), whose last program merges alone, and this many splits in all, which it reads one by one.
MAX_MERGE_WINDOW_SPLITS = 2
MAX_MERGE_SPLITS = 32


def merges_in_windows(num_splits: int, window_splits: int, m_blocks: int, window_first: bool = False) -> bool:
    """Whether a split decode step's window programs merge its splits (`launch_attention`'s merge)."""
    return (not window_first and m_blocks == 1 and num_splits > window_splits
            and window_splits <= MAX_MERGE_WINDOW_SPLITS and num_splits <= MAX_MERGE_SPLITS)


def lloyd_factors(inner: float | None) -> tuple[float, float]:
    """(kappa, 3a·2^24) of a stream's Lloyd–Max levels (`quant.format`); unused (0, 2^24) for uniform codes."""
    from ..quant.format import inner_kappa

    if inner is None:
        return 0.0, 2.0**24
    return inner_kappa(inner), 3.0 * inner * 2.0**24

