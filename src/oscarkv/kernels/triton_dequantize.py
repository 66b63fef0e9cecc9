"""Triton kernel: one sequence's INT2/INT4 history pages dequantized into a dense [Hkv, T, D] buffer.

An extend step (a chunk of new tokens over a stored sequence: a chunked prefill, a prompt that
continues a conversation) reads every history page once per query block in the fused attention
kernel, which decodes the codes again for every block. `ops.attend_step` instead dequantizes the
history once per step into float16 and runs one SDPA over sink + history + ring + the step's tokens
(`extend.extend_attention`). This kernel does the dequantization: one program per
(history page, KV head), value = (level(c) - zero)·scale per group, plus the key shift of the page's
block for keys with key_centering="rope", rounded once to the buffer's dtype. Reference:
`reference.stored_kv_reference`, which computes the same values in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.format import inner_levels


@triton.jit
def _dequantize_pages_kernel(codes_ptr, scale_ptr, zero_ptr, bt_ptr, shift_ptr, out_ptr, limit, tokens, num_blocks,
                             level1, level2, shift_block,
                             HKV: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, BITS: tl.constexpr,
                             P: tl.constexpr, S: tl.constexpr, LLOYD: tl.constexpr, KEY_SHIFTS: tl.constexpr):
    """Program (i, h): history page i of the sequence (block-table entry i) and KV head h, written to
    out[h, S + i·P + r, :] for the rows r whose position is below `limit`. Byte j of a row holds, in bit
    plane k, the code of channel k·NB + j (NB = D·BITS/8, `quant.format.pack_codes`)."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    NB: tl.constexpr = D * BITS // 8
    G: tl.constexpr = D // NG
    page = tl.load(bt_ptr + i).to(tl.int64)
    row0 = (page * HKV + h) * P
    rows = tl.arange(0, P)
    cols = tl.arange(0, NB)
    packed = tl.load(codes_ptr + (row0 + rows)[:, None] * NB + cols[None, :])
    pos = S + i * P + rows
    keep = (pos < limit)[:, None]
    dst = out_ptr + (h.to(tl.int64) * tokens + pos)[:, None] * D
    if KEY_SHIFTS:
        block = tl.minimum((S + i * P) // shift_block, num_blocks - 1)
        shift_row = shift_ptr + (block.to(tl.int64) * HKV + h) * D
    for k in tl.static_range(8 // BITS):
        c = (packed >> (k * BITS)) & ((1 << BITS) - 1)
        if LLOYD:  # Lloyd-Max levels of INT2 codes: 0, 3a, 3 - 3a, 3
            level = tl.where(c == 1, level1, tl.where(c == 2, level2, c.to(tl.float32)))
        else:
            level = c.to(tl.float32)
        channel = k * NB + cols
        at = (row0 + rows)[:, None] * NG + (channel // G)[None, :]
        x = (level - tl.load(zero_ptr + at).to(tl.float32)) * tl.load(scale_ptr + at).to(tl.float32)
        if KEY_SHIFTS:
            x += tl.load(shift_row + channel)[None, :]
        tl.store(dst + channel[None, :], x.to(out_ptr.dtype.element_ty), mask=keep)


def launch_dequantize_pages(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, pages: torch.Tensor,
                            out: torch.Tensor, limit: int, layout, inner: float | None = None,
                            key_shifts: torch.Tensor | None = None, shift_block: int = 0) -> None:
    """Dequantize the history pages `pages` (int32 block-table entries, in position order) of one stream
    (keys or values) into out [Hkv, T, D] at positions sink_tokens + i·page_size + r, those below `limit`."""
    bits = codes.shape[-1] * 8 // layout.head_dim
    if pages.numel() == 0:
        return
    level1, level2 = inner_levels(inner)[1:3].tolist()
    shifts = key_shifts if key_shifts is not None else out
    _dequantize_pages_kernel[(pages.numel(), layout.kv_heads)](
        codes, scale, zero, pages, shifts, out, limit, out.shape[1],
        key_shifts.shape[0] if key_shifts is not None else 1, level1, level2, max(shift_block, 1),
        HKV=layout.kv_heads, D=layout.head_dim, NG=layout.groups, BITS=bits, P=layout.page_size,
        S=layout.sink_tokens, LLOYD=inner is not None, KEY_SHIFTS=key_shifts is not None, num_warps=4)
