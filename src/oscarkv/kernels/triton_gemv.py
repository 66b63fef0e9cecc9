"""Triton kernels: y = W·x for one input row (a batch-1 decode step's linear layers).

At batch 1 a linear layer reads its whole weight for one output row, so its time is the
weight's bytes over the memory bandwidth plus each launch's fixed cost: the ramp up of its
first programs and the tail of its last. Three things keep that fixed cost small:
- **Whole rows.** Each program owns BLOCK_N output rows and loads each of them in one masked
  load of next_power_of_2(K) columns (up to CHUNK; longer rows loop), so all its bytes are in
  flight at once instead of one K block after another.
- **Weights before the wait.** With `overlap` (programmatic dependent launch, `triton_pdl`), a
  launch starts while the kernel before it finishes: its programs load their weight rows first,
  which do not depend on that kernel, and only then wait for it and read x. Each launch also
  lets the one after it start early in turn.
- **Fewer launches.** `launch_gemv` takes up to three weights of the same K (a layer's q, k and
  v projections) and writes their outputs one after another into one vector;
  `launch_gemv_silu_mul` computes silu(W_gate·x) * (W_up·x) in one pass over both weights (a
  gated MLP's first half), rounding where eager PyTorch rounds: each product to the output
  dtype, then the activation, then the product.

On the H100, the products of 36 Qwen3-4B layers in one CUDA graph take 2.52 ms this way (95%
of the copy bandwidth) against 3.05 ms with one K-blocked launch per product
(docs/data/gemv-chain-h100.txt). Products sum in float32, each row's sum in the same order
whatever launch it is in. Reference: `torch.nn.functional.linear` (and `F.silu`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_pdl import gdc_launch_dependents, gdc_wait, programmatic
from .triton_write import _round_to

BLOCK_N = 1
CHUNK = 16384  # columns per load; rows longer than this loop
GEMV_DTYPES = (torch.bfloat16, torch.float16)
MAX_SEGMENTS = 3


@triton.jit
def _start(OVERLAP: tl.constexpr):
    if OVERLAP:
        gdc_launch_dependents()


@triton.jit
def _products(x_ptr, w_rows, row_ok, w_first, K: tl.constexpr, KB: tl.constexpr, OVERLAP: tl.constexpr):
    """float32 [BLOCK_N]: the rows at `w_rows` ([BLOCK_N, 1] pointers) times x [K]. w_first: their
    first KB columns, loaded by the caller before the wait for the kernel before (OVERLAP)."""
    cols = tl.arange(0, KB)
    if OVERLAP:
        gdc_wait()
    x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    acc = w_first.to(tl.float32) * x[None, :]
    for k0 in tl.static_range(KB, K, KB):
        k = k0 + cols
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _gemv_kernel(x_ptr, w0_ptr, w1_ptr, w2_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, N0, N1, N2,
                 stride0: tl.constexpr, stride1: tl.constexpr, stride2: tl.constexpr, K: tl.constexpr,
                 KB: tl.constexpr, SEGMENTS: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, OVERLAP: tl.constexpr):
    """y = [W0·x, W1·x, W2·x] (+ biases): the first cdiv(N0, BLOCK_N) programs own W0's rows, the
    next W1's, the last W2's (SEGMENTS of them)."""
    _start(OVERLAP)
    pid = tl.program_id(0)
    local = tl.arange(0, BLOCK_N)
    rows, b_ptr, n, out_at = pid * BLOCK_N + local, b0_ptr, N0, pid * 0
    w_rows = w0_ptr + rows.to(tl.int64)[:, None] * stride0
    if SEGMENTS >= 2:
        programs0 = tl.cdiv(N0, BLOCK_N)
        if pid >= programs0:
            rows, b_ptr, n, out_at = (pid - programs0) * BLOCK_N + local, b1_ptr, N1, out_at + N0
            w_rows = w1_ptr + rows.to(tl.int64)[:, None] * stride1
            if SEGMENTS == 3:
                programs1 = tl.cdiv(N1, BLOCK_N)
                if pid >= programs0 + programs1:
                    rows, b_ptr, n, out_at = (pid - programs0 - programs1) * BLOCK_N + local, b2_ptr, N2, out_at + N1
                    w_rows = w2_ptr + rows.to(tl.int64)[:, None] * stride2
    row_ok = rows < n
    cols = tl.arange(0, KB)
    w_first = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)
    y = _products(x_ptr, w_rows, row_ok, w_first, K, KB, OVERLAP)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    tl.store(y_ptr + out_at + rows, _round_to(y, dtype).to(dtype), mask=row_ok)


@triton.jit
def _gemv_silu_mul_kernel(x_ptr, wg_ptr, wu_ptr, y_ptr, N, stride_g: tl.constexpr, stride_u: tl.constexpr,
                          K: tl.constexpr, KB: tl.constexpr,
                          BLOCK_N: tl.constexpr, OVERLAP: tl.constexpr):
    """y = silu(Wg·x) * (Wu·x), each product, the activation and the result rounded to y's dtype."""
    _start(OVERLAP)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, KB)
    mask = row_ok[:, None] & (cols < K)[None, :]
    g_rows = wg_ptr + rows.to(tl.int64)[:, None] * stride_g
    u_rows = wu_ptr + rows.to(tl.int64)[:, None] * stride_u
    g_first = tl.load(g_rows + cols[None, :], mask=mask, other=0.0)
    u_first = tl.load(u_rows + cols[None, :], mask=mask, other=0.0)
    dtype = y_ptr.dtype.element_ty
    gate = _round_to(_products(x_ptr, g_rows, row_ok, g_first, K, KB, OVERLAP), dtype)
    up = _round_to(_products(x_ptr, u_rows, row_ok, u_first, K, KB, False), dtype)
    activated = _round_to(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(y_ptr + rows, _round_to(activated * up, dtype).to(dtype), mask=row_ok)


def _columns(k: int) -> int:
    return min(triton.next_power_of_2(k), CHUNK)


def launch_gemv(x: torch.Tensor, weights: list[torch.Tensor] | torch.Tensor,
                biases: list[torch.Tensor | None] | torch.Tensor | None, out: torch.Tensor,
                overlap: bool = False) -> None:
    """out [ΣN] = [W·x (+ b) for each W] for one to three weights [N_i, K] with unit stride along K;
    biases: one entry per weight, all tensors or all None. A single weight and bias may be passed bare.
    overlap: launch early and wait for the kernel before (programmatic dependent launch)."""
    if isinstance(weights, torch.Tensor):
        weights, biases = [weights], [biases]
    if not 1 <= len(weights) <= MAX_SEGMENTS or len(biases) != len(weights):
        raise ValueError(f"launch_gemv takes 1 to {MAX_SEGMENTS} weights with one bias entry each.")
    has_bias = biases[0] is not None
    if any((b is not None) != has_bias for b in biases):
        raise ValueError("launch_gemv: either every weight has a bias or none has.")
    k = weights[0].shape[1]
    if any(w.shape[1] != k for w in weights):
        raise ValueError("launch_gemv: the weights must share K.")
    spare = MAX_SEGMENTS - len(weights)
    padded = list(weights) + [weights[0]] * spare
    bias_args = (list(biases) if has_bias else [x] * len(weights)) + [x] * spare
    programs = sum(triton.cdiv(w.shape[0], BLOCK_N) for w in weights)
    strides = dict(zip(("stride0", "stride1", "stride2"), (w.stride(0) for w in padded)))
    _gemv_kernel[(programs,)](x, *padded, *bias_args, out, *(w.shape[0] for w in padded), **strides,
                              K=k, KB=_columns(k), SEGMENTS=len(weights),
                              HAS_BIAS=has_bias, BLOCK_N=BLOCK_N, OVERLAP=overlap, num_warps=4, num_stages=1,
                              **programmatic(overlap))


def launch_gemv_silu_mul(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor,
                         overlap: bool = False) -> None:
    """out [N] = silu(gate·x) * (up·x) for gate, up [N, K] with unit stride along K."""
    n, k = gate.shape
    _gemv_silu_mul_kernel[(triton.cdiv(n, BLOCK_N),)](x, gate, up, out, n, stride_g=gate.stride(0),
                                                      stride_u=up.stride(0), K=k, KB=_columns(k), BLOCK_N=BLOCK_N, OVERLAP=overlap,
                                                      num_warps=4, num_stages=1, **programmatic(overlap))
