"""Developer tool (GPU): cuBLAS F.linear against a Triton matrix-vector kernel at one input row, on the
Qwen3-4B decode shapes, over a sweep of block shapes (the sweep that chose `kernels/triton_gemv.py`'s).

    PYTHONPATH=src python scripts/probe_gemv.py

Each shape repeats one weight, which stays in the 50 MB L2 cache when it is small, so fractions above
100% of the copy bandwidth appear; in a model every layer reads its own weights (see docs/decode-log.md
for the whole-step effect)."""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from oscarkv.benchmarks.attention import _time_us, copy_bandwidth_gbs


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    cols = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + cols
        x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :], mask=ok[:, None] & (kk < K)[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=ok)


def gemv(x, w, out, bn, bk, warps, stages):
    N, K = w.shape
    _gemv[(triton.cdiv(N, bn),)](x, w, out, N, K, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


def main() -> None:
    dev = torch.device("cuda")
    copy = copy_bandwidth_gbs(dev)
    print(f"copy {copy:.0f} GB/s")
    shapes = {"q": (4096, 2560), "kv": (1024, 2560), "o": (2560, 4096), "gate/up": (9728, 2560), "down": (2560, 9728),
              "lm_head": (151936, 2560), "gate+up fused": (19456, 2560), "qkv fused": (6144, 2560)}
    configs = [(bn, bk, wp, st) for bn in (2, 4, 8, 16) for bk in (256, 512, 1024) for wp in (4,) for st in (1, 3)]
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x, w)
        nbytes = N * K * 2
        t_cublas = _time_us(lambda: F.linear(x, w))
        best = None
        out = torch.empty(N, device=dev, dtype=torch.bfloat16)
        for c in configs:
            try:
                gemv(x, w, out, *c)
            except Exception:
                continue
            err = (out.float() - ref.float().view(-1)).abs().max().item()
            t = _time_us(lambda: gemv(x, w, out, *c))
            if best is None or t < best[0]:
                best = (t, c, err)
        t, c, err = best
        print(f"{name:>14} {N}x{K}: cuBLAS {t_cublas:7.1f} us ({nbytes/t_cublas/1e3/copy*100:5.1f}%)  triton {t:7.1f} us "
              f"({nbytes/t/1e3/copy*100:5.1f}%) best {c} err {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
