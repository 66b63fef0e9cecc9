"""Torch references of the paged-cache kernels: what each Triton kernel must compute.

Both operate on a `PagedLayer` (see `oscarkv.cache.paged` for where each position lives)
and a `StepBatch` (which sequences, how many new tokens, how many already stored).

queries:    a step's queries times R_K, tokens-major, for the attention.
write:      rotate the new keys ((k - μ_K)·R_K, rounded to the window dtype), move the
            ring tokens that age into the history to their pages (the flush), then store
            every new token in its region: sink, ring, or straight into a page. With key
            shifts (key_centering="rope"), a history key is stored as its window key minus the
            shift of its page's block, rounded to the window dtype, and read plus the shift.
attention:  each new token's queries attend, causally, to everything stored before this
            step (sink and ring in the window dtype, history pages dequantized) and to the
            step's own new tokens at full precision (the rotated keys the write returns).

Loops over sequences in Python: these are for tests and CPU runs, not for speed.
"""

from __future__ import annotations

import torch

from ..cache.paged import PagedLayer, StepBatch
from ..calibration.rotations import rotate_heads
from ..quant.format import QuantizedTensor, dequantize, quantize


def rotate_queries_reference(query: torch.Tensor, rotation: torch.Tensor | None,
                             dtype: torch.dtype | None = None) -> torch.Tensor:
    """query [B, Hq, n, D] -> query·R_K (float32 products, rounded to `dtype`, None: query.dtype) as [B·n, Hq, D],
    the layout of the attention's queries; rotation None leaves the values as they are (cast to `dtype`)."""
    b, hq, n, d = query.shape
    rotated = query if rotation is None else rotate_heads(query.float(), rotation.float(), head_axis=1)
    return rotated.to(dtype or query.dtype).transpose(1, 2).reshape(b * n, hq, d).contiguous()


def decode_query_key_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                rotation: torch.Tensor | None, q_norm: tuple[torch.Tensor, float] | None = None,
                                k_norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's q [B, Hq, D] and k [B, Hkv, D] from the projections, with cos/sin [B, D]: each through
    its RMSNorm (weight, eps) if given, as the modules compute it, then RoPE (rotate_half), in the input
    dtype. Returns (q·R_K as `rotate_queries_reference` gives it, [B, Hq, D]; k [B, Hkv, D])."""
    def norm(x: torch.Tensor, spec: tuple[torch.Tensor, float] | None) -> torch.Tensor:
        if spec is None:
            return x
        weight, eps = spec
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def rope(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None] + rotated_half * sin[:, None]

    query = rotate_queries_reference(rope(norm(q, q_norm))[:, :, None], rotation)
    return query, rope(norm(k, k_norm))


def rotate_keys_reference(k: torch.Tensor, rotation: torch.Tensor | None, mean: torch.Tensor | None,
                          dtype: torch.dtype) -> torch.Tensor:
    """k: [T, Hkv, D] -> (k - mean[h])·R in float32, rounded to `dtype` (R: [D, D], or [Hkv, D, D],
    R[h] for KV head h)."""
    x = k.float()
    if mean is not None:
        x = x - mean.float()[None]
    if rotation is not None:
        x = rotate_heads(x, rotation.float(), head_axis=1)
    return x.to(dtype)


def _store_history(layer: PagedLayer, slot: int, block_table: torch.Tensor, positions: torch.Tensor,
                   keys: torch.Tensor, values: torch.Tensor, clip_k: float, clip_v: float) -> None:
    """keys/values: [n, Hkv, D] for `positions` (all in the history region of `slot`)."""
    lay = layer.layout
    index = positions - lay.sink_tokens
    pages = block_table[slot, index // lay.page_size].long()
    rows = index % lay.page_size
    if layer.key_shifts is not None:  # rounded back to the window dtype, as the kernel quantizes it
        shift = layer.key_shifts[layer.shift_index(positions)]
        keys = (keys.float() - shift).to(layer.ring_k.dtype)
    for stream, bits, inner, clip, codes, scale, zero in (
        (keys, lay.key_bits, lay.key_inner, clip_k, layer.k_codes, layer.k_scale, layer.k_zero),
        (values, lay.value_bits, lay.value_inner, clip_v, layer.v_codes, layer.v_scale, layer.v_zero),
    ):
        q = quantize(stream.float(), bits, lay.group_size, clip, torch.float16, inner)
        codes[pages, :, rows] = q.packed
        scale[pages, :, rows] = q.scale
        zero[pages, :, rows] = q.zero


def write_reference(layer: PagedLayer, batch: StepBatch, k: torch.Tensor, v: torch.Tensor,
                    rotation: torch.Tensor | None, mean: torch.Tensor | None, clip_k: float,
                    clip_v: float) -> torch.Tensor:
    """k, v: [T, Hkv, D] new tokens after RoPE. Returns the rotated keys [T, Hkv, D] (window dtype)."""
    lay = layer.layout
    s, cap = lay.sink_tokens, lay.ring_capacity
    window = layer.ring_k.dtype
    k_rot = rotate_keys_reference(k, rotation, mean, window)
    v = v.to(window)
    cu = batch.cu_new.tolist()
    for b, (slot, old) in enumerate(zip(batch.slots.tolist(), batch.lengths.tolist())):
        new = old + cu[b + 1] - cu[b]
        end_old, end_new = lay.history_end(old), lay.history_end(new)
        aged = torch.arange(end_old, max(end_old, min(old, end_new)), device=k.device)
        if aged.numel():
            ring = (aged - s) % cap
            _store_history(layer, slot, batch.block_table, aged, layer.ring_k[slot, :, ring].transpose(0, 1),
                           layer.ring_v[slot, :, ring].transpose(0, 1), clip_k, clip_v)
        pos = torch.arange(old, new, device=k.device)
        kb, vb = k_rot[cu[b]:cu[b + 1]], v[cu[b]:cu[b + 1]]
        sink, hist, ring = pos < s, (pos >= s) & (pos < end_new), pos >= end_new
        layer.sink_k[slot, :, pos[sink]] = kb[sink].transpose(0, 1)
        layer.sink_v[slot, :, pos[sink]] = vb[sink].transpose(0, 1)
        if hist.any():
            _store_history(layer, slot, batch.block_table, pos[hist], kb[hist], vb[hist], clip_k, clip_v)
        rows = (pos[ring] - s) % cap
        layer.ring_k[slot, :, rows] = kb[ring].transpose(0, 1)
        layer.ring_v[slot, :, rows] = vb[ring].transpose(0, 1)
    return k_rot


def stored_kv_reference(layer: PagedLayer, block_table: torch.Tensor, slot: int, stored: int,
                        history_end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [Hkv, stored, D] float32 of positions 0..stored-1, read from their regions."""
    lay = layer.layout
    s = lay.sink_tokens
    parts_k = [layer.sink_k[slot, :, :min(stored, s)].float()]
    parts_v = [layer.sink_v[slot, :, :min(stored, s)].float()]
    hist = torch.arange(s, max(s, min(stored, history_end)), device=layer.k_codes.device)
    if hist.numel():
        pages = block_table[slot, (hist - s) // lay.page_size].long()
        rows = (hist - s) % lay.page_size
        for parts, bits, inner, codes, scale, zero in (
                (parts_k, lay.key_bits, lay.key_inner, layer.k_codes, layer.k_scale, layer.k_zero),
                (parts_v, lay.value_bits, lay.value_inner, layer.v_codes, layer.v_scale, layer.v_zero)):
            q = QuantizedTensor(codes[pages, :, rows], scale[pages, :, rows], zero[pages, :, rows],
                                lay.group_size, torch.float32, bits, inner)
            x = dequantize(q)
            if layer.key_shifts is not None and parts is parts_k:
                x = x + layer.key_shifts[layer.shift_index(hist)]
            parts.append(x.transpose(0, 1))
    ring = torch.arange(history_end, max(history_end, stored), device=layer.k_codes.device)
    if ring.numel():
        rows = (ring - s) % lay.ring_capacity
        parts_k.append(layer.ring_k[slot, :, rows].float())
        parts_v.append(layer.ring_v[slot, :, rows].float())
    return torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1)


def attention_reference(layer: PagedLayer, batch: StepBatch, q: torch.Tensor, k_rot: torch.Tensor,
                        v: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """q: [T, Hq, D] rotated queries of the new tokens; k_rot, v: [T, Hkv, D] their keys/values.

    Returns [T, Hq, D] float32. A query sees key position j iff j <= its position and, when
    window > 0, position - j < window.
    """
    lay = layer.layout
    hq, hkv = q.shape[1], lay.kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cu = batch.cu_new.tolist()
    for b, (slot, old) in enumerate(zip(batch.slots.tolist(), batch.lengths.tolist())):
        n = cu[b + 1] - cu[b]
        if n == 0:
            continue
        end_new = lay.history_end(old + n)
        keys, values = stored_kv_reference(layer, batch.block_table, slot, old, end_new)
        fresh = slice(cu[b], cu[b + 1])
        keys = torch.cat([keys, k_rot[fresh].transpose(0, 1).float()], dim=1)  # [Hkv, old + n, D]
        values = torch.cat([values, v[fresh].to(layer.ring_v.dtype).transpose(0, 1).float()], dim=1)
        key_pos = torch.arange(old + n, device=q.device)
        query_pos = old + torch.arange(n, device=q.device)
        visible = key_pos[None, :] <= query_pos[:, None]
        if window > 0:
            visible &= query_pos[:, None] - key_pos[None, :] < window
        queries = q[fresh].float().transpose(0, 1).reshape(hkv, hq // hkv, n, -1)
        scores = torch.einsum("hgnd,hed->hgne", queries, keys) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("hgne,hed->hgnd", probs, values)
        out[fresh] = o.reshape(hq, n, -1).transpose(0, 1)
    return out


def dense_decode_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                           lengths: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """Decode attention over a dense cache (the BF16 baseline): what `_dense_decode_kernel` computes.

    q: [B, Hq, D], one query token per sequence; keys, values: [slots, Hkv, max_context, D];
    sequence b sees positions [max(0, lengths[b] - window) if window else 0, lengths[b]) of
    slot slots[b] (its own token included). Returns [B, Hq, D] float32.
    """
    b_count, hq, d = q.shape
    hkv = keys.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, (slot, length) in enumerate(zip(slots.tolist(), lengths.tolist())):
        lo = max(0, length - window) if window > 0 else 0
        k = keys[slot, :, lo:length].float()  # [Hkv, n, D]
        v = values[slot, :, lo:length].float()
        queries = q[b].float().reshape(hkv, hq // hkv, d)
        probs = torch.softmax(torch.einsum("hgd,hnd->hgn", queries, k) * scale, dim=-1)
        out[b] = torch.einsum("hgn,hnd->hgd", probs, v).reshape(hq, d)
    return out
