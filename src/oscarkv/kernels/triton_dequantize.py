"""Triton kernel: one sequence's keys and values as dense [Hkv, T, D] float16 buffers, for an extend step.

An extend step (a chunk of new tokens over a stored sequence: a chunked prefill, a prompt that
continues a conversation) reads every history page once per query block in the fused attention
kernel, which decodes the codes again for every block. `ops.attend_step` instead builds the sequence's
keys and values once per step and runs one SDPA over them (`extend.extend_attention`). This kernel
builds them in one launch: one program per (block of 64 positions, KV head, stream), each position read
from its region: the sink, the INT2/INT4 history pages (value = (level(c) - zero)·scale per group, plus the
key shift of the page's block for keys with key_centering="rope"), the ring, or the step's own tokens;
rounded once to float16. Reference: `reference.stored_kv_reference`, which computes the stored values in
float32.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..quant.format import inner_levels
from .triton_write import _round_to


@triton.jit
def _fill_stream(codes_ptr, scale_ptr, zero_ptr, shift_ptr, sink_ptr, ring_ptr, new_ptr, out_ptr, bt_ptr,
                 slot, h, pos, stored, limit, history_end, new_start, tokens, num_blocks, level1, level2, shift_block,
                 HKV: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, BITS: tl.constexpr, P: tl.constexpr,
                 S: tl.constexpr, C: tl.constexpr, LLOYD: tl.constexpr, KEY_SHIFTS: tl.constexpr,
                 RING_DTYPE: tl.constexpr, ROUND_NEW: tl.constexpr):
    """Positions `pos` of KV head h of one stream (keys or values) into out [Hkv, tokens, D], each from its
    region:
    - sink: pos < min(stored, S);
    - history pages: S <= pos < limit, value = (level(c) - zero)·scale per group, plus the key shift of the
      page's block;
    - ring: history_end <= pos < stored;
    - the step's own tokens: from stored on, rows new_start + pos - stored of new_ptr [T, Hkv, D]
      (ROUND_NEW: rounded to the ring's dtype first, as the ring stores them).
    Byte j of a history row holds, in bit plane k, the code of channel k·NB + j (`quant.format.pack_codes`);
    the index arithmetic of the other regions is masked where the position is not theirs."""
    NB: tl.constexpr = D * BITS // 8
    G: tl.constexpr = D // NG
    cols = tl.arange(0, NB)
    in_sink = pos < tl.minimum(stored, S)
    in_hist = (pos >= S) & (pos < limit)
    in_ring = (pos >= history_end) & (pos < stored)
    in_new = (pos >= stored) & (pos < tokens)
    index = tl.maximum(pos - S, 0)
    page = tl.load(bt_ptr + index // P, mask=in_hist, other=0).to(tl.int64)
    hist_row = (page * HKV + h) * P + index % P
    packed = tl.load(codes_ptr + hist_row[:, None] * NB + cols[None, :], mask=in_hist[:, None], other=0)
    head_row = (slot * HKV + h).to(tl.int64)
    sink_row = head_row * S + pos
    ring_row = head_row * C + (pos - S) % C
    new_row = (new_start + pos - stored).to(tl.int64) * HKV + h
    dst = out_ptr + (h.to(tl.int64) * tokens + pos)[:, None] * D
    if KEY_SHIFTS:
        block = tl.minimum((S + (index // P) * P) // shift_block, num_blocks - 1)
        shift_row = shift_ptr + (block.to(tl.int64) * HKV + h) * D
    for k in tl.static_range(8 // BITS):
        c = (packed >> (k * BITS)) & ((1 << BITS) - 1)
        if LLOYD:
            level = tl.where(c == 1, level1, tl.where(c == 2, level2, c.to(tl.float32)))
        else:
            level = c.to(tl.float32)
        channel = k * NB + cols
        at = hist_row[:, None] * NG + (channel // G)[None, :]
        m = in_hist[:, None]
        x = (level - tl.load(zero_ptr + at, mask=m, other=0.0).to(tl.float32)) * \
            tl.load(scale_ptr + at, mask=m, other=0.0).to(tl.float32)
        if KEY_SHIFTS:
            x += tl.load(shift_row[:, None] + channel[None, :], mask=m, other=0.0)
        sink = tl.load(sink_ptr + sink_row[:, None] * D + channel[None, :], mask=in_sink[:, None], other=0.0)
        ring = tl.load(ring_ptr + ring_row[:, None] * D + channel[None, :], mask=in_ring[:, None], other=0.0)
        new = tl.load(new_ptr + new_row[:, None] * D + channel[None, :], mask=in_new[:, None], other=0.0)
        new = new.to(tl.float32)
        if ROUND_NEW:
            new = _round_to(new, RING_DTYPE)
        x = tl.where(m, x, tl.where(in_sink[:, None], sink.to(tl.float32),
                                    tl.where(in_ring[:, None], ring.to(tl.float32), new)))
        tl.store(dst + channel[None, :], x.to(out_ptr.dtype.element_ty), mask=(pos < tokens)[:, None])


# Integer arguments that change from step to step. Triton would otherwise compile a variant of the kernel for
# each combination of "equals 1" and "multiple of 16" among them (up to 3^6), in the middle of serving: on the
# H100, 24 extend steps of different lengths compiled 4 variants (6.6 s) specialised, 1 (1.5 s) without.
PER_STEP_INTS = ("slot", "stored", "limit", "history_end", "new_start", "tokens")


@triton.jit(do_not_specialize=PER_STEP_INTS)
def _dense_kv_kernel(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, shift_ptr, sink_k_ptr, sink_v_ptr, ring_k_ptr,
                     ring_v_ptr, k_new_ptr, v_new_ptr, keys_ptr, values_ptr, bt_ptr,
                     slot, stored, limit, history_end, new_start, tokens, num_blocks, k_level1, k_level2, v_level1,
                     v_level2, shift_block,
                     HKV: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                     P: tl.constexpr, S: tl.constexpr, C: tl.constexpr, K_LLOYD: tl.constexpr,
                     V_LLOYD: tl.constexpr, KEY_SHIFTS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (b, h, stream): positions b·BLOCK .. b·BLOCK + BLOCK - 1 of KV head h, keys (stream 0) or values
    (stream 1), of one sequence's dense [Hkv, tokens, D] float16 keys and values (`_fill_stream`)."""
    pos = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = tl.program_id(1)
    ring_dtype = ring_v_ptr.dtype.element_ty
    if tl.program_id(2) == 0:
        _fill_stream(kc_ptr, ks_ptr, kz_ptr, shift_ptr, sink_k_ptr, ring_k_ptr, k_new_ptr, keys_ptr, bt_ptr, slot, h,
                     pos, stored, limit, history_end, new_start, tokens, num_blocks, k_level1, k_level2, shift_block,
                     HKV, D, NG, K_BITS, P, S, C, K_LLOYD, KEY_SHIFTS, ring_dtype, False)
    else:
        _fill_stream(vc_ptr, vs_ptr, vz_ptr, shift_ptr, sink_v_ptr, ring_v_ptr, v_new_ptr, values_ptr, bt_ptr, slot,
                     h, pos, stored, limit, history_end, new_start, tokens, num_blocks, v_level1, v_level2,
                     shift_block, HKV, D, NG, V_BITS, P, S, C, V_LLOYD, False, ring_dtype, True)


def launch_dense_kv(layer, block_table_row: torch.Tensor, slot: int, stored: int, history_end: int,
                    k_new: torch.Tensor, v_new: torch.Tensor, new_start: int, count: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values [Hkv, stored + count, D] in `dtype`, in one launch: sink, history pages
    (those before min(stored, history_end)), ring (history_end..stored-1), then `count` new tokens from rows
    new_start.. of k_new and v_new [T, Hkv, D] (values rounded to the ring's dtype first)."""
    lay = layer.layout
    tokens = stored + count
    keys = torch.empty(lay.kv_heads, tokens, lay.head_dim, dtype=dtype, device=layer.ring_k.device)
    values = torch.empty_like(keys)
    if tokens == 0:
        return keys, values
    shifts = layer.key_shifts
    block = 64
    _dense_kv_kernel[(triton.cdiv(tokens, block), lay.kv_heads, 2)](
        layer.k_codes, layer.k_scale, layer.k_zero, layer.v_codes, layer.v_scale, layer.v_zero,
        shifts if shifts is not None else keys, layer.sink_k, layer.sink_v, layer.ring_k, layer.ring_v,
        k_new, v_new, keys, values, block_table_row,
        slot, stored, min(stored, history_end), history_end, new_start, tokens,
        shifts.shape[0] if shifts is not None else 1, *_levels(lay.key_inner), *_levels(lay.value_inner),
        max(layer.shift_block, 1),
        HKV=lay.kv_heads, D=lay.head_dim, NG=lay.groups, K_BITS=lay.key_bits, V_BITS=lay.value_bits,
        P=lay.page_size, S=lay.sink_tokens, C=lay.ring_capacity, K_LLOYD=lay.key_inner is not None,
        V_LLOYD=lay.value_inner is not None, KEY_SHIFTS=shifts is not None, BLOCK=block, num_warps=4)
    return keys, values


@functools.lru_cache(maxsize=64)
def _levels(inner: float | None) -> tuple[float, float]:
    """Levels of INT2 codes 1 and 2 in code units (`quant.format.inner_levels`), as plain floats."""
    return tuple(inner_levels(inner)[1:3].tolist())
