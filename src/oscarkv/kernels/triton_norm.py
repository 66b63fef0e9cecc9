"""Triton kernel: RMSNorm of a decode step's rows, launched to overlap the kernels around it.

y = w * round(x · rsqrt(mean(x²) + eps)), as the RMSNorm of Llama, Mistral, Qwen2 and Qwen3 computes
it: x in float32, the normalized row rounded to x's dtype, then multiplied by the weight and rounded
again. One program per row; BLOCK covers the row in one masked load. With a residual, the kernel
first adds it (rounded as eager PyTorch's bfloat16 add rounds) and stores the sum: a decoder
layer's residual add and the norm after it in one launch.

With `overlap` (programmatic dependent launch, `triton_pdl`) the launch may start while the kernel
before it ends, and it lets the launch after it start early in turn: at batch 1 that is the
matrix-vector product of q/k/v, of the MLP's gate and up, or of the LM head (`triton_gemv`), which
then loads its weights while the norm runs. Reference: the modules' own forward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_pdl import gdc_launch_dependents, gdc_wait, programmatic
from .triton_write import _round_to

NORM_DTYPES = (torch.bfloat16, torch.float16)
# Steps of at least MANY_ROWS rows of at most SHORT_ROW values (a prompt's q/k heads) take tiles of ROW_TILE values
# (so several rows) a program, in TILE_WARPS warps (`norm_plan`). H200, bfloat16 rows of 128, one launch
# (scripts/probe_norm_rows.py, docs/data/prompt-norms-h200-s64.txt): 65,536 rows 42.2 us one row a program, 19.8 us
# 64 rows in 4 warps; at 16,384 rows one row a program (19.6 us) was as fast as any tile (19.5-28.3 us).
MANY_ROWS = 32768
SHORT_ROW = 256
ROW_TILE = 8192
TILE_WARPS = 4


# M, the rows of the step, changes from prompt chunk to prompt chunk: not specialised, so that a new length does not
# compile another variant in the middle of serving (as `triton_dequantize.PER_STEP_INTS`).
@triton.jit(do_not_specialize=("M",))
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, eps, r_ptr, sum_ptr, M, BLOCK: tl.constexpr, OVERLAP: tl.constexpr,
                     RESIDUAL: tl.constexpr = False, ROWS: tl.constexpr = 1):
    """RESIDUAL: first x = round(r + x), stored to sum_ptr (a decoder layer's residual add), then the norm.
    ROWS > 1: that many of the M rows a program (a [ROWS, BLOCK] tile), for prompts' many short rows."""
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if OVERLAP:
        gdc_launch_dependents()
        gdc_wait()
    dtype = y_ptr.dtype.element_ty
    if ROWS == 1:
        row = tl.program_id(0).to(tl.int64)
        x = tl.load(x_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
        if RESIDUAL:
            x = _round_to(tl.load(r_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32) + x, dtype)
            tl.store(sum_ptr + row * N + cols, x.to(dtype), mask=ok)
        normed = _round_to(x * tl.math.rsqrt(tl.sum(x * x, 0) / N + eps), dtype)
        tl.store(y_ptr + row * N + cols, _round_to(w * normed, dtype).to(dtype), mask=ok)
    else:
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        at = rows[:, None] * N + cols[None, :]
        inside = (rows < M)[:, None] & ok[None, :]
        x = tl.load(x_ptr + at, mask=inside, other=0.0).to(tl.float32)
        if RESIDUAL:
            x = _round_to(tl.load(r_ptr + at, mask=inside, other=0.0).to(tl.float32) + x, dtype)
            tl.store(sum_ptr + at, x.to(dtype), mask=inside)
        normed = _round_to(x * tl.math.rsqrt(tl.sum(x * x, 1) / N + eps)[:, None], dtype)
        tl.store(y_ptr + at, _round_to(w[None, :] * normed, dtype).to(dtype), mask=inside)


def norm_warps(n: int) -> int:
    """Warps of a program that normalizes one row of n values. Rows of 1024 or more take 8: on the H100 the
    Qwen3-4B step (rows of 2560) at 1×100K took 4.418–4.425 ms with 8, 16 or 32 warps against 4.432–4.440 with 4,
    4.47 with 2 and 4.62 with 1 (docs/data/norm-warps-h100.txt)."""
    return 8 if n >= 1024 else 1


def norm_plan(m: int, n: int) -> tuple[int, int]:
    """(rows a program, warps) for m rows of n values: one row a program (`norm_warps`) unless the rows are many and
    short (a prompt's q/k norms), which take ROW_TILE values a program."""
    block = triton.next_power_of_2(n)
    if m >= MANY_ROWS and block <= SHORT_ROW:
        return ROW_TILE // block, TILE_WARPS
    return 1, norm_warps(n)


def launch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor, overlap: bool = False,
                    residual: torch.Tensor | None = None, summed: torch.Tensor | None = None) -> None:
    """out = RMSNorm(x) over the last dimension; x and out contiguous, weight [N] of x's dtype. With `residual`
    (x's shape, contiguous): summed = residual + x, and out = RMSNorm(summed)."""
    n = x.shape[-1]
    m = x.numel() // n
    rows, warps = norm_plan(m, n)
    extra = (residual, summed) if residual is not None else (x, out)
    _rms_norm_kernel[(triton.cdiv(m, rows),)](x, weight, out, n, eps, *extra, m, BLOCK=triton.next_power_of_2(n),
                                              OVERLAP=overlap, RESIDUAL=residual is not None, ROWS=rows,
                                              num_warps=warps, **programmatic(overlap))
