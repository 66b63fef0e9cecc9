"""Extend steps on the GPU: the history dequantized once, then one SDPA over the whole sequence.

An extend step appends a chunk of n > 1 tokens to a sequence that already holds some (a chunked
prefill in `oscarkv serve`, a prompt that continues a cached conversation). The fused kernel
(`triton_attention`) handles it with one program per block of 16 or 32 query rows, and each program
decodes every history page again: at 8K stored tokens and a 512-token chunk that was 4.7× slower
than BF16 SDPA over the same contents (H100, docs/kernels-log.md). Here the step instead
1. builds the sequence's keys and values in float16 (`COMPUTE_DTYPE`) in one launch
   (`triton_dequantize.launch_dense_kv`): sink, the history pages dequantized (once per step), the ring,
   and the step's own tokens;
2. runs one SDPA with a lower-right causal bias (`causal_gqa_attention`; with a sliding window the masked
   `gqa_attention`), as the BF16 slot cache also does for its extend steps.

What it computes is `reference.attention_reference`, with the dequantized values, the windows and
the queries rounded once to float16 (`COMPUTE_DTYPE`; the fused kernel's dots take float16 queries
and exact codes). `ops.attend_step` takes this path on CUDA for steps
of at least EXTEND_MIN_TOKENS new tokens per sequence (`extend="auto"`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..cache.paged import PagedLayer, StepBatch

# New tokens per sequence from which "auto" dequantizes. H100, Qwen3 shapes, one layer (docs/kernels-log.md): the
# fused kernel's time (32-row query blocks) grows with the new tokens (8K stored: 64 µs at 32, 85 at 48, 103 at
# 56, 114 at 64), this path's hardly (73, 73, 74, 73 µs with the one-launch dense build); at 8K and at 32K the
# fused kernel is faster at 32 new tokens (32K: 199 against 216 µs) and slower from 48 (32K: 249 against 217).
EXTEND_MIN_TOKENS = 48
EXTEND_MAX_BYTES = 2 << 30  # the dense keys and values of one sequence; longer sequences keep the fused kernel
MASK_ELEMENTS = 1 << 28  # per SDPA call: query tokens go in blocks whose [G·tokens, T] mask stays within this
# The SDPA's dtype: float16 keeps 3 more bits of the dequantized values and the queries than bfloat16 (as
# the fused kernel's float16 dots do); keys, values and queries of a KV cache sit far inside its range.
COMPUTE_DTYPE = torch.float16


def gqa_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_pos: torch.Tensor,
                  scaling: float, window: int = 0) -> torch.Tensor:
    """query [B, Hq, n, D] at positions query_pos [B, n]; keys, values [B, Hkv, T, D] at positions 0..T-1
    -> [B, Hq, n, D]. A query sees the keys at or before its position (and, with `window` > 0, fewer than
    `window` before it). The G query heads of a KV head become G·n query rows of one head: plain
    multi-head SDPA, which reads each KV head once (its GQA mode would copy K and V G times when a mask is
    given). Queries go in blocks whose mask has at most MASK_ELEMENTS entries per sequence."""
    b, hq, n, d = query.shape
    hkv, end = keys.shape[1], keys.shape[2]
    g = hq // hkv
    key_pos = torch.arange(end, device=query.device)
    block = max(1, MASK_ELEMENTS // (g * max(end, 1)))
    outputs = []
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        pos = query_pos[:, lo:hi]
        visible = key_pos[None, None, :] <= pos[:, :, None]  # [B, m, T]
        if window > 0:
            visible &= pos[:, :, None] - key_pos[None, None, :] < window
        m = hi - lo
        q = query[:, :, lo:hi].reshape(b, hkv, g * m, d)
        mask = visible[:, None].expand(b, g, m, end).reshape(b, 1, g * m, end)
        outputs.append(F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
                       .reshape(b, hq, m, d))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def causal_gqa_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         scaling: float) -> torch.Tensor:
    """query [B, Hq, n, D] at the last n of the T positions of keys, values [B, Hkv, T, D] -> [B, Hq, n, D],
    each query seeing the keys at or before its position: `gqa_attention` without a window, for queries that
    end the sequence. A lower-right causal bias and SDPA's own GQA need no mask tensor and let the backend
    skip the masked blocks: on the H100 (float16, Qwen3 shapes) 8K + 128 new tokens took 71 µs against 238 µs
    with the mask, 32K + 2048 3.25 ms against 5.66 ms (scripts/probe_gqa_sdpa.py)."""
    causal = causal_lower_right(query.shape[2], keys.shape[2])
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=causal, scale=scaling, enable_gqa=True)


def stored_kv(layer: PagedLayer, block_table: torch.Tensor, slot: int, stored: int, history_end: int,
              new: tuple[torch.Tensor, torch.Tensor, int, int] | None = None,
              dtype: torch.dtype = COMPUTE_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [Hkv, stored + n, D] in `dtype` of positions 0..stored-1, read from their regions as
    `reference.stored_kv_reference` reads them (history: pages before min(stored, history_end); ring:
    history_end..stored-1), then the step's n new tokens: `new` = (k_rot, v, first row, n) with k_rot, v
    [T, Hkv, D] (the values rounded to the ring's dtype, as the ring stores them). One Triton launch
    (`triton_dequantize.launch_dense_kv`)."""
    from .triton_dequantize import launch_dense_kv  # Triton is optional: imported when used

    k_new, v_new, first, n = new if new is not None else (layer.ring_k, layer.ring_v, 0, 0)
    return launch_dense_kv(layer, block_table[slot], slot, stored, history_end, k_new, v_new, first, n, dtype)


def dense_bytes(layer: PagedLayer, tokens: int) -> int:
    """Bytes of one sequence's dense keys and values (what `extend_attention` allocates)."""
    lay = layer.layout
    return 2 * lay.kv_heads * tokens * lay.head_dim * COMPUTE_DTYPE.itemsize


def takes_dequantized_extend(layer: PagedLayer, batch: StepBatch, device: torch.device) -> bool:
    """Whether `attend_step(extend="auto")` dequantizes: on CUDA, for steps whose sequences the host knows
    (`StepBatch.host_rows`) with at least EXTEND_MIN_TOKENS new tokens, each sequence's dense keys and
    values within EXTEND_MAX_BYTES."""
    rows = batch.host_rows
    return (device.type == "cuda" and rows is not None and batch.max_new >= EXTEND_MIN_TOKENS
            and all(dense_bytes(layer, old + n) <= EXTEND_MAX_BYTES for _, old, n in rows))


def extend_attention(layer: PagedLayer, batch: StepBatch, q: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor,
                     scale: float, window: int = 0) -> torch.Tensor:
    """`ops.attend_step` of an extend step by dequantizing (see the module doc): q [T, Hq, D] rotated by R_K,
    k_rot, v [T, Hkv, D] -> [T, Hq, D] in q.dtype, each sequence in turn."""
    lay = layer.layout
    rows = batch.host_rows
    if rows is None:  # lengths kept on the device only: read them (a synchronisation)
        cu = batch.cu_new.tolist()
        rows = tuple((slot, old, cu[i + 1] - cu[i])
                     for i, (slot, old) in enumerate(zip(batch.slots.tolist(), batch.lengths.tolist())))
    outputs = []
    first = 0
    for slot, old, n in rows:
        if n == 0:
            continue
        fresh = slice(first, first + n)
        first += n
        keys, values = stored_kv(layer, batch.block_table, slot, old, lay.history_end(old + n),
                                 (k_rot, v, fresh.start, n))
        query = q[fresh].transpose(0, 1)[None].to(keys.dtype)
        if window > 0:
            o = gqa_attention(query, keys[None], values[None], old + torch.arange(n, device=q.device)[None], scale,
                              window)
        else:
            o = causal_gqa_attention(query, keys[None], values[None], scale)
        outputs.append((fresh, o[0].transpose(0, 1)))
    if len(outputs) == 1:  # one sequence with new tokens (a chunked prefill): its rows are all of q, no gather
        return outputs[0][1].to(q.dtype, memory_format=torch.contiguous_format)
    out = torch.empty_like(q)
    for fresh, o in outputs:
        out[fresh] = o
    return out
