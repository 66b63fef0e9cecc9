"""Developer probe (GPU): rotate_queries, Triton kernel against the torch path, per call in a CUDA graph.

    PYTHONPATH=src python scripts/probe_rotate_queries.py           # data: docs/data/rotate-queries-h100.txt
    PYTHONPATH=src python scripts/probe_rotate_queries.py --blocks  # the kernel's block sizes on prompt chunks
    PYTHONPATH=src python scripts/probe_rotate_queries.py --pieces  # prompt chunks: float32 dots against R_K's terms

--blocks times `_rotate_queries_kernel` at several (rows, columns, slice, warps) per program on decode steps and
prompt chunks of Qwen3 and SmolLM2 shapes, and counts the outputs that differ from the torch reference.
--pieces times the long-step blocks on prompt chunks with float32 CUDA-core dots (PIECES=False) and with the
tensor-core dots by R_K's three terms (PIECES=True), for bfloat16 and float16 queries, and the largest error of each
against the rotation in float64.
"""
import argparse

import torch
import triton

from oscarkv.kernels.ops import rotate_queries
from oscarkv.kernels.reference import rotate_queries_reference
from oscarkv.kernels.triton_rotate import _rotate_queries_kernel

SHAPES = [(1, 32, 8, 128, False), (32, 32, 8, 128, False), (1, 9, 3, 64, False), (1, 4, 1, 256, False),
          (1, 32, 8, 128, True)]
# (tokens, Hq, Hkv, D) of one sequence's step: decode, and prompt chunks as `serve` feeds them
CHUNKS = [(1, 32, 8, 128), (32, 32, 8, 128), (64, 32, 8, 128), (128, 32, 8, 128), (256, 32, 8, 128),
          (512, 32, 8, 128), (2048, 32, 8, 128), (64, 9, 3, 64), (128, 9, 3, 64), (256, 9, 3, 64), (512, 9, 3, 64),
          (2048, 9, 3, 64)]
BLOCKS = [(16, 32, 32, 4), (32, 64, 32, 4), (64, 64, 32, 4), (64, 128, 32, 8), (32, 128, 32, 4), (32, 128, 32, 8),
          (16, 128, 32, 4)]


def timed(f, n=200):
    for _ in range(10):
        f()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            f()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    torch.cuda.synchronize()
    s.record()
    for _ in range(n // 20):
        g.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e3 / n


def prompt_queries(tokens, hq, d):
    """[1, Hq, tokens, D] with the strides of transformers' queries after RoPE (contiguous per head)."""
    return torch.randn(1, hq, tokens, d, device="cuda", dtype=torch.bfloat16)


def launch(q, r, out, block, block_n, block_k, warps, pieces=False):
    b, hq, n, d = q.shape
    rows = b * n
    block_n = min(block_n, d)
    grid = (triton.cdiv(rows, block), hq, d // block_n)
    _rotate_queries_kernel[grid](q, r, out, rows, n, q.stride(0), q.stride(1), q.stride(2), HQ=hq, GROUP=hq,
                                 PER_HEAD=False, D=d, BLOCK=block, BLOCK_N=block_n, BLOCK_K=min(block_k, d),
                                 PIECES=pieces, num_warps=warps)


PIECE_BLOCKS = [(64, 128, 32, 8), (128, 128, 32, 8), (64, 128, 64, 8), (128, 128, 64, 8), (64, 128, 128, 8),
                (64, 128, 32, 4)]


def sweep_pieces():
    for tokens, hq, hkv, d in [c for c in CHUNKS if c[0] >= 128]:
        for dtype in (torch.bfloat16, torch.float16):
            q = torch.randn(1, hq, tokens, d, device="cuda", dtype=dtype)
            r = torch.linalg.qr(torch.randn(d, d, device="cuda", dtype=torch.float64))[0]
            exact = torch.einsum("bhnd,de->bnhe", q.double(), r).reshape(tokens, hq, d)
            r = r.float().contiguous()
            want = rotate_queries_reference(q, r)
            out = torch.empty_like(want)
            moved = 2 * q.numel() * q.element_size()
            print(f"{tokens} tokens, Hq={hq}, D={d}, {str(dtype)[6:]}: reference's largest error "
                  f"{(want.double() - exact).abs().max().item():.2e}")
            for block, block_n, block_k, warps in PIECE_BLOCKS:
                for pieces in (False, True):
                    us = timed(lambda: launch(q, r, out, block, block_n, block_k, warps, pieces))
                    launch(q, r, out, block, block_n, block_k, warps, pieces)
                    differing = (out != want).float().mean().item()
                    error = (out.double() - exact).abs().max().item()
                    print(f"  rows {block:3d} columns {block_n:3d} slice {block_k:3d} warps {warps} "
                          f"{'pieces ' if pieces else 'float32'}: {us:7.2f} us ({moved / us / 1e3:6.0f} GB/s moved), "
                          f"differing from the reference {differing:.5f}, largest error {error:.2e}")


def sweep_blocks():
    for tokens, hq, hkv, d in CHUNKS:
        q = prompt_queries(tokens, hq, d)
        r = torch.linalg.qr(torch.randn(d, d, device="cuda"))[0].contiguous()
        want = rotate_queries_reference(q, r)
        out = torch.empty_like(want)
        moved = 2 * q.numel() * q.element_size()
        torch_us = timed(lambda: rotate_queries_reference(q, r))
        print(f"{tokens} tokens, Hq={hq}, D={d}: torch path {torch_us:.2f} us")
        for block, block_n, block_k, warps in BLOCKS:
            us = timed(lambda: launch(q, r, out, block, block_n, block_k, warps))
            launch(q, r, out, block, block_n, block_k, warps)
            differing = (out != want).float().mean().item()
            print(f"  rows {block:3d} columns {block_n:3d} slice {block_k:2d} warps {warps}: {us:7.2f} us "
                  f"({moved / us / 1e3:6.0f} GB/s moved), differing {differing:.5f}")


def compare_paths():
    for b, hq, hkv, d, per in SHAPES:
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        r = torch.linalg.qr(torch.randn(*((hkv, d, d) if per else (d, d)), device="cuda"))[0].contiguous()
        a = timed(lambda: rotate_queries(q, r, backend="triton"))
        c = timed(lambda: rotate_queries(q, r, backend="torch"))
        same = (rotate_queries(q, r, backend="triton") != rotate_queries(q, r, backend="torch")).float().mean().item()
        print(f"B={b} Hq={hq} D={d} per_head={per}: triton {a:.2f} us, torch {c:.2f} us, differing {same:.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", action="store_true", help="sweep the kernel's block sizes on prompt chunks")
    parser.add_argument("--pieces", action="store_true", help="prompt chunks: float32 dots against R_K's terms")
    args = parser.parse_args()
    if args.pieces:
        sweep_pieces()
    elif args.blocks:
        sweep_blocks()
    else:
        compare_paths()
