"""The read path, torch reference (SPEC §4): attention over sink + INT2 history + recent.

Decode semantics define everything. A query at slot t of row b (left padding pad_b, so
position p = t - pad_b) sees key slot j when

    pad_b <= j <= t   and, on sliding-window layers,   t - j < window,

and reads key j from the INT2 history exactly when

    j - pad_b >= sink_tokens   and   j < t + 1 - recent_tokens,

i.e. when j would have left the recent window by the time token t is decoded. With KIVI's
per-channel keys (`key_grouping="channel"`) tokens leave in whole groups of G: j is read
quantized when the last token of its group (counted from the sink's end) satisfies the
condition above. A prefill
or chunked prefill over many queries therefore gives, query by query, the same result as
decoding the tokens one at a time.

Each key slot enters the softmax as at most two entries, a full-precision one ("hi") and a
quantized one ("lo"); a mask enables exactly one of them per visible (query, key) pair.
For a decode step the duplicates are at most one token, so the extra work is nil.
"""

from __future__ import annotations

import torch

from .cache.mixed import OscarLayer

QUERY_BLOCK = 256  # queries per block in the reference, to bound the score matrix


def _entries(layer: OscarLayer, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                             list[torch.Tensor], list[bool]]:
    """Keys, values, slots and kinds (True = lo) of every entry the queries may read, in `dtype`."""
    keys, values, slots, kinds = [], [], [], []
    device = layer.sink_k.device

    def add(k: torch.Tensor, v: torch.Tensor, first_slot: int, lo: bool) -> None:
        if k.shape[2]:
            keys.append(k.to(dtype))
            values.append(v.to(dtype))
            slots.append(torch.arange(first_slot, first_slot + k.shape[2], device=device))
            kinds.append(lo)

    sink = layer.sink_k.shape[2]
    add(layer.sink_k, layer.sink_v, 0, False)
    # Rows with less left padding than the widest one have their sink end before `sink`:
    # their remaining sink-storage slots are history tokens, read quantized.
    lo_start = int(layer.pad.min().item()) + layer.sink_tokens if layer.pad.numel() else layer.sink_tokens
    if lo_start < sink:
        add(layer.roundtrip_keys(layer.sink_k[:, :, lo_start:], lo_start),
            layer.history_v.roundtrip(layer.sink_v[:, :, lo_start:]), lo_start, True)
    if layer.history_k.length:
        add(layer.history_keys(dtype), layer.history_v.read(dtype), layer.history_start, True)
    tail = layer.tail_k.shape[2]
    aged = max(0, tail - layer.config.recent_tokens)  # tail tokens that some query reads quantized
    aged -= aged % layer.token_multiple  # (whole KIVI key groups: the tail starts on a group edge)
    if aged:
        add(layer.roundtrip_keys(layer.tail_k[:, :, :aged], layer.tail_start),
            layer.history_v.roundtrip(layer.tail_v[:, :, :aged]), layer.tail_start, True)
    add(layer.tail_k, layer.tail_v, layer.tail_start, False)
    return keys, values, slots, kinds


def precision_masks(layer: OscarLayer, query_slots: torch.Tensor, slots: torch.Tensor, lo: torch.Tensor,
                    sliding_window: int | None) -> torch.Tensor:
    """Allowed[b, t, e] (bool): entry e is read by query slot query_slots[t] of row b."""
    pad = layer.pad[:, None, None]  # [B, 1, 1]
    t = query_slots[None, :, None]
    j = slots[None, None, :]
    visible = (j <= t) & (j >= pad)
    if sliding_window:
        visible &= t - j < sliding_window
    first = j - pad - layer.sink_tokens  # position within the history region
    group = layer.token_multiple  # keys enter the history a group at a time: the group's end decides
    quantized = (first >= 0) & (first.div(group, rounding_mode="floor") * group + group <=
                                t + 1 - layer.config.recent_tokens - pad - layer.sink_tokens)
    return visible & (quantized == lo[None, None, :])


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scaling: float,
            softcap: float | None) -> torch.Tensor:
    """q: [B, Hkv, g, C, D]; k, v: [B, Hkv, E, D]; allowed: [B, C, E] -> [B, Hkv, g, C, D]."""
    b, hkv, g, c, d = q.shape
    if softcap:
        scores = torch.einsum("bhgcd,bhed->bhgce", q, k) * scaling
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
        probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
        return torch.einsum("bhgce,bhed->bhgcd", probs, v)
    mask = allowed[:, None, None].expand(b, 1, g, c, allowed.shape[-1]).reshape(b, 1, g * c, allowed.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(q.reshape(b, hkv, g * c, d), k, v, attn_mask=mask,
                                                           scale=scaling)
    # A query with nothing visible (a padding slot) gets zeros instead of NaN.
    return torch.nan_to_num(out, nan=0.0).reshape(b, hkv, g, c, d)


def oscar_attention_reference(layer: OscarLayer, query: torch.Tensor, scaling: float,
                              sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """query: [B, Hq, C, D] (already rotated by R_K), the C newest slots of `layer`.

    Returns the attention output [B, C, Hq, D] in query.dtype (values in the rotated basis).
    """
    b, hq, c, d = query.shape
    # float32 accumulation; float64 only when the model itself runs in float64 (exactness tests).
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    keys, values, slots, kinds = _entries(layer, acc)
    k = torch.cat(keys, dim=2)  # [B, Hkv, E, D]
    v = torch.cat(values, dim=2)
    slot = torch.cat(slots)
    lo = torch.cat([torch.full((s.numel(),), kind, device=slot.device) for s, kind in zip(slots, kinds)])
    hkv = k.shape[1]
    group = hq // hkv
    q = query.to(acc).reshape(b, hkv, group, c, d)
    first_query = layer.length - c
    sink_end = layer.sink_k.shape[2]
    out = torch.empty(b, hkv, group, c, d, dtype=acc, device=query.device)
    for start in range(0, c, QUERY_BLOCK):
        stop = min(c, start + QUERY_BLOCK)
        t_first, t_last = first_query + start, first_query + stop - 1
        # Entries no query of this block can read: beyond causality, quantized copies
        # of keys still in every query's window, full copies of keys out of every window.
        recent = layer.config.recent_tokens
        late = layer.token_multiple - 1  # a key of an incomplete KIVI group stays in full precision longer
        needed = (slot <= t_last) & (~lo | (slot < t_last + 1 - recent)) & (lo | (slot < sink_end)
                                                                              | (slot >= t_first + 1 - recent - late))
        index = needed.nonzero().squeeze(1)
        query_slots = torch.arange(t_first, t_last + 1, device=query.device)
        allowed = precision_masks(layer, query_slots, slot[index], lo[index], sliding_window)  # [B, Cb, E']
        out[:, :, :, start:stop] = _attend(q[:, :, :, start:stop], k[:, :, index], v[:, :, index], allowed, scaling,
                                           softcap)
    return out.reshape(b, hq, c, d).transpose(1, 2).to(query.dtype)
