"""Triton kernels for a decode step's linear layers: y = x·Wᵀ for one input row (matrix-vector) or a few
(2 to MAX_ROWS: a batch of decode steps).

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
(docs/data/gemv-chain-h100.txt).

**A few rows** (`_rows_kernel`, `_rows_silu_mul_kernel`; the same launchers, given x [M, K]). Each
weight element now meets M inputs, too many multiply-adds for the CUDA cores at M = 32, so tiles of
BLOCK_N weight rows go through tensor-core dots with all M rows (padded to 16 or 32), BLOCK_K columns
at a time, pipelined. cuBLAS reads these skinny products at 55-60% of the copy bandwidth on the H200;
what this adds:
- **Split-K for the few tiles.** A layer has a few dozen 64-row tiles (o and down: 40), far fewer than
  multiprocessors, so each tile's columns are split over several programs (about one program per
  multiprocessor in all, `RowTile.waves`). Each stores its partial sums; the last of a tile's programs
  to arrive (an atomic count, which it sets back to zero) adds them in split order and writes the
  result, so there is no second launch and the sum does not depend on which program came last.
- **The first weight tile before the wait**, as at batch 1.
- The same fusions: q/k/v in one launch, gate/up with silu·up in one.

Products sum in float32, each row's sum in the same order whatever launch it is in (a row of a batch may
differ from the same row alone by a rounding: other kernels, as with cuBLAS); reference:
`torch.nn.functional.linear` (and `F.silu`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .arrival_counts import arrival_counts
from .triton_pdl import gdc_launch_dependents, gdc_wait, programmatic
from .triton_write import _round_to

BLOCK_N = 1
CHUNK = 16384  # columns per load; rows longer than this loop
GEMV_DTYPES = (torch.bfloat16, torch.float16)
MAX_SEGMENTS = 3
MAX_ROWS = 32  # input rows the few-rows kernels take (a decode step's batch); more go to cuBLAS


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
def _segment_rows(block, zero, w0_ptr, w1_ptr, w2_ptr, b0_ptr, b1_ptr, b2_ptr, N0, N1, N2, stride0: tl.constexpr,
                  stride1: tl.constexpr, stride2: tl.constexpr, SEGMENTS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block `block` of BLOCK_N rows of the stacked weights [W0; W1; W2] (SEGMENTS of them): the first
    cdiv(N0, BLOCK_N) blocks are W0's rows, the next W1's, the last W2's. Returns (the rows within their weight,
    their [BLOCK_N, 1] pointers, the weight's bias pointer and N, where its outputs start). zero: 0 as an integer
    of the program's."""
    local = tl.arange(0, BLOCK_N)
    rows, b_ptr, n, out_at = block * BLOCK_N + local, b0_ptr, N0, zero
    w_rows = w0_ptr + rows.to(tl.int64)[:, None] * stride0
    if SEGMENTS >= 2:
        blocks0 = tl.cdiv(N0, BLOCK_N)
        if block >= blocks0:
            rows, b_ptr, n, out_at = (block - blocks0) * BLOCK_N + local, b1_ptr, N1, out_at + N0
            w_rows = w1_ptr + rows.to(tl.int64)[:, None] * stride1
            if SEGMENTS == 3:
                blocks1 = tl.cdiv(N1, BLOCK_N)
                if block >= blocks0 + blocks1:
                    rows, b_ptr, n, out_at = (block - blocks0 - blocks1) * BLOCK_N + local, b2_ptr, N2, out_at + N1
                    w_rows = w2_ptr + rows.to(tl.int64)[:, None] * stride2
    return rows, w_rows, b_ptr, n, out_at


@triton.jit
def _gemv_kernel(x_ptr, w0_ptr, w1_ptr, w2_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, N0, N1, N2,
                 stride0: tl.constexpr, stride1: tl.constexpr, stride2: tl.constexpr, K: tl.constexpr,
                 KB: tl.constexpr, SEGMENTS: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, OVERLAP: tl.constexpr):
    """y = [W0·x, W1·x, W2·x] (+ biases): the first cdiv(N0, BLOCK_N) programs own W0's rows, the
    next W1's, the last W2's (SEGMENTS of them)."""
    _start(OVERLAP)
    pid = tl.program_id(0)
    rows, w_rows, b_ptr, n, out_at = _segment_rows(pid, pid * 0, w0_ptr, w1_ptr, w2_ptr, b0_ptr, b1_ptr, b2_ptr, N0, N1,
                                                   N2, stride0, stride1, stride2, SEGMENTS, BLOCK_N)
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


@triton.jit
def _row_tile_products(x_ptr, M, stride_x, w_rows, u_rows, row_ok, k_begin, k_end, K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PAIR: tl.constexpr, DOT_DTYPE: tl.constexpr,
                       OVERLAP: tl.constexpr):
    """float32 [BLOCK_N, BLOCK_M]: the weight rows at `w_rows` ([BLOCK_N, 1] pointers) times the first M rows of
    x [M, K] (row stride stride_x), over columns [k_begin, k_end), by tensor-core dots over BLOCK_K columns at a
    time; with PAIR also the rows at `u_rows` in the same pass (else the second result is the first).
    DOT_DTYPE: the dots' operand type (the weights' on the GPU; float32 in the CPU interpreter, whose bfloat16
    dots are wrong)."""
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    x_cols = x_ptr + m[None, :].to(tl.int64) * stride_x
    # the first weight columns before the wait for the kernel before (they do not depend on it)
    k = k_begin + kk
    w_mask = row_ok[:, None] & (k < K)[None, :]
    w_first = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0).to(DOT_DTYPE)
    u_first = w_first
    if PAIR:
        u_first = tl.load(u_rows + k[None, :], mask=w_mask, other=0.0).to(DOT_DTYPE)
    if OVERLAP:
        gdc_wait()
    x = tl.load(x_cols + k[:, None], mask=(k < K)[:, None] & (m < M)[None, :], other=0.0).to(DOT_DTYPE)
    acc = tl.dot(w_first, x)
    acc_u = acc
    if PAIR:
        acc_u = tl.dot(u_first, x)
    for k0 in range(k_begin + BLOCK_K, k_end, BLOCK_K):
        k = k0 + kk
        w_mask = row_ok[:, None] & (k < K)[None, :]
        x = tl.load(x_cols + k[:, None], mask=(k < K)[:, None] & (m < M)[None, :], other=0.0).to(DOT_DTYPE)
        acc = tl.dot(tl.load(w_rows + k[None, :], mask=w_mask, other=0.0).to(DOT_DTYPE), x, acc)
        if PAIR:
            acc_u = tl.dot(tl.load(u_rows + k[None, :], mask=w_mask, other=0.0).to(DOT_DTYPE), x, acc_u)
    if PAIR:
        return acc, acc_u
    return acc, acc


@triton.jit
def _tile_and_split(SPLITS: tl.constexpr):
    """(tile, split) of this program: SPLITS consecutive programs per tile."""
    tile = tl.program_id(0)
    split = tile * 0
    if SPLITS > 1:
        split = tile % SPLITS
        tile = tile // SPLITS
    return tile, split


@triton.jit
def _sum_splits(acc, acc_u, partial_ptr, count_ptr, tile, split, SPLITS: tl.constexpr, PAIR: tl.constexpr):
    """Split-K: each of a tile's SPLITS programs stores its partial sums, and the last one to arrive (an atomic
    count per tile, which it sets back to 0) adds them all in split order, so that the result does not depend on
    which program came last. Returns (whether this program is the last, the sums, the second sums of PAIR)."""
    last = split == 0
    total, total_u = acc, acc_u
    if SPLITS > 1:
        BLOCK_N: tl.constexpr = acc.shape[0]
        BLOCK_M: tl.constexpr = acc.shape[1]
        TILE: tl.constexpr = BLOCK_N * BLOCK_M * (2 if PAIR else 1)
        at = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        base = partial_ptr + tile.to(tl.int64) * SPLITS * TILE
        tl.store(base + split * TILE + at, acc)
        if PAIR:
            tl.store(base + split * TILE + BLOCK_N * BLOCK_M + at, acc_u)
        tl.debug_barrier()  # every thread's partial stored before the count (released by the atomic) goes up
        last = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLITS - 1
        if last:
            total = tl.load(base + at, cache_modifier=".cg")
            if PAIR:
                total_u = tl.load(base + BLOCK_N * BLOCK_M + at, cache_modifier=".cg")
            for j in tl.static_range(1, SPLITS):
                total += tl.load(base + j * TILE + at, cache_modifier=".cg")
                if PAIR:
                    total_u += tl.load(base + j * TILE + BLOCK_N * BLOCK_M + at, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0)
    return last, total, total_u


@triton.jit
def _rows_kernel(x_ptr, w0_ptr, w1_ptr, w2_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, partial_ptr, count_ptr, M, N0, N1, N2,
                 stride_x, stride0: tl.constexpr, stride1: tl.constexpr, stride2: tl.constexpr,
                 K: tl.constexpr, SEGMENTS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, K_SPLIT: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, OVERLAP: tl.constexpr):
    """y = x·W0ᵀ [M, N0], then x·W1ᵀ [M, N1], then x·W2ᵀ [M, N2] (+ biases), one after another, for a few rows
    x [M, K]: tiles of BLOCK_N weight rows laid out as `_gemv_kernel`'s programs (W0's, then W1's, then W2's),
    each tile's K_SPLIT-column slices in SPLITS programs (`_sum_splits`), each program all M input rows."""
    _start(OVERLAP)
    tile, split = _tile_and_split(SPLITS)
    rows, w_rows, b_ptr, n, out_at = _segment_rows(tile, split * 0, w0_ptr, w1_ptr, w2_ptr, b0_ptr, b1_ptr, b2_ptr, N0,
                                                   N1, N2, stride0, stride1, stride2, SEGMENTS, BLOCK_N)
    row_ok = rows < n
    k_begin = split * K_SPLIT
    y, _ = _row_tile_products(x_ptr, M, stride_x, w_rows, w_rows, row_ok, k_begin, tl.minimum(k_begin + K_SPLIT, K),
                              K, BLOCK_M, BLOCK_K, False, DOT_DTYPE, OVERLAP)
    last, y, _ = _sum_splits(y, y, partial_ptr, count_ptr, tile, split, SPLITS, False)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    m = tl.arange(0, BLOCK_M)
    dtype = y_ptr.dtype.element_ty
    dst = y_ptr + out_at.to(tl.int64) * M + m[None, :].to(tl.int64) * n + rows[:, None]  # this weight's [M, N]
    if last:
        tl.store(dst, _round_to(y, dtype).to(dtype), mask=row_ok[:, None] & (m < M)[None, :])


@triton.jit
def _rows_silu_mul_kernel(x_ptr, wg_ptr, wu_ptr, y_ptr, partial_ptr, count_ptr, M, N, stride_x, stride_y,
                          stride_g: tl.constexpr, stride_u: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, K_SPLIT: tl.constexpr,
                          DOT_DTYPE: tl.constexpr, OVERLAP: tl.constexpr):
    """y [M, N] = silu(x·Wgᵀ) * (x·Wuᵀ) for a few rows x [M, K], rounded as `_gemv_silu_mul_kernel` rounds;
    tiles and splits as in `_rows_kernel`."""
    _start(OVERLAP)
    tile, split = _tile_and_split(SPLITS)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    dtype = y_ptr.dtype.element_ty
    g_rows = wg_ptr + rows.to(tl.int64)[:, None] * stride_g
    u_rows = wu_ptr + rows.to(tl.int64)[:, None] * stride_u
    k_begin = split * K_SPLIT
    gate, up = _row_tile_products(x_ptr, M, stride_x, g_rows, u_rows, row_ok, k_begin,
                                  tl.minimum(k_begin + K_SPLIT, K), K, BLOCK_M, BLOCK_K, True, DOT_DTYPE, OVERLAP)
    last, gate, up = _sum_splits(gate, up, partial_ptr, count_ptr, tile, split, SPLITS, True)
    gate, up = _round_to(gate, dtype), _round_to(up, dtype)
    activated = _round_to(gate / (1.0 + tl.exp(-gate)), dtype)
    m = tl.arange(0, BLOCK_M)
    dst = y_ptr + m[None, :].to(tl.int64) * stride_y + rows[:, None]
    if last:
        tl.store(dst, _round_to(activated * up, dtype).to(dtype), mask=row_ok[:, None] & (m < M)[None, :])


def _columns(k: int) -> int:
    return min(triton.next_power_of_2(k), CHUNK)


@dataclass(frozen=True)
class RowTile:
    """Launch shape of the few-rows kernels: BLOCK_N weight rows per tile, the M input rows padded to BLOCK_M,
    BLOCK_K columns per dot, and each tile's columns split over enough programs for about `waves` programs per
    multiprocessor (split-K, `_sum_splits`)."""
    block_n: int = 64
    block_k: int = 128
    warps: int = 4
    stages: int = 4
    waves: float = 1.0

    def block_m(self, m: int) -> int:
        return max(16, triton.next_power_of_2(m))

    def splits(self, tiles: int, k: int, sms: int) -> tuple[int, int]:
        """(programs per tile, columns per program, a multiple of block_k)."""
        steps = triton.cdiv(k, self.block_k)
        wanted = min(steps, max(1, int(self.waves * sms // tiles)))
        k_split = triton.cdiv(steps, wanted) * self.block_k
        return triton.cdiv(k, k_split), k_split


ROW_TILE = RowTile()


def _split_counts(device: torch.device, tiles: int) -> torch.Tensor:
    """The per-tile arrival counts of split-K launches (`arrival_counts`). Split launches have fewer tiles than
    about `waves` programs per multiprocessor, so its 4096 counts suffice."""
    return arrival_counts(device, tiles, "split-k")


def _split_plan(x: torch.Tensor, tiles: int, k: int, m: int, tile: RowTile, pair: bool):
    """(splits, columns per split, partial-sum workspace, counts) of a few-rows launch."""
    from .ops import _multiprocessor_count

    splits, k_split = tile.splits(tiles, k, _multiprocessor_count(x.device))
    if splits == 1:
        return 1, k_split, x, x
    partial = torch.empty(tiles * splits * tile.block_n * tile.block_m(m) * (2 if pair else 1), dtype=torch.float32,
                          device=x.device)
    return splits, k_split, partial, _split_counts(x.device, tiles)


def _dot_dtype(x: torch.Tensor):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[x.dtype] if x.device.type == "cuda" else tl.float32


def _rows(x: torch.Tensor) -> int:
    return 1 if x.dim() == 1 else x.shape[0]


def launch_gemv(x: torch.Tensor, weights: list[torch.Tensor] | torch.Tensor,
                biases: list[torch.Tensor | None] | torch.Tensor | None, out: torch.Tensor,
                overlap: bool = False, tile: RowTile = ROW_TILE) -> None:
    """out = x·Wᵀ (+ b) for each W, one after another, for one to three weights [N_i, K] with unit stride along K:
    x [K] (one row: the matrix-vector kernel) or x [M, K] with unit stride along K (M ≤ MAX_ROWS: the few-rows
    kernel, `tile`); out contiguous, of M·ΣN elements, holding each weight's product as a contiguous [M, N_i]
    block after the one before (for one weight: out [M, N]; for one row: [ΣN]). So each product is a contiguous
    tensor, as a model's own q, k and v projections are (`integrations.gemv.SharedInputProjections`).
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
    m = _rows(x)
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"launch_gemv takes 1 to {MAX_ROWS} input rows, not {m}.")
    if not out.is_contiguous() or out.numel() != m * sum(w.shape[0] for w in weights):
        raise ValueError("launch_gemv: out must be contiguous, with one element per input row and weight row.")
    spare = MAX_SEGMENTS - len(weights)
    padded = list(weights) + [weights[0]] * spare
    bias_args = (list(biases) if has_bias else [x] * len(weights)) + [x] * spare
    strides = dict(zip(("stride0", "stride1", "stride2"), (w.stride(0) for w in padded)))
    sizes = [w.shape[0] for w in padded]
    if x.dim() == 1:
        programs = sum(triton.cdiv(w.shape[0], BLOCK_N) for w in weights)
        _gemv_kernel[(programs,)](x, *padded, *bias_args, out, *sizes, **strides,
                                  K=k, KB=_columns(k), SEGMENTS=len(weights),
                                  HAS_BIAS=has_bias, BLOCK_N=BLOCK_N, OVERLAP=overlap, num_warps=4, num_stages=1,
                                  **programmatic(overlap))
        return
    tiles = sum(triton.cdiv(w.shape[0], tile.block_n) for w in weights)
    splits, k_split, partial, counts = _split_plan(x, tiles, k, m, tile, pair=False)
    _rows_kernel[(tiles * splits,)](x, *padded, *bias_args, out, partial, counts, m, *sizes, x.stride(0), **strides,
                                    K=k, SEGMENTS=len(weights), HAS_BIAS=has_bias, BLOCK_N=tile.block_n,
                                    BLOCK_M=tile.block_m(m), BLOCK_K=tile.block_k, SPLITS=splits, K_SPLIT=k_split,
                                    DOT_DTYPE=_dot_dtype(x), OVERLAP=overlap, num_warps=tile.warps,
                                    num_stages=tile.stages, **programmatic(overlap))


def launch_gemv_silu_mul(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor,
                         overlap: bool = False, tile: RowTile = ROW_TILE) -> None:
    """out = silu(x·gateᵀ) * (x·upᵀ) for gate, up [N, K] with unit stride along K: x [K] and out [N], or
    x [M, K] and out [M, N] (M ≤ MAX_ROWS)."""
    n, k = gate.shape
    m = _rows(x)
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"launch_gemv_silu_mul takes 1 to {MAX_ROWS} input rows, not {m}.")
    if x.dim() == 1:
        _gemv_silu_mul_kernel[(triton.cdiv(n, BLOCK_N),)](x, gate, up, out, n, stride_g=gate.stride(0),
                                                          stride_u=up.stride(0), K=k, KB=_columns(k), BLOCK_N=BLOCK_N,
                                                          OVERLAP=overlap, num_warps=4, num_stages=1,
                                                          **programmatic(overlap))
        return
    tiles = triton.cdiv(n, tile.block_n)
    splits, k_split, partial, counts = _split_plan(x, tiles, k, m, tile, pair=True)
    _rows_silu_mul_kernel[(tiles * splits,)](
        x, gate, up, out, partial, counts, m, n, x.stride(0), out.stride(0), stride_g=gate.stride(0),
        stride_u=up.stride(0), K=k, BLOCK_N=tile.block_n, BLOCK_M=tile.block_m(m), BLOCK_K=tile.block_k,
        SPLITS=splits, K_SPLIT=k_split, DOT_DTYPE=_dot_dtype(x), OVERLAP=overlap, num_warps=tile.warps,
        num_stages=tile.stages, **programmatic(overlap))
