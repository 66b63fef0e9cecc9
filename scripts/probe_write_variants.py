"""Experiment: the write kernel's prompt path with its rotation, clip and division chosen apart.

A copy of `triton_write._write_kernel`'s prompt path (group = D only) whose parts can be switched:
ROT 0 none, 1 tf32x3 dots of (k - μ_K), 2 bfloat16 pieces as four quarter dots, 3 bfloat16 pieces
as one full-width dot (what ships for bfloat16 keys); CLIP 0 none, 1 each side counted apart,
2 packed (what ships); DIV 1 a division per code, 0 x·(1/s) (what ships). Timed on the 32K-token
prompt of probe_write_kernel.py; the "differs" columns compare each variant's output with the
kernel's float32-rotation path (ROTATE=1). docs/kernels-log.md quotes the timings
(data/probe-write-variants-h100.txt).

    PYTHONPATH=src python scripts/probe_write_variants.py [main|wide]
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from oscarkv.benchmarks.attention import _layout, copy_bandwidth_gbs
from oscarkv.cache.paged import PagedKVCache
from oscarkv.kernels import triton_write as tw

import os
TOKENS, KV_HEADS, HEAD_DIM = int(os.environ.get("PROBE_TOKENS", 32768)), 8, 128


@triton.jit
def _packed_thresholds(k0, k1, k2, k3, v0, v1, v2, v3, RANK_K: tl.constexpr, RANK_V: tl.constexpr,
                       n: tl.constexpr):
    """Both bisections in one: key patterns in the high 16 bits, value patterns in the low 16."""
    p0 = (tw._abs_bits(k0, 16) << 16) | tw._abs_bits(v0, 16)
    p1 = (tw._abs_bits(k1, 16) << 16) | tw._abs_bits(v1, 16)
    p2 = (tw._abs_bits(k2, 16) << 16) | tw._abs_bits(v2, 16)
    p3 = (tw._abs_bits(k3, 16) << 16) | tw._abs_bits(v3, 16)
    p0 = p0.to(tl.uint32, bitcast=True)
    p1 = p1.to(tl.uint32, bitcast=True)
    p2 = p2.to(tl.uint32, bitcast=True)
    p3 = p3.to(tl.uint32, bitcast=True)
    k_lo = tl.zeros([n], tl.int32)
    k_hi = tl.full([n], 0x7F80, tl.int32)
    v_lo = tl.zeros([n], tl.int32)
    v_hi = tl.full([n], 0x7F80, tl.int32)
    for _ in range(15):
        k_mid = k_lo + (k_hi - k_lo) // 2
        v_mid = v_lo + (v_hi - v_lo) // 2
        m = (((k_mid | 0x8000) << 16) | (v_mid | 0x8000)).to(tl.uint32, bitcast=True)[:, None]
        f = (((m - p0) >> 15) & 0x10001) + (((m - p1) >> 15) & 0x10001)
        f += (((m - p2) >> 15) & 0x10001) + (((m - p3) >> 15) & 0x10001)
        count = tl.sum(f, 1).to(tl.int32, bitcast=True)
        k_enough = (count >> 16) > RANK_K
        v_enough = (count & 0xFFFF) > RANK_V
        k_lo, k_hi = tl.where(k_enough, k_lo, k_mid + 1), tl.where(k_enough, k_mid, k_hi)
        v_lo, v_hi = tl.where(v_enough, v_lo, v_mid + 1), tl.where(v_enough, v_mid, v_hi)
    return (k_lo << 16).to(tl.float32, bitcast=True), (v_lo << 16).to(tl.float32, bitcast=True)


@triton.jit
def _codes_div(x, scale, zero, LEVELS: tl.constexpr):
    """The variant: a division per code, floor(x/s + z + 0.5), clamped (what shipped before x·(1/s))."""
    c = tl.floor(tl.math.div_rn(x, scale[:, None]) + zero[:, None] + 0.5)
    return tl.minimum(tl.maximum(c, 0.0), LEVELS * 1.0).to(tl.int32)


@triton.jit
def _quantize_store(x0, x1, x2, x3, valid, page, row, h, codes_ptr, scale_ptr, zero_ptr,
                    HKV: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, DIV: tl.constexpr):
    """NG == 1 only (group = D)."""
    W: tl.constexpr = D // 4
    LEVELS: tl.constexpr = (1 << BITS) - 1
    cols = tl.arange(0, W)
    lo = tl.minimum(tl.minimum(tl.min(x0, 1), tl.min(x1, 1)), tl.minimum(tl.min(x2, 1), tl.min(x3, 1)))
    hi = tl.maximum(tl.maximum(tl.max(x0, 1), tl.max(x1, 1)), tl.maximum(tl.max(x2, 1), tl.max(x3, 1)))
    s, z = tw._scale_zero(lo, hi, LEVELS)
    if DIV:
        c0 = _codes_div(x0, s, z, LEVELS)
        c1 = _codes_div(x1, s, z, LEVELS)
        c2 = _codes_div(x2, s, z, LEVELS)
        c3 = _codes_div(x3, s, z, LEVELS)
    else:
        c0 = tw._codes(x0, s, z, LEVELS, False)  # x·(1/s), as the kernel (its portable form: the same codes)
        c1 = tw._codes(x1, s, z, LEVELS, False)
        c2 = tw._codes(x2, s, z, LEVELS, False)
        c3 = tw._codes(x3, s, z, LEVELS, False)
    base = (page.to(tl.int64) * HKV + h) * P + row
    packed = c0 | (c1 << 2) | (c2 << 4) | (c3 << 6)
    tl.store(codes_ptr + base[:, None] * (D * BITS // 8) + cols[None, :], packed.to(tl.uint8), mask=valid[:, None])
    tl.store(scale_ptr + base, s.to(tl.float16), mask=valid)
    tl.store(zero_ptr + base, z.to(tl.float16), mask=valid)


@triton.jit
def _variant_kernel(k_ptr, v_ptr, k_rot_ptr, rot_ptr, pieces_ptr, mean_ptr, mean_rot_ptr,
                    slots_ptr, cu_ptr, len_ptr, bt_ptr, bt_stride, num_pages,
                    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                    sink_k_ptr, sink_v_ptr, ring_k_ptr, ring_v_ptr,
                    HKV: tl.constexpr, D: tl.constexpr, P: tl.constexpr, S: tl.constexpr, R: tl.constexpr,
                    CLIP_K: tl.constexpr, CLIP_V: tl.constexpr, BLOCK_T: tl.constexpr,
                    ROT: tl.constexpr, CLIP: tl.constexpr, DIV: tl.constexpr, NPIECES: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """ROT: 0 none, 1 tf32x3 of (k - mu), 2 bf16 pieces of R: k·R - mu·R. CLIP: 0 none, 1 shipped, 2 packed."""
    b = tl.program_id(0)
    block = tl.program_id(1)
    h = tl.program_id(2)
    W: tl.constexpr = D // 4
    C: tl.constexpr = R + P
    slot, old, start, count = tw._sequence(b, slots_ptr, cu_ptr, len_ptr)
    if block * BLOCK_T >= count:
        return
    t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = t < count
    pos = old + t
    end_new = tw._history_end(old + count, S, R, P)
    row_in = (start + t).to(tl.int64) * HKV + h
    cols = tl.arange(0, D)
    if ROT == 1:
        x = tl.load(k_ptr + row_in[:, None] * D + cols[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        x = x - tl.load(mean_ptr + h * D + cols)[None, :]
        r_rows = rot_ptr + cols[:, None] * D + tl.arange(0, W)[None, :]
        k0 = tl.dot(x, tl.load(r_rows), input_precision="tf32x3")
        k1 = tl.dot(x, tl.load(r_rows + W), input_precision="tf32x3")
        k2 = tl.dot(x, tl.load(r_rows + 2 * W), input_precision="tf32x3")
        k3 = tl.dot(x, tl.load(r_rows + 3 * W), input_precision="tf32x3")
    elif ROT == 2:
        x = tl.load(k_ptr + row_in[:, None] * D + cols[None, :], mask=valid[:, None], other=0.0)
        if INTERPRET:  # the interpreter's bfloat16 dot is wrong; the pieces are exact in float32
            x = x.to(tl.float32)
        mr = mean_rot_ptr + h * D + tl.arange(0, W)
        k0 = -tl.load(mr)[None, :] + tl.zeros([BLOCK_T, W], tl.float32)
        k1 = -tl.load(mr + W)[None, :] + tl.zeros([BLOCK_T, W], tl.float32)
        k2 = -tl.load(mr + 2 * W)[None, :] + tl.zeros([BLOCK_T, W], tl.float32)
        k3 = -tl.load(mr + 3 * W)[None, :] + tl.zeros([BLOCK_T, W], tl.float32)
        for i in tl.static_range(NPIECES):  # smallest piece first
            r_rows = pieces_ptr + (NPIECES - 1 - i) * D * D + cols[:, None] * D + tl.arange(0, W)[None, :]
            if INTERPRET:
                k0 = tl.dot(x, tl.load(r_rows).to(tl.float32), k0, input_precision="ieee")
                k1 = tl.dot(x, tl.load(r_rows + W).to(tl.float32), k1, input_precision="ieee")
                k2 = tl.dot(x, tl.load(r_rows + 2 * W).to(tl.float32), k2, input_precision="ieee")
                k3 = tl.dot(x, tl.load(r_rows + 3 * W).to(tl.float32), k3, input_precision="ieee")
            else:
                k0 = tl.dot(x, tl.load(r_rows), k0)
                k1 = tl.dot(x, tl.load(r_rows + W), k1)
                k2 = tl.dot(x, tl.load(r_rows + 2 * W), k2)
                k3 = tl.dot(x, tl.load(r_rows + 3 * W), k3)
    elif ROT == 3:  # one full-width dot per piece; the pieces' columns interleave the quarters (4j + q)
        x = tl.load(k_ptr + row_in[:, None] * D + cols[None, :], mask=valid[:, None], other=0.0)
        if INTERPRET:
            x = x.to(tl.float32)
        acc = -tl.load(mean_rot_ptr + h * D + cols)[None, :] + tl.zeros([BLOCK_T, D], tl.float32)
        for i in tl.static_range(NPIECES):
            r = tl.load(pieces_ptr + (NPIECES - 1 - i) * D * D + cols[:, None] * D + cols[None, :])
            if INTERPRET:
                acc = tl.dot(x, r.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, r, acc)
        even, odd = tl.split(tl.reshape(acc, [BLOCK_T, W, 2, 2]))
        k0, k2 = tl.split(even)
        k1, k3 = tl.split(odd)
    else:
        k0, k1, k2, k3 = tw._load_window(k_ptr, row_in, valid, D)
        mean = mean_ptr + h * D + tl.arange(0, W)
        k0 = k0 - tl.load(mean)[None, :]
        k1 = k1 - tl.load(mean + W)[None, :]
        k2 = k2 - tl.load(mean + 2 * W)[None, :]
        k3 = k3 - tl.load(mean + 3 * W)[None, :]
    window_dtype = ring_k_ptr.dtype.element_ty
    k0 = tw._round_to(k0, window_dtype)
    k1 = tw._round_to(k1, window_dtype)
    k2 = tw._round_to(k2, window_dtype)
    k3 = tw._round_to(k3, window_dtype)
    v0, v1, v2, v3 = tw._load_window(v_ptr, row_in, valid, D)
    tw._store_window(k_rot_ptr, row_in, valid, k0, k1, k2, k3, D)
    in_sink = valid & (pos < S)
    sink_row = (slot.to(tl.int64) * HKV + h) * S + pos
    tw._store_window(sink_k_ptr, sink_row, in_sink, k0, k1, k2, k3, D)
    tw._store_window(sink_v_ptr, sink_row, in_sink, v0, v1, v2, v3, D)
    in_ring = valid & (pos >= end_new)
    ring_row = (slot.to(tl.int64) * HKV + h) * C + (pos - S) % C
    tw._store_window(ring_k_ptr, ring_row, in_ring, k0, k1, k2, k3, D)
    tw._store_window(ring_v_ptr, ring_row, in_ring, v0, v1, v2, v3, D)
    first_pos = old + block * BLOCK_T
    last_pos = old + tl.minimum(count, block * BLOCK_T + BLOCK_T) - 1
    if (first_pos < end_new) & (last_pos >= S):
        in_history = valid & (pos >= S) & (pos < end_new)
        page, row, in_history = tw._page_of(bt_ptr, bt_stride, slot, pos, in_history, num_pages, S, P)
        if CLIP == 1:
            kt = tw._bisect_threshold(k0, k1, k2, k3, CLIP_K, 16)
            vt = tw._bisect_threshold(v0, v1, v2, v3, CLIP_V, 16)
        if CLIP == 2:
            kt, vt = _packed_thresholds(k0, k1, k2, k3, v0, v1, v2, v3, CLIP_K, CLIP_V, BLOCK_T)
        if CLIP > 0:
            k0, k1, k2, k3 = tw._clip(k0, k1, k2, k3, kt)
            v0, v1, v2, v3 = tw._clip(v0, v1, v2, v3, vt)
        _quantize_store(k0, k1, k2, k3, in_history, page, row, h, kc_ptr, ks_ptr, kz_ptr, HKV, P, D, 2, DIV)
        _quantize_store(v0, v1, v2, v3, in_history, page, row, h, vc_ptr, vs_ptr, vz_ptr, HKV, P, D, 2, DIV)


def rotation_pieces(rotation: torch.Tensor, n: int) -> torch.Tensor:
    """R (float32) as n bfloat16 pieces, largest first, whose sum is R to ~8n bits."""
    pieces, rest = [], rotation.double()
    for _ in range(n):
        piece = rest.to(torch.bfloat16)
        pieces.append(piece)
        rest = rest - piece.double()
    return torch.stack(pieces).contiguous()


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layout = _layout(KV_HEADS, HEAD_DIM, 128)
    cache = PagedKVCache([layout], layout.pages_needed(TOKENS), 1, TOKENS, device)
    batch = cache.step([cache.open_slot()], [TOKENS])
    layer = cache.layers[0]
    torch.manual_seed(0)
    k = (torch.randn(TOKENS, KV_HEADS, HEAD_DIM, device=device) * 2 + 3).bfloat16()
    v = torch.randn(TOKENS, KV_HEADS, HEAD_DIM, device=device).bfloat16()
    rotation, _ = torch.linalg.qr(torch.randn(HEAD_DIM, HEAD_DIM, device=device, dtype=torch.float64))
    rotation = rotation.float().contiguous()
    mean = torch.randn(KV_HEADS, HEAD_DIM, device=device) * 3
    mean_rot = (mean.double() @ rotation.double()).float().contiguous()
    pieces = {n: rotation_pieces(rotation, n) for n in (2, 3)}
    # ROT=3 reads the pieces and mu·R with columns interleaved: column 4j + q holds quarter q's column j.
    order = torch.arange(HEAD_DIM, device=device).view(4, HEAD_DIM // 4).t().reshape(-1)
    interleaved = {n: p[:, :, order].contiguous() for n, p in pieces.items()}
    mean_rot_interleaved = mean_rot[:, order].contiguous()
    k_rot = torch.empty_like(k)
    pages = (layer.k_codes, layer.k_scale, layer.k_zero, layer.v_codes, layer.v_scale, layer.v_zero)
    clip_k, clip_v = tw.clip_rank(0.96, HEAD_DIM), tw.clip_rank(0.92, HEAD_DIM)
    if device.type == "cuda":
        print(f"copy bandwidth {copy_bandwidth_gbs(device):.0f} GB/s; {torch.cuda.get_device_name(device)}")
    else:
        triton.testing.do_bench = lambda fn, warmup, rep: (fn(), 0.0)[1]
        torch.cuda.synchronize = lambda: None

    # The kernel's float32-rotation path (ROTATE=1), for the checks.
    common = dict(HKV=KV_HEADS, D=HEAD_DIM, NG=1, K_BITS=2, V_BITS=2, P=layout.page_size, S=layout.sink_tokens,
                  R=layout.recent_tokens, CLIP_K=clip_k, CLIP_V=clip_v, SHIFT=16, ROTATE=1, CENTER=True,
                  BLOCK_T=64, KEY_SHIFTS=False, SHIFT_BLOCK=1, COMPILED=device.type == "cuda",
                  enable_fp_fusion=False)
    grid = (1, triton.cdiv(TOKENS, 64), KV_HEADS)  # keys and values in one program (STREAM 2)

    def shipped():
        tw._write_kernel[grid](k, v, k_rot, rotation, 0, mean, k, mean, batch.slots, batch.cu_new, batch.lengths,
                               batch.block_table, batch.block_table.stride(0), layer.num_pages, *pages,
                               layer.sink_k, layer.sink_v, layer.ring_k, layer.ring_v, k, 1, num_warps=4, **common)

    shipped()
    torch.cuda.synchronize()
    expected = [t.clone() for t in (k_rot, *pages)]
    exact_rot = ((k.double() - mean.double()) @ rotation.double()).to(torch.bfloat16)
    print(f"ROTATE=1: {triton.testing.do_bench(shipped, warmup=20, rep=200) * 1e3:.1f} us; "
          f"k_rot != float64 rounding: {(expected[0] != exact_rot).float().mean().item():.2e}")

    def run(block, warps, rot, clip, div, npieces):
        g = (1, triton.cdiv(TOKENS, block), KV_HEADS)

        def launch():
            _variant_kernel[g](k, v, k_rot, rotation, (interleaved if rot == 3 else pieces)[npieces], mean,
                               mean_rot_interleaved if rot == 3 else mean_rot, batch.slots, batch.cu_new,
                               batch.lengths, batch.block_table, batch.block_table.stride(0), layer.num_pages,
                               *pages, layer.sink_k, layer.sink_v, layer.ring_k, layer.ring_v,
                               HKV=KV_HEADS, D=HEAD_DIM, P=layout.page_size, S=layout.sink_tokens,
                               R=layout.recent_tokens, CLIP_K=clip_k, CLIP_V=clip_v, BLOCK_T=block, ROT=rot,
                               CLIP=clip, DIV=div, NPIECES=npieces,
                               INTERPRET=device.type != "cuda", num_warps=warps, enable_fp_fusion=False)

        try:
            us = triton.testing.do_bench(launch, warmup=20, rep=200) * 1e3
        except Exception as error:  # noqa: BLE001 - an experiment: report and go on
            print(f"{block:4d} {warps:2d} rot{rot} clip{clip} div{div} p{npieces}: failed {type(error).__name__}: "
                  f"{str(error)[:200]}")
            return
        for t in pages:
            t.zero_()
        launch()
        torch.cuda.synchronize()
        diffs = [(a != e).float().mean().item() for a, e in zip((k_rot, *pages), expected)]
        rot_vs_exact = (k_rot != exact_rot).float().mean().item()
        print(f"{block:4d} {warps:2d} rot{rot} clip{clip} div{div} p{npieces}: {us:7.1f} us  "
              f"differs from ROTATE=1 (k_rot, kc, ks, kz, vc, vs, vz): " + " ".join(f"{d:.1e}" for d in diffs)
              + f"  k_rot vs float64: {rot_vs_exact:.1e}", flush=True)

    plan = sys.argv[1] if len(sys.argv) > 1 else "main"
    if plan == "main":
        for block, warps in ((16, 4), (32, 4), (64, 4), (64, 8)):
            for rot, clip, div, npieces in ((1, 1, 1, 3), (0, 0, 1, 3), (0, 0, 0, 3), (0, 2, 1, 3), (2, 0, 1, 3),
                                            (2, 0, 1, 2), (2, 2, 1, 3), (2, 2, 0, 3), (1, 2, 1, 3)):
                run(block, warps, rot, clip, div, npieces)
    if plan == "wide":
        for block, warps in ((64, 4), (64, 8), (128, 4), (128, 8), (32, 4)):
            for rot, clip, div, npieces in ((3, 0, 0, 3), (3, 0, 0, 2), (3, 2, 0, 3), (2, 2, 0, 3), (0, 2, 0, 3),
                                            (3, 2, 1, 3)):
                run(block, warps, rot, clip, div, npieces)


if __name__ == "__main__":
    main()
