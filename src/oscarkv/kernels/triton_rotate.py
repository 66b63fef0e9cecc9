"""Triton kernel: a step's queries rotated by R_K, in the layout the attention kernel reads.

One launch does what took three or four small kernels in PyTorch (cast to float32, x @ R_K,
cast back, transpose to tokens-major): each program loads BLOCK rows of one query head from
[B, Hq, n, D] (any strides with unit stride on D), multiplies them by 32 columns of its KV
head's rotation in float32 (IEEE products, no TF32), with the contraction in slices of 32, and
stores them as [B·n, Hq, D] in the queries' dtype. Columns in the grid and slices in the loop
keep a program small for any D: a first version with whole 128×64 blocks per program made the
Qwen3-4B decode step 1.4 ms slower, and one with a column loop took 27 µs at D = 256. Steps of
many rows (prompt chunks) take larger blocks (LONG_STEP_ROWS).
Reference: `oscarkv.kernels.reference.rotate_queries_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_write import _round_to

BLOCK_ROWS = 16  # the smallest M of a tensor-core dot; a decode step has B rows
# Steps of many rows (prompt chunks): blocks of 64 rows by up to 128 columns, 8 warps, where that still makes at least
# LONG_STEP_PROGRAMS programs. Each program then loads a slice of R_K for 64 rows instead of 16 and reads its rows
# once for all columns. H200, one sequence (scripts/probe_rotate_queries.py --blocks,
# docs/data/rotate-queries-blocks-h200.txt), 16 by 32 against 64 by 128: Qwen3 shapes (32 query heads, D = 128)
# 64 rows 5.9 against 9.3 us (32 programs), 128 rows 9.8 against 9.3, 256 17.8 against 9.6, 512 33.7 against 18.0,
# 2048 127.6 against 67.9; SmolLM2 (9 heads, D = 64) 256 rows 3.1 against 3.9 us (36 programs), 512 4.1 against
# 4.0, 2048 10.8 against 8.2.
LONG_STEP_ROWS = 64
LONG_BLOCK_COLUMNS = 128
LONG_STEP_WARPS = 8
LONG_STEP_PROGRAMS = 64


def takes_long_blocks(rows: int, query_heads: int) -> bool:
    """Whether a step of `rows` query rows and `query_heads` heads takes the long-step blocks."""
    return triton.cdiv(rows, LONG_STEP_ROWS) * query_heads >= LONG_STEP_PROGRAMS


@triton.jit
def _rotate_queries_kernel(q_ptr, r_ptr, out_ptr, rows, n, stride_b, stride_h, stride_n,
                           HQ: tl.constexpr, GROUP: tl.constexpr, PER_HEAD: tl.constexpr, D: tl.constexpr,
                           BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    head = tl.program_id(1)
    j = tl.program_id(2) * BLOCK_N  # this program's output columns
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = r < rows
    seq, token = r // n, r % n
    rows_at = q_ptr + seq[:, None] * stride_b + head * stride_h + token[:, None] * stride_n
    rotation = r_ptr + (head // GROUP) * D * D if PER_HEAD else r_ptr
    columns = tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK, BLOCK_N), dtype=tl.float32)
    for k in tl.static_range(0, D, BLOCK_K):  # the contraction in slices: few registers for any D
        x = tl.load(rows_at + k + inner[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        block = tl.load(rotation + (k + inner[:, None]) * D + j + columns[None, :])
        acc = tl.dot(x, block, acc, input_precision="ieee")
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + r[:, None] * (HQ * D) + head * D + j + columns[None, :],
             _round_to(acc, out_dtype).to(out_dtype), mask=valid[:, None])


def launch_rotate_queries(query: torch.Tensor, rotation: torch.Tensor, out: torch.Tensor) -> None:
    """query [B, Hq, n, D] (unit stride on D), rotation float32 [D, D] or [Hkv, D, D] (contiguous),
    out [B·n, Hq, D] contiguous."""
    b, hq, n, d = query.shape
    per_head = rotation.dim() == 3
    group = hq // rotation.shape[0] if per_head else hq
    rows = b * n
    long_step = takes_long_blocks(rows, hq)
    block = LONG_STEP_ROWS if long_step else BLOCK_ROWS
    block_n = min(d, LONG_BLOCK_COLUMNS if long_step else 32)
    grid = (triton.cdiv(rows, block), hq, d // block_n)
    _rotate_queries_kernel[grid](query, rotation, out, rows, n, query.stride(0), query.stride(1), query.stride(2),
                                 HQ=hq, GROUP=group, PER_HEAD=per_head, D=d, BLOCK=block,
                                 BLOCK_N=block_n, BLOCK_K=32, num_warps=LONG_STEP_WARPS if long_step else 4)
