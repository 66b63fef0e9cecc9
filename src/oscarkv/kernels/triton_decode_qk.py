"""Triton kernel: a decode step's queries and keys from the projections to what the cache and attention take.

Between the q/k projections and the attention, a decode step of a Llama/Qwen-style layer runs the
q and k RMSNorms (Qwen3), the rotary embedding of q and of k, and the queries' rotation by R_K:
five launches of 1-4 µs each at batch 1 (docs/decode-log.md). This kernel does all of it in one:
- a query program takes BLOCK rows of one query head and BLOCK_N columns of its output: RMSNorm
  (optional), RoPE, then the product with those columns of its KV head's R_K in float32 (IEEE
  products, as `triton_rotate`), stored as [B, Hq, D] in the queries' dtype (`attend_step`'s q);
- a key program takes BLOCK rows of one KV head: RMSNorm (optional) and RoPE, stored as [B, Hkv, D];
  with ROTATE_KEYS it also takes BLOCK_N columns and stores (key - μ_K)·R_K as the cache keeps it,
  so that the write kernel needs no rotation for a decode step.
A single row (batch 1) multiplies by R_K as broadcast sums; more rows take a 16-row dot.

With a `StepWrite` (`ops.decode_query_key_write`) the launch is also the decode step's cache write: the key
programs store the token's rotated key and its value in the sink or ring, and more programs run the flush of
`triton_write` (the ring tokens that age out, quantized into their pages). That is one launch per layer less
than the query/key launch followed by the write launch: on the H100 the Qwen3-4B step at 1×100K went from
4.368 to 4.326–4.329 ms (docs/decode-log.md).

Rounding follows the eager modules: the norm in float32, rounded to the dtype, times the weight and
rounded again; RoPE's q·cos and rotate_half(q)·sin each rounded, then their sum. The norm's sum may
run in another order than PyTorch's, so a value can differ by one ulp, as with the Triton RMSNorm.

With a `StepWrite` that names the attention's history splits (`ops.prefetched_splits`: at batch 1), more
programs prefetch into L2 the keys (codes, scales, zeros) of each split's first page (`PREFETCH_PAGES`), where the
attention's history programs will start: this launch runs for about 4 µs with the DRAM mostly idle, and every
history program asks for its first pages at once when it starts. That took 1×100K steps of Qwen3-4B on the H100
from 4.313–4.317 to 4.281–4.289 ms (`ops.prefetched_splits` has the figures). Whole pages, two or more pages, and
bulk prefetches (the launch then ends only when they land) were slower (docs/data/qk-prefetch-h100.txt).

The query and key programs' code comes first in the compiled kernel (`_query_key_block`, taken before the flush and
prefetch branches): behind the flush's quantizer, about 8,900 SASS instructions (9,500 with key shifts) before it on
sm_90, the launch took 2.9 µs a layer at 1x100K on the H200 and 3.8-4.0 µs with key shifts; first, 2.5-2.8 µs either
way (time exposed in whole random Qwen3-4B steps; the centered step 3.635-3.638 -> 3.556-3.564 ms, docs/decode-log.md).

With `overlap` (Hopper, `triton_pdl`) the launch starts while the projection before it ends: cos/sin,
the R_K columns and μ_K load before it waits; the norm weights load with the rows, after it. Reference:
`oscarkv.kernels.reference.decode_query_key_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..cache.paged import PagedLayer, StepBatch
from .triton_pdl import gdc_launch_dependents, gdc_wait, programmatic
from .triton_write import WRITE_POINTERS, _flush_block, _history_end, _round_to, _sequence, flush_arguments

BLOCK_ROWS = 16  # the smallest M of a dot; a decode step has one row per sequence
# The kernel's cache-write arguments (None when the launch does not write the cache).
WRITE_ARGUMENTS = ("v_ptr", "stride_v", *WRITE_POINTERS)


@dataclass(frozen=True)
class StepWrite:
    """A decode step's cache write, done by the query/key launch: the layer's pages and windows, the step, its
    values [B, Hkv, D] (unit stride on D, heads contiguous) and the clip ratios."""

    layer: PagedLayer
    batch: StepBatch
    values: torch.Tensor
    clip_k: float
    clip_v: float
    history_splits: int = 0  # the attention's history splits per (sequence, KV head); 0: no prefetch


# The keys of the first PREFETCH_PAGES pages of each history split go into L2 (0: none), PREFETCH_BLOCK splits per
# program (see the module doc).
PREFETCH_PAGES = 1
PREFETCH_BLOCK = 32


def launch_plan(rows: int, d: int) -> tuple[int, int, int]:
    """(rows per program, R_K columns per program, warps) of a step with `rows` rows and head_dim d.

    One row (batch 1) with D >= 128 takes 16 columns in one warp: its norm and broadcast sums then stay inside
    the warp, with no shared-memory reductions. On the H100 that took the whole Qwen3-4B step at 1×100K from
    4.48–4.51 to 4.43–4.44 ms against 32 columns in four warps; 8 columns in one warp, 16 or 8 in two, and 32
    in one were between or slower. At D = 64 (SmolLM2, 1×4K) it was 1% slower, within the noise, and one row
    keeps 32 columns in four warps there (docs/data/decode-qk-plan-h100.txt). More rows take a 16-row dot in
    four warps."""
    if rows == 1:
        return (1, 16, 1) if d >= 128 else (1, min(d, 32), 4)
    return BLOCK_ROWS, min(d, 32), 4


@triton.jit
def _norm_rope(x_ptr, w_ptr, eps, cos, sin, valid, cols, partner, sign, D: tl.constexpr, HAS_NORM: tl.constexpr,
               dtype: tl.constexpr):
    """[BLOCK, D] rows at x_ptr ([BLOCK, 1] row pointers): RMSNorm (optional), then RoPE; float32 values of `dtype`."""
    x = tl.load(x_ptr + cols[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    x_partner = tl.load(x_ptr + partner[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    if HAS_NORM:
        inv = tl.math.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
        x = _round_to(tl.load(w_ptr + cols).to(tl.float32)[None, :] * _round_to(x * inv, dtype), dtype)
        x_partner = _round_to(tl.load(w_ptr + partner).to(tl.float32)[None, :] * _round_to(x_partner * inv, dtype),
                              dtype)
    return _round_to(_round_to(x * cos, dtype) + sign[None, :] * _round_to(x_partner * sin, dtype), dtype)


@triton.jit
def _times(x, block, BLOCK: tl.constexpr, D: tl.constexpr):
    """x [BLOCK, D] · block [D, N] in float32: IEEE products; one row as a broadcast sum (no padded dot)."""
    if BLOCK == 1:
        return tl.sum(tl.reshape(x, (D, 1)) * block, 0)[None, :]
    else:
        return tl.dot(x, block, input_precision="ieee")


@triton.jit
def _store_step_token(key, v_src, r, valid, head, columns, slots_ptr, len_ptr, sink_k_ptr, sink_v_ptr, ring_k_ptr,
                      ring_v_ptr, HKV: tl.constexpr, D: tl.constexpr, P: tl.constexpr, S: tl.constexpr,
                      R: tl.constexpr):
    """Store the columns `columns` of rows r's keys (rotated, [BLOCK, BLOCK_N]) and values (at v_src) where the write
    kernel stores a decode step's token: row r is sequence r, whose one new token sits at its stored length, in the
    sink below S tokens and in the ring from there (the newest token never lies in the history)."""
    C: tl.constexpr = R + P
    slot = tl.load(slots_ptr + r, mask=valid, other=0).to(tl.int64)
    pos = tl.load(len_ptr + r, mask=valid, other=0)
    in_sink = (valid & (pos < S))[:, None]
    in_ring = (valid & (pos >= S))[:, None]
    sink_row = ((slot * HKV + head) * S + pos)[:, None] * D + columns[None, :]
    ring_row = ((slot * HKV + head) * C + (pos - S + C) % C)[:, None] * D + columns[None, :]
    window = ring_k_ptr.dtype.element_ty
    value = tl.load(v_src, mask=valid[:, None], other=0.0).to(window)
    key = key.to(window)
    tl.store(sink_k_ptr + sink_row, key, mask=in_sink)
    tl.store(sink_v_ptr + sink_row, value, mask=in_sink)
    tl.store(ring_k_ptr + ring_row, key, mask=in_ring)
    tl.store(ring_v_ptr + ring_row, value, mask=in_ring)


@triton.jit
def _prefetch_run(first, NBYTES: tl.constexpr, ok):
    """prefetch.global.L2 of the NBYTES bytes from each byte pointer of `first` where ok, one per 128-byte line."""
    lines = tl.arange(0, (NBYTES + 127) // 128) * 128
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [first[:, None] + lines[None, :], ok[:, None].to(tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _first_page_blocks(b, h, chunk, j: tl.constexpr, slots_ptr, cu_ptr, len_ptr, bt_ptr, bt_stride, num_pages,
                       HKV: tl.constexpr, P: tl.constexpr, S: tl.constexpr, R: tl.constexpr, SPLITS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """(blocks, ok), both [BLOCK]: the (page, KV head) block of the j-th page that history splits chunk·BLOCK to
    chunk·BLOCK + BLOCK - 1 of sequence b read for KV head h, where the decode attention has SPLITS history splits
    per (sequence, KV head) (`triton_attention`: split s reads pages s·share to min((s + 1)·share, pages) - 1), and
    whether that split has a j-th page (and a valid one)."""
    slot, old, start, count = _sequence(b, slots_ptr, cu_ptr, len_ptr)
    history_pages = tl.cdiv(tl.maximum(tl.minimum(old, _history_end(old + count, S, R, P)) - S, 0), P)
    share = tl.cdiv(history_pages, SPLITS)
    splits = chunk * BLOCK + tl.arange(0, BLOCK)
    index = splits * share + j
    ok = (splits < SPLITS) & (index < tl.minimum(splits * share + share, history_pages))  # the split's end
    page = tl.load(bt_ptr + slot.to(tl.int64) * bt_stride + index, mask=ok, other=-1)
    ok = ok & (page >= 0) & (page < num_pages)
    return tl.where(ok, page, 0).to(tl.int64) * HKV + h, ok


@triton.jit
def _prefetch_first_keys(b, h, chunk, slots_ptr, cu_ptr, len_ptr, bt_ptr, bt_stride, num_pages, kc_ptr, ks_ptr,
                         kz_ptr, HKV: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, K_BITS: tl.constexpr,
                         P: tl.constexpr, S: tl.constexpr, R: tl.constexpr, SPLITS: tl.constexpr,
                         PAGES: tl.constexpr, BLOCK: tl.constexpr):
    """Into L2: the keys (codes, scales, zeros) of the first PAGES pages of history splits chunk·BLOCK to
    chunk·BLOCK + BLOCK - 1 of sequence b and KV head h (`_first_page_blocks`)."""
    CODE_BYTES: tl.constexpr = P * D * K_BITS // 8
    PARAM_BYTES: tl.constexpr = P * NG * (ks_ptr.dtype.element_ty.primitive_bitwidth // 8)
    for j in tl.static_range(PAGES):
        block, ok = _first_page_blocks(b, h, chunk, j, slots_ptr, cu_ptr, len_ptr, bt_ptr, bt_stride, num_pages,
                                       HKV, P, S, R, SPLITS, BLOCK)
        _prefetch_run(kc_ptr.to(tl.pointer_type(tl.uint8)) + block * CODE_BYTES, CODE_BYTES, ok)
        _prefetch_run(ks_ptr.to(tl.pointer_type(tl.uint8)) + block * PARAM_BYTES, PARAM_BYTES, ok)
        _prefetch_run(kz_ptr.to(tl.pointer_type(tl.uint8)) + block * PARAM_BYTES, PARAM_BYTES, ok)


@triton.jit
def _query_key_block(pid, q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, r_ptr, mean_ptr, q_out_ptr, k_out_ptr,
                     rows, q_eps, k_eps, stride_q, stride_k, stride_cos, stride_sin, v_ptr, stride_v, slots_ptr,
                     len_ptr, sink_k_ptr, sink_v_ptr, ring_k_ptr, ring_v_ptr,
                     HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROTATE: tl.constexpr,
                     PER_HEAD: tl.constexpr, ROTATE_KEYS: tl.constexpr, CENTER_KEYS: tl.constexpr,
                     HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                     OVERLAP: tl.constexpr, P: tl.constexpr, S: tl.constexpr, R: tl.constexpr,
                     FLUSH_BLOCKS: tl.constexpr):
    """Query program `pid` < HQ·(column blocks), else key program: the launch's own work (see the module doc)."""
    blocks_per_head: tl.constexpr = D // BLOCK_N if ROTATE else 1
    key_blocks: tl.constexpr = D // BLOCK_N if ROTATE_KEYS else 1
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = r < rows
    cols = tl.arange(0, D)
    partner = (cols + D // 2) % D  # rotate_half(x)[d] = -x[d + D/2] for d < D/2, x[d - D/2] after
    sign = tl.where(cols < D // 2, -1.0, 1.0)
    dtype = q_out_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + r[:, None] * stride_cos + cols[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + r[:, None] * stride_sin + cols[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    is_query = pid < HQ * blocks_per_head
    if is_query:
        head = pid // blocks_per_head
        j = (pid % blocks_per_head) * BLOCK_N
        kv_head = head // (HQ // HKV)
    else:
        head = (pid - HQ * blocks_per_head) // key_blocks
        j = ((pid - HQ * blocks_per_head) % key_blocks) * BLOCK_N
        kv_head = head
    columns = j + tl.arange(0, BLOCK_N)
    if ROTATE:  # the R_K columns (and the key's mean) load before waiting on the projection
        rotation = r_ptr + kv_head * D * D if PER_HEAD else r_ptr
        block = tl.load(rotation + cols[:, None] * D + columns[None, :])
    if CENTER_KEYS:
        mean = tl.load(mean_ptr + kv_head * D + cols)
    if OVERLAP:
        gdc_launch_dependents()
        gdc_wait()
    if is_query:
        x = _norm_rope(q_ptr + r[:, None] * stride_q + head * D, qw_ptr, q_eps, cos, sin, valid, cols, partner, sign,
                       D, HAS_Q_NORM, dtype)
        out = q_out_ptr + r[:, None] * (HQ * D) + head * D
        if ROTATE:
            tl.store(out + columns[None, :], _round_to(_times(x, block, BLOCK, D), dtype).to(dtype),
                     mask=valid[:, None])
        else:
            tl.store(out + cols[None, :], x.to(dtype), mask=valid[:, None])
    else:
        x = _norm_rope(k_ptr + r[:, None] * stride_k + head * D, kw_ptr, k_eps, cos, sin, valid, cols, partner, sign,
                       D, HAS_K_NORM, dtype)
        out = k_out_ptr + r[:, None] * (HKV * D) + head * D
        if ROTATE_KEYS:
            if CENTER_KEYS:
                x = x - mean[None, :]
            key = _round_to(_times(x, block, BLOCK, D), dtype).to(dtype)
            tl.store(out + columns[None, :], key, mask=valid[:, None])
            if FLUSH_BLOCKS > 0:
                _store_step_token(key, v_ptr + r[:, None] * stride_v + head * D + columns[None, :], r, valid, head,
                                  columns, slots_ptr, len_ptr, sink_k_ptr, sink_v_ptr, ring_k_ptr, ring_v_ptr, HKV, D,
                                  P, S, R)
        else:
            tl.store(out + cols[None, :], x.to(dtype), mask=valid[:, None])


@triton.jit
def _decode_qk_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, r_ptr, mean_ptr, q_out_ptr, k_out_ptr,
                      rows, q_eps, k_eps, stride_q, stride_k, stride_cos, stride_sin,
                      v_ptr, stride_v, slots_ptr, cu_ptr, len_ptr, bt_ptr, bt_stride, num_pages,
                      kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, sink_k_ptr, sink_v_ptr, ring_k_ptr, ring_v_ptr,
                      kshift_ptr, num_blocks, k_low, k_high, v_low, v_high,
                      HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROTATE: tl.constexpr,
                      PER_HEAD: tl.constexpr, ROTATE_KEYS: tl.constexpr, CENTER_KEYS: tl.constexpr,
                      HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr,
                      BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, OVERLAP: tl.constexpr,
                      NG: tl.constexpr = 1, K_BITS: tl.constexpr = 2, V_BITS: tl.constexpr = 2, P: tl.constexpr = 64,
                      S: tl.constexpr = 64, R: tl.constexpr = 256, CLIP_K: tl.constexpr = -1,
                      CLIP_V: tl.constexpr = -1, SHIFT: tl.constexpr = 16, BLOCK_T: tl.constexpr = 16,
                      KEY_SHIFTS: tl.constexpr = False, SHIFT_BLOCK: tl.constexpr = 1, K_LLOYD: tl.constexpr = False,
                      V_LLOYD: tl.constexpr = False, COMPILED: tl.constexpr = True, FLUSH_BLOCKS: tl.constexpr = 0,
                      PREFETCH_SPLITS: tl.constexpr = 0, PREFETCH_PAGES: tl.constexpr = 0,
                      PREFETCH_BLOCK: tl.constexpr = 32):
    """See the module doc. FLUSH_BLOCKS > 0 (a decode step that writes the cache, `launch_decode_qk`'s `write`):
    the key programs also store each row's rotated key and its value in the sink or ring
    (`_store_step_token`), and BLOCK · FLUSH_BLOCKS · HKV more programs per block of rows move the ring tokens
    that age out to their pages (`triton_write._flush_block`: one row, token block and KV head each); the
    arguments from v_ptr on and the constexprs from NG on are the write kernel's (None and defaults otherwise)."""
    pid = tl.program_id(1)
    blocks_per_head: tl.constexpr = D // BLOCK_N if ROTATE else 1
    key_blocks: tl.constexpr = D // BLOCK_N if ROTATE_KEYS else 1
    extra = pid - HQ * blocks_per_head - HKV * key_blocks  # flush programs, then prefetch programs
    if extra < 0:  # first in the code: the query and key programs, which every step runs
        _query_key_block(pid, q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, r_ptr, mean_ptr, q_out_ptr, k_out_ptr,
                         rows, q_eps, k_eps, stride_q, stride_k, stride_cos, stride_sin, v_ptr, stride_v, slots_ptr,
                         len_ptr, sink_k_ptr, sink_v_ptr, ring_k_ptr, ring_v_ptr, HQ, HKV, D, ROTATE, PER_HEAD,
                         ROTATE_KEYS, CENTER_KEYS, HAS_Q_NORM, HAS_K_NORM, BLOCK, BLOCK_N, OVERLAP, P, S, R,
                         FLUSH_BLOCKS)
        return
    if FLUSH_BLOCKS > 0:
        if extra < FLUSH_BLOCKS * HKV * BLOCK:
            if OVERLAP:
                gdc_launch_dependents()
                gdc_wait()
            b = tl.program_id(0) * BLOCK + extra % BLOCK  # one flush program per row (sequence), block and head
            block_and_head = extra // BLOCK
            if b < rows:
                _flush_block(b, block_and_head % FLUSH_BLOCKS, block_and_head // FLUSH_BLOCKS, 2, slots_ptr, cu_ptr,
                             len_ptr, bt_ptr, bt_stride, num_pages, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                             ring_k_ptr, ring_v_ptr, kshift_ptr, num_blocks, k_low, k_high, v_low, v_high, HKV, D, NG,
                             K_BITS, V_BITS, P, S, R, CLIP_K, CLIP_V, SHIFT, BLOCK_T, KEY_SHIFTS, SHIFT_BLOCK, K_LLOYD,
                             V_LLOYD, COMPILED)
            return
    if PREFETCH_SPLITS > 0 and PREFETCH_PAGES > 0:
        fetch = extra - FLUSH_BLOCKS * HKV * BLOCK
        b = tl.program_id(0) * BLOCK + fetch % BLOCK  # one per row of a block of rows, KV head and BLOCK splits
        if COMPILED and b < rows:  # (inline PTX: the interpreter skips the hint)
            _prefetch_first_keys(b, (fetch // BLOCK) % HKV, fetch // BLOCK // HKV, slots_ptr, cu_ptr, len_ptr,
                                 bt_ptr, bt_stride, num_pages, kc_ptr, ks_ptr, kz_ptr, HKV, D, NG, K_BITS, P, S,
                                 R, PREFETCH_SPLITS, PREFETCH_PAGES, PREFETCH_BLOCK)


def launch_decode_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     rotation: torch.Tensor | None, q_norm: tuple[torch.Tensor, float] | None,
                     k_norm: tuple[torch.Tensor, float] | None, q_out: torch.Tensor, k_out: torch.Tensor,
                     overlap: bool = False, rotate_keys: bool = False, key_mean: torch.Tensor | None = None,
                     write: StepWrite | None = None) -> None:
    """q [B, Hq, D], k [B, Hkv, D] (heads contiguous, any row stride); cos/sin [B, D] (unit stride on D);
    rotation float32 contiguous [D, D], [Hkv, D, D] or None; q_norm/k_norm (weight [D], eps) or None;
    q_out [B, Hq, D] and k_out [B, Hkv, D] contiguous, of q's dtype. rotate_keys: k_out is
    (key - key_mean)·R_K (key_mean float32 [Hkv, D] or None) instead of the key.
    write (with rotate_keys): the step's cache write in the same launch, as `triton_write.launch_write` would run
    it for k_out and write.values; for decode steps of one token per row, row b being sequence b, whose cache
    holds windows of q's dtype."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    rotate = rotation is not None
    rotate_keys = rotate and rotate_keys
    qw, q_eps = q_norm if q_norm is not None else (q, 0.0)
    kw, k_eps = k_norm if k_norm is not None else (k, 0.0)
    rows_per_program, block_n, warps = launch_plan(b, d)  # one row: broadcast sums instead of a 16-row dot
    programs = hq * (d // block_n if rotate else 1) + hkv * (d // block_n if rotate_keys else 1)
    if write is not None and not rotate_keys:
        raise ValueError("the query/key launch writes the cache only with rotate_keys (the keys as the cache stores them).")
    if write is None:
        cache_arguments = dict.fromkeys(WRITE_ARGUMENTS)
    else:
        flush_blocks, flush = flush_arguments(write.layer, write.batch, write.clip_k, write.clip_v, decode=True)
        programs += flush_blocks * hkv * rows_per_program  # one per row of a block of rows, token block and head
        if write.history_splits > 0 and PREFETCH_PAGES > 0:
            programs += rows_per_program * hkv * triton.cdiv(write.history_splits, PREFETCH_BLOCK)
        shared = ("HKV", "D")  # the launch's own, checked equal by `ops.decode_query_key_write`
        cache_arguments = {name: value for name, value in flush.items() if name not in shared}
        cache_arguments.update(PREFETCH_SPLITS=write.history_splits, PREFETCH_PAGES=PREFETCH_PAGES,
                               PREFETCH_BLOCK=PREFETCH_BLOCK)
        cache_arguments.update(v_ptr=write.values, stride_v=write.values.stride(0), FLUSH_BLOCKS=flush_blocks,
                               enable_fp_fusion=False)  # the flush's quantizer rounds as the reference
    grid = (triton.cdiv(b, rows_per_program), programs)
    _decode_qk_kernel[grid](q, k, qw, kw, cos, sin, rotation if rotate else q,
                            key_mean if rotate_keys and key_mean is not None else q, q_out, k_out, b, float(q_eps),
                            float(k_eps), q.stride(0), k.stride(0), cos.stride(0), sin.stride(0),
                            HQ=hq, HKV=hkv, D=d, ROTATE=rotate, PER_HEAD=rotate and rotation.dim() == 3,
                            ROTATE_KEYS=rotate_keys, CENTER_KEYS=rotate_keys and key_mean is not None,
                            HAS_Q_NORM=q_norm is not None, HAS_K_NORM=k_norm is not None, BLOCK=rows_per_program,
                            BLOCK_N=block_n, OVERLAP=overlap, num_warps=warps, **cache_arguments,
                            **programmatic(overlap))
