"""Triton kernel: y = W·x for one input row (a batch-1 decode step's linear layers).

At batch 1 a linear layer reads its whole weight for one output row. cuBLAS takes 5.6 µs for
Qwen3-4B's 1024 x 2560 projection (2.6 µs here) and 272 µs for its 151936 x 2560 LM head (246 µs
here) on an H100 (docs/data/gemv-probe-h100.txt); a whole batch-1 step is 9% faster (docs/decode.md). Here each program owns BLOCK_N output rows and walks K in
BLOCK_K columns: a [BLOCK_N, BLOCK_K] tile of W per step, multiplied by x in float32 and
summed once at the end. Two rows per program give a 1024-row projection 512 programs, enough
to keep the GPU's loads in flight. Reference: `torch.nn.functional.linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 2
BLOCK_K = 1024
GEMV_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_w, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        k_ok = k < K
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def launch_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [N] = weight [N, K] · x [K] (+ bias [N]); weight with unit stride along K."""
    n, k = weight.shape
    _gemv_kernel[(triton.cdiv(n, BLOCK_N),)](x, weight, bias if bias is not None else x, out, n, k,
                                             weight.stride(0), HAS_BIAS=bias is not None, BLOCK_N=BLOCK_N,
                                             BLOCK_K=BLOCK_K, num_warps=4, num_stages=3)
