"""Triton kernel: a step's queries rotated by R_K, in the layout the attention kernel reads.

One launch does what took three or four small kernels in PyTorch (cast to float32, x @ R_K,
cast back, transpose to tokens-major): each program loads BLOCK rows of one query head from
[B, Hq, n, D] (any strides with unit stride on D), multiplies them by 32 columns of its KV
head's rotation in float32 (IEEE products, no TF32), with the contraction in slices of 32, and
stores them as [B·n, Hq, D] in the queries' dtype. Columns in the grid and slices in the loop
keep a program small for any D: a first version with whole 128×64 blocks per program made the
Qwen3-4B decode step 1.4 ms slower, and one with a column loop took 27 µs at D = 256. Steps of
many rows (prompt chunks) take larger blocks (LONG_STEP_ROWS) and, for bfloat16 and float16 queries, the
tensor cores (PIECE_DTYPES).
Reference: `oscarkv.kernels.reference.rotate_queries_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ops import interpreting
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
# Long steps of these query dtypes multiply on the tensor cores: the queries as they are, by R_K split into three
# terms of their dtype (`_split_piece`), which sum to it to float32 accuracy, accumulated in float32. Their blocks:
# 128 rows, 8 warps where D >= 128 and that makes at least WIDE_PIECE_PROGRAMS programs (each program then loads
# its slices of R_K for twice the rows), else 64 rows, 4 warps. H200, one sequence, bfloat16, float32 dots in
# 64-row blocks against these (scripts/probe_rotate_queries.py --pieces, docs/data/rotate-queries-pieces-h200.txt):
# Qwen3 shapes 2048 rows 69.1 against 19.4 us, 512 17.9 against 7.2, 256 9.6 against 5.9, 128 9.1 against 5.5;
# SmolLM2 shapes 2048 rows 8.3 against 4.3, 512 4.0 against 3.1. A rare output differs from the float32 dots' in
# its last bit (3 in 10,000 in bfloat16, 2 in 1,000 in float16), as the products are summed in another order.
PIECE_DTYPES = (torch.bfloat16, torch.float16)
WIDE_PIECE_ROWS = 128
WIDE_PIECE_PROGRAMS = 128
PIECE_WARPS = (4, 8)  # 64-row blocks, 128-row blocks


def takes_long_blocks(rows: int, query_heads: int) -> bool:
    """Whether a step of `rows` query rows and `query_heads` heads takes the long-step blocks."""
    return triton.cdiv(rows, LONG_STEP_ROWS) * query_heads >= LONG_STEP_PROGRAMS


@triton.jit
def _split_piece(rest, dtype: tl.constexpr):
    """(rest rounded to `dtype`, as float32; what is left of rest): one term of R_K's split."""
    piece = rest.to(dtype).to(tl.float32)
    return piece, rest - piece


@triton.jit
def _rotate_queries_kernel(q_ptr, r_ptr, out_ptr, rows, n, stride_b, stride_h, stride_n,
                           HQ: tl.constexpr, GROUP: tl.constexpr, PER_HEAD: tl.constexpr, D: tl.constexpr,
                           BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PIECES: tl.constexpr = False, COMPILED: tl.constexpr = True):
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
    q_dtype = q_ptr.dtype.element_ty
    for k in tl.static_range(0, D, BLOCK_K):  # the contraction in slices: few registers for any D
        block = tl.load(rotation + (k + inner[:, None]) * D + j + columns[None, :])
        if PIECES:  # tensor cores: the queries as they are, R_K as three terms in their dtype (smallest first)
            x = tl.load(rows_at + k + inner[None, :], mask=valid[:, None], other=0.0)
            high, rest = _split_piece(block, q_dtype)
            middle, rest = _split_piece(rest, q_dtype)
            low = rest.to(q_dtype)
            if COMPILED:
                acc = tl.dot(x, low, acc)
                acc = tl.dot(x, middle.to(q_dtype), acc)
                acc = tl.dot(x, high.to(q_dtype), acc)
            else:  # the CPU interpreter's bfloat16 dot is wrong: the same terms in float32
                x = x.to(tl.float32)
                acc = tl.dot(x, low.to(tl.float32), acc, input_precision="ieee")
                acc = tl.dot(x, middle, acc, input_precision="ieee")
                acc = tl.dot(x, high, acc, input_precision="ieee")
        else:
            x = tl.load(rows_at + k + inner[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
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
    block, warps, pieces = launch_blocks(rows, hq, d, query.dtype)
    block_n = min(d, LONG_BLOCK_COLUMNS if block > BLOCK_ROWS else 32)
    grid = (triton.cdiv(rows, block), hq, d // block_n)
    _rotate_queries_kernel[grid](query, rotation, out, rows, n, query.stride(0), query.stride(1), query.stride(2),
                                 HQ=hq, GROUP=group, PER_HEAD=per_head, D=d, BLOCK=block,
                                 BLOCK_N=block_n, BLOCK_K=32, PIECES=pieces, COMPILED=not interpreting(),
                                 num_warps=warps)


def launch_blocks(rows: int, query_heads: int, d: int, dtype: torch.dtype) -> tuple[int, int, bool]:
    """(rows a program, warps, whether by R_K's terms on the tensor cores) for a step of `rows` query rows."""
    if not takes_long_blocks(rows, query_heads):
        return BLOCK_ROWS, 4, False
    if dtype not in PIECE_DTYPES:
        return LONG_STEP_ROWS, LONG_STEP_WARPS, False
    if d >= 128 and triton.cdiv(rows, WIDE_PIECE_ROWS) * query_heads >= WIDE_PIECE_PROGRAMS:
        return WIDE_PIECE_ROWS, PIECE_WARPS[1], True
    return LONG_STEP_ROWS, PIECE_WARPS[0], True
