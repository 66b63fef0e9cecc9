"""Triton kernel: a decode step's queries and keys from the projections to what the cache and attention take.

Between the q/k projections and the attention, a decode step of a Llama/Qwen-style layer runs the
q and k RMSNorms (Qwen3), the rotary embedding of q and of k, and the queries' rotation by R_K:
five launches of 1-4 µs each at batch 1 (docs/decode.md). This kernel does all of it in one:
- a query program takes BLOCK rows of one query head and BLOCK_N columns of its output: RMSNorm
  (optional), RoPE, then the product with those columns of its KV head's R_K in float32 (IEEE
  products, as `triton_rotate`), stored as [B, Hq, D] in the queries' dtype (`attend_step`'s q);
- a key program takes BLOCK rows of one KV head: RMSNorm (optional) and RoPE, stored as [B, Hkv, D];
  with ROTATE_KEYS it also takes BLOCK_N columns and stores (key - μ_K)·R_K as the cache keeps it,
  so that the write kernel needs no rotation for a decode step.
A single row (batch 1) multiplies by R_K as broadcast sums; more rows take a 16-row dot.

Rounding follows the eager modules: the norm in float32, rounded to the dtype, times the weight and
rounded again; RoPE's q·cos and rotate_half(q)·sin each rounded, then their sum. The norm's sum may
run in another order than PyTorch's, so a value can differ by one ulp, as with the Triton RMSNorm.

With `overlap` (Hopper, `triton_pdl`) the launch starts while the projection before it ends: cos/sin,
the R_K columns and μ_K load before it waits; the norm weights load with the rows, after it. Reference:
`oscarkv.kernels.reference.decode_query_key_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_pdl import gdc_launch_dependents, gdc_wait, programmatic
from .triton_write import _round_to

BLOCK_ROWS = 16  # the smallest M of a dot; a decode step has one row per sequence


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
def _decode_qk_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, r_ptr, mean_ptr, q_out_ptr, k_out_ptr,
                      rows, q_eps, k_eps, stride_q, stride_k, stride_cos, stride_sin,
                      HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROTATE: tl.constexpr,
                      PER_HEAD: tl.constexpr, ROTATE_KEYS: tl.constexpr, CENTER_KEYS: tl.constexpr,
                      HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr,
                      BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, OVERLAP: tl.constexpr):
    pid = tl.program_id(1)
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
            tl.store(out + columns[None, :], _round_to(_times(x, block, BLOCK, D), dtype).to(dtype),
                     mask=valid[:, None])
        else:
            tl.store(out + cols[None, :], x.to(dtype), mask=valid[:, None])


def launch_decode_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     rotation: torch.Tensor | None, q_norm: tuple[torch.Tensor, float] | None,
                     k_norm: tuple[torch.Tensor, float] | None, q_out: torch.Tensor, k_out: torch.Tensor,
                     overlap: bool = False, rotate_keys: bool = False, key_mean: torch.Tensor | None = None) -> None:
    """q [B, Hq, D], k [B, Hkv, D] (heads contiguous, any row stride); cos/sin [B, D] (unit stride on D);
    rotation float32 contiguous [D, D], [Hkv, D, D] or None; q_norm/k_norm (weight [D], eps) or None;
    q_out [B, Hq, D] and k_out [B, Hkv, D] contiguous, of q's dtype. rotate_keys: k_out is
    (key - key_mean)·R_K (key_mean float32 [Hkv, D] or None) instead of the key."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    rotate = rotation is not None
    rotate_keys = rotate and rotate_keys
    qw, q_eps = q_norm if q_norm is not None else (q, 0.0)
    kw, k_eps = k_norm if k_norm is not None else (k, 0.0)
    rows_per_program, block_n, warps = launch_plan(b, d)  # one row: broadcast sums instead of a 16-row dot
    programs = hq * (d // block_n if rotate else 1) + hkv * (d // block_n if rotate_keys else 1)
    grid = (triton.cdiv(b, rows_per_program), programs)
    _decode_qk_kernel[grid](q, k, qw, kw, cos, sin, rotation if rotate else q,
                            key_mean if rotate_keys and key_mean is not None else q, q_out, k_out, b, float(q_eps),
                            float(k_eps), q.stride(0), k.stride(0), cos.stride(0), sin.stride(0),
                            HQ=hq, HKV=hkv, D=d, ROTATE=rotate, PER_HEAD=rotate and rotation.dim() == 3,
                            ROTATE_KEYS=rotate_keys, CENTER_KEYS=rotate_keys and key_mean is not None,
                            HAS_Q_NORM=q_norm is not None, HAS_K_NORM=k_norm is not None, BLOCK=rows_per_program,
                            BLOCK_N=block_n, OVERLAP=overlap, num_warps=warps, **programmatic(overlap))
