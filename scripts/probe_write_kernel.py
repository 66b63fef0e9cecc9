"""Where the write kernel's time goes: the kernel alone, with its parts switched off, on a CUDA GPU.

A 32K-token prompt into an empty paged cache (8 KV heads, D = 128, group 128, INT2), as in
`oscarkv bench attention`'s write row, but launching `_write_kernel` directly so that the block
size, the warps, the rotation and the clip can be varied. docs/kernels-log.md quotes its output.

    PYTHONPATH=src python scripts/probe_write_kernel.py
"""

from __future__ import annotations

import torch
import triton

from oscarkv.benchmarks.attention import _layout, copy_bandwidth_gbs
from oscarkv.cache.paged import PagedKVCache
from oscarkv.kernels import triton_write
from oscarkv.kernels.ops import rotation_pieces

TOKENS, KV_HEADS, HEAD_DIM = 32768, 8, 128


def main() -> None:
    device = torch.device("cuda")
    layout = _layout(KV_HEADS, HEAD_DIM, 128)
    cache = PagedKVCache([layout], layout.pages_needed(TOKENS), 1, TOKENS, device)
    batch = cache.step([cache.open_slot()], [TOKENS])
    layer = cache.layers[0]
    k = torch.randn(TOKENS, KV_HEADS, HEAD_DIM, device=device).bfloat16()
    v = torch.randn(TOKENS, KV_HEADS, HEAD_DIM, device=device).bfloat16()
    rotation, _ = torch.linalg.qr(torch.randn(HEAD_DIM, HEAD_DIM, device=device))
    mean = torch.randn(KV_HEADS, HEAD_DIM, device=device)
    k_rot = torch.empty_like(k)
    pages = (layer.k_codes, layer.k_scale, layer.k_zero, layer.v_codes, layer.v_scale, layer.v_zero)
    clip_k, clip_v = triton_write.clip_rank(0.96, HEAD_DIM), triton_write.clip_rank(0.92, HEAD_DIM)
    print(f"copy bandwidth {copy_bandwidth_gbs(device):.0f} GB/s; {torch.cuda.get_device_name(device)}")

    pieces = rotation_pieces(rotation, mean)

    def time_us(block: int, warps: int, rotate: int, clip: bool) -> float:
        """rotate: 2 bfloat16 pieces (what bfloat16 keys take), 1 float32 (tf32x3) dots, 0 none."""
        grid = (1, triton.cdiv(TOKENS, block), KV_HEADS)  # keys, then values: two launches (launch_write since takes one)
        constants = dict(HKV=KV_HEADS, D=HEAD_DIM, NG=layout.groups, K_BITS=layout.key_bits,
                         V_BITS=layout.value_bits, P=layout.page_size,
                         S=layout.sink_tokens, R=layout.recent_tokens, CLIP_K=clip_k if clip else -1,
                         CLIP_V=clip_v if clip else -1, SHIFT=triton_write.pattern_shift(layer.ring_k.dtype),
                         ROTATE=rotate, CENTER=True, BLOCK_T=block, KEY_SHIFTS=False, SHIFT_BLOCK=1,
                         enable_fp_fusion=False)

        def launch():
            for stream in (0, 1):
                triton_write._write_kernel[grid](
                    k, v, k_rot, rotation, 0, mean, pieces.pieces, pieces.mean_rotated, batch.slots, batch.cu_new,
                    batch.lengths, batch.block_table, batch.block_table.stride(0), layer.num_pages, *pages,
                    layer.sink_k, layer.sink_v, layer.ring_k, layer.ring_v, k, 1, 0.0, 0.0, 0.0, 0.0,
                    num_warps=warps, STREAM=stream, **constants)

        return triton.testing.do_bench(launch, warmup=20, rep=200) * 1e3

    print("block  warps  everything  float32-rotation  no-rotation  no-clip  neither   (µs)")
    for block, warps in ((16, 4), (32, 4), (64, 4), (64, 8), (128, 8)):
        row = [time_us(block, warps, rotate, clip) for rotate, clip in ((2, 1), (1, 1), (0, 1), (2, 0), (0, 0))]
        print(f"{block:5d}  {warps:5d}  " + "  ".join(f"{t:10.1f}" for t in row), flush=True)


if __name__ == "__main__":
    main()
