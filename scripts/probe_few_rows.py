"""Developer tool (GPU): a decode step's linear layers at a few rows, cuBLAS against the few-rows Triton kernels.

Random Qwen3-4B weights for 36 layers (so that no layer's weights are still in the L2 when read again), each
timed in one CUDA graph:

    PYTHONPATH=src python scripts/probe_few_rows.py sweep [M,...]          # whole chains, a grid of tiles
    PYTHONPATH=src python scripts/probe_few_rows.py products TILE,... M,... # per product (µs per layer)

A TILE is block_n/block_k/warps/stages/waves (`RowTile`), e.g. 64/128/4/4/1 (the shipped one). The
products are q/k/v in one launch, o, gate/up with silu·up in one launch, and down; cuBLAS runs the model's
way (q, k, v apart; silu and the product in PyTorch). Results: docs/data/few-rows-linear-h200.txt.
"""
from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F

from oscarkv.kernels.triton_gemv import RowTile, launch_gemv, launch_gemv_silu_mul

DEVICE, DTYPE = "cuda", torch.bfloat16
HIDDEN, INTER, Q, KV, LAYERS = 2560, 9728, 4096, 1024, 36
SHAPES = dict(q=(Q, HIDDEN), k=(KV, HIDDEN), v=(KV, HIDDEN), o=(HIDDEN, Q), g=(INTER, HIDDEN), u=(INTER, HIDDEN),
              d=(HIDDEN, INTER))


def randn(*shape):
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE)


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy, bytes read and written."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device=DEVICE)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 2 * a.numel() * 10 / (start.elapsed_time(end) * 1e-3) / 1e9


def graph_us(fn, reps: int = 20) -> float:
    """µs per replay of a CUDA graph of fn()."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def chain_cublas(layers, x):
    for w in layers:
        q, _, _ = F.linear(x, w["q"]), F.linear(x, w["k"]), F.linear(x, w["v"])
        a = F.linear(q, w["o"])
        x = F.linear(F.silu(F.linear(a, w["g"])) * F.linear(a, w["u"]), w["d"])


def chain_triton(layers, x, tile: RowTile):
    m = x.shape[0]
    for w in layers:
        qkv = x.new_empty(m * (Q + 2 * KV))  # q [m, Q], then k and v (`launch_gemv`)
        launch_gemv(x, [w["q"], w["k"], w["v"]], [None] * 3, qkv, overlap=True, tile=tile)
        a = x.new_empty(m, HIDDEN)
        launch_gemv(qkv[:m * Q].view(m, Q), w["o"], None, a, overlap=True, tile=tile)
        h = x.new_empty(m, INTER)
        launch_gemv_silu_mul(a, w["g"], w["u"], h, overlap=True, tile=tile)
        x = x.new_empty(m, HIDDEN)
        launch_gemv(h, w["d"], None, x, overlap=True, tile=tile)


def sweep(layers, ms, bandwidth, weight_bytes):
    for m in ms:
        x = randn(m, HIDDEN)
        t = graph_us(lambda: chain_cublas(layers, x))
        print(f"M={m} cublas {t:.0f} us {weight_bytes / t / 1e3 / bandwidth * 100:.1f}%", flush=True)
        for bn, bk, st, wv in itertools.product((64, 128), (64, 128), (4,), (1.0, 2.0, 4.0)):
            tile = RowTile(bn, bk, 4, st, wv)
            try:
                t = graph_us(lambda: chain_triton(layers, x, tile))
                print(f"M={m} {tile} {t:.0f} us {weight_bytes / t / 1e3 / bandwidth * 100:.1f}%", flush=True)
            except Exception as exc:  # a tile over the shared memory
                print(f"M={m} {tile} failed {type(exc).__name__}: {str(exc)[:100]}", flush=True)


def products(layers, tile: RowTile, m: int, bandwidth: float):
    """µs per layer of each product, cuBLAS -> Triton."""
    x, xq, xi = randn(m, HIDDEN), randn(m, Q), randn(m, INTER)
    qkv, out, hidden = x.new_empty(m * (Q + 2 * KV)), x.new_empty(m, HIDDEN), x.new_empty(m, INTER)
    cases = {
        "qkv": (lambda w: launch_gemv(x, [w["q"], w["k"], w["v"]], [None] * 3, qkv, overlap=True, tile=tile),
                lambda w: (F.linear(x, w["q"]), F.linear(x, w["k"]), F.linear(x, w["v"])), Q + 2 * KV, HIDDEN),
        "o": (lambda w: launch_gemv(xq, w["o"], None, out, overlap=True, tile=tile),
              lambda w: F.linear(xq, w["o"]), HIDDEN, Q),
        "gu": (lambda w: launch_gemv_silu_mul(x, w["g"], w["u"], hidden, overlap=True, tile=tile),
               lambda w: F.silu(F.linear(x, w["g"])) * F.linear(x, w["u"]), 2 * INTER, HIDDEN),
        "d": (lambda w: launch_gemv(xi, w["d"], None, out, overlap=True, tile=tile),
              lambda w: F.linear(xi, w["d"]), HIDDEN, INTER),
    }
    row = [f"M={m} {tile}:"]
    for name, (triton_step, cublas_step, n, k) in cases.items():
        ours = graph_us(lambda: [triton_step(w) for w in layers]) / LAYERS
        theirs = graph_us(lambda: [cublas_step(w) for w in layers]) / LAYERS
        row.append(f"{name} {theirs:.1f}->{ours:.1f}us ({n * k * 2 / ours / 1e3 / bandwidth * 100:.0f}%)")
    print("  ".join(row), flush=True)


def parse_tile(spec: str) -> RowTile:
    f = spec.split("/")
    return RowTile(int(f[0]), int(f[1]), int(f[2]), int(f[3]), float(f[4]))


def main(argv: list[str]) -> None:
    torch.manual_seed(0)
    layers = [{name: randn(*shape) * 0.02 for name, shape in SHAPES.items()} for _ in range(LAYERS)]
    weight_bytes = sum(n * k * 2 for n, k in SHAPES.values()) * LAYERS
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()} copy {bandwidth:.0f} GB/s; weights {weight_bytes / 1e9:.2f} GB: "
          f"ideal {weight_bytes / bandwidth / 1e3:.0f} us per chain", flush=True)
    if argv and argv[0] == "products":
        for m in [int(v) for v in argv[2].split(",")]:
            for spec in argv[1].split(","):
                products(layers, parse_tile(spec), m, bandwidth)
    else:
        sweep(layers, [int(v) for v in argv[1].split(",")] if len(argv) > 1 else [16, 32], bandwidth, weight_bytes)


if __name__ == "__main__":
    main(sys.argv[1:])
