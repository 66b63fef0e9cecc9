"""Developer probe (GPU): rotate_queries, Triton kernel against the torch path, per call in a CUDA graph.

    PYTHONPATH=src python scripts/probe_rotate_queries.py   # data: docs/data/rotate-queries-h100.txt
"""
import torch
from oscarkv.kernels.ops import rotate_queries
def t(f, n=200):
    for _ in range(10): f()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20): f()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay(); torch.cuda.synchronize(); s.record()
    for _ in range(n // 20): g.replay()
    e.record(); e.synchronize(); return s.elapsed_time(e) * 1e3 / n
for b, hq, hkv, d, per in [(1, 32, 8, 128, False), (32, 32, 8, 128, False), (1, 9, 3, 64, False), (1, 4, 1, 256, False), (1, 32, 8, 128, True)]:
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    r = torch.linalg.qr(torch.randn(*((hkv, d, d) if per else (d, d)), device="cuda"))[0].contiguous()
    a = t(lambda: rotate_queries(q, r, backend="triton")); c = t(lambda: rotate_queries(q, r, backend="torch"))
    same = (rotate_queries(q, r, backend="triton") != rotate_queries(q, r, backend="torch")).float().mean().item()
    print(f"B={b} Hq={hq} D={d} per_head={per}: triton {a:.2f} us, torch {c:.2f} us, differing {same:.4f}")
