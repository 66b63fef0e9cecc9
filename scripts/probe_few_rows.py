"""Developer tool (GPU): a decode step's linear layers at a few rows, cuBLAS against the few-rows Triton kernels.

Random Qwen3-4B weights for 36 layers (so that no layer's weights are still in the L2 when read again), each
timed in one CUDA graph:

    PYTHONPATH=src python scripts/probe_few_rows.py sweep [M,...]          # whole chains, a grid of tiles
    PYTHONPATH=src python scripts/probe_few_rows.py products TILE,... M,... # per product (µs per layer)

A TILE is block_n/block_k/warps/stages/waves (`RowTile`), e.g. 64/128/4/4/1 (the shipped one). The
products are q/k/v in one launch, o, gate/up with silu·up in one launch, and down; cuBLAS runs the model's
way (q, k, v apart; silu and the product in PyTorch). Results: docs/data/few-rows-linear-h200.txt.
"""
import itertools
import sys

import torch
import torch.nn.functional as F

from oscarkv.kernels.triton_gemv import RowTile, launch_gemv, launch_gemv_silu_mul

torch.manual_seed(0)
dev = "cuda"
H, I, Q, KV, L = 2560, 9728, 4096, 1024, 36
dt = torch.bfloat16
layers = [dict(q=torch.randn(Q, H, device=dev, dtype=dt) * 0.02, k=torch.randn(KV, H, device=dev, dtype=dt) * 0.02,
               v=torch.randn(KV, H, device=dev, dtype=dt) * 0.02, o=torch.randn(H, Q, device=dev, dtype=dt) * 0.02,
               g=torch.randn(I, H, device=dev, dtype=dt) * 0.02, u=torch.randn(I, H, device=dev, dtype=dt) * 0.02,
               d=torch.randn(H, I, device=dev, dtype=dt) * 0.02) for _ in range(L)]
wbytes = sum(w.numel() * 2 for w in layers[0].values()) * L

def copy_bw():
    a = torch.empty(2 << 30, dtype=torch.uint8, device=dev); b = torch.empty_like(a)
    for _ in range(3): b.copy_(a)
    s, e = torch.cuda.Event(True), torch.cuda.Event(True); torch.cuda.synchronize(); s.record()
    for _ in range(10): b.copy_(a)
    e.record(); e.synchronize(); return 2 * a.numel() * 10 / (s.elapsed_time(e) * 1e-3) / 1e9

def chain_cublas(x):
    for w in layers:
        q, _, _ = F.linear(x, w["q"]), F.linear(x, w["k"]), F.linear(x, w["v"])
        a = F.linear(q, w["o"])
        h = F.silu(F.linear(a, w["g"])) * F.linear(a, w["u"])
        x = F.linear(h, w["d"])
    return x

def make_triton(tile):
    def chain(x):
        m = x.shape[0]
        for w in layers:
            qkv = torch.empty(m, Q + 2 * KV, device=dev, dtype=dt)
            launch_gemv(x, [w["q"], w["k"], w["v"]], [None] * 3, qkv, overlap=True, tile=tile)
            a = torch.empty(m, H, device=dev, dtype=dt)
            launch_gemv(qkv[:, :Q], w["o"], None, a, overlap=True, tile=tile)
            h = torch.empty(m, I, device=dev, dtype=dt)
            launch_gemv_silu_mul(a, w["g"], w["u"], h, overlap=True, tile=tile)
            x = torch.empty(m, H, device=dev, dtype=dt)
            launch_gemv(h, w["d"], None, x, overlap=True, tile=tile)
        return x
    return chain

def time_graph(fn, x, reps=20):
    fn(x); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(x)
    for _ in range(3): g.replay()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True); torch.cuda.synchronize(); s.record()
    for _ in range(reps): g.replay()
    e.record(); e.synchronize(); return s.elapsed_time(e) * 1e3 / reps

bw = copy_bw()
print(f"{torch.cuda.get_device_name()} copy {bw:.0f} GB/s; weights {wbytes/1e9:.2f} GB: ideal {wbytes/bw/1e3:.0f} us per chain", flush=True)
def products(tile, m):
    x = torch.randn(m, H, device=dev, dtype=dt); xq = torch.randn(m, Q, device=dev, dtype=dt); xi = torch.randn(m, I, device=dev, dtype=dt)
    outs = dict(qkv=torch.empty(m, Q + 2 * KV, device=dev, dtype=dt), o=torch.empty(m, H, device=dev, dtype=dt),
                h=torch.empty(m, I, device=dev, dtype=dt))
    def t_qkv(_):
        for w in layers: launch_gemv(x, [w["q"], w["k"], w["v"]], [None] * 3, outs["qkv"], overlap=True, tile=tile)
    def t_o(_):
        for w in layers: launch_gemv(xq, w["o"], None, outs["o"], overlap=True, tile=tile)
    def t_gu(_):
        for w in layers: launch_gemv_silu_mul(x, w["g"], w["u"], outs["h"], overlap=True, tile=tile)
    def t_d(_):
        for w in layers: launch_gemv(xi, w["d"], None, outs["o"], overlap=True, tile=tile)
    def c_qkv(_):
        for w in layers: F.linear(x, w["q"]); F.linear(x, w["k"]); F.linear(x, w["v"])
    def c_o(_):
        for w in layers: F.linear(xq, w["o"])
    def c_gu(_):
        for w in layers: F.silu(F.linear(x, w["g"])) * F.linear(x, w["u"])
    def c_d(_):
        for w in layers: F.linear(xi, w["d"])
    nbytes = dict(qkv=(Q + 2 * KV) * H * 2, o=H * Q * 2, gu=2 * I * H * 2, d=H * I * 2)
    row = [f"M={m} {tile}:"]
    for name, tf, cf in (("qkv", t_qkv, c_qkv), ("o", t_o, c_o), ("gu", t_gu, c_gu), ("d", t_d, c_d)):
        tt, tc = time_graph(tf, None) / L, time_graph(cf, None) / L
        row.append(f"{name} {tc:.1f}->{tt:.1f}us ({nbytes[name]/tt/1e3/bw*100:.0f}%)")
    print("  ".join(row), flush=True)

def parse_tile(spec: str) -> RowTile:
    f = spec.split("/")
    return RowTile(int(f[0]), int(f[1]), int(f[2]), int(f[3]), float(f[4]))


def sweep(ms):
    for m in ms:
        x = torch.randn(m, H, device=dev, dtype=dt)
        t = time_graph(chain_cublas, x)
        print(f"M={m} cublas {t:.0f} us {wbytes/t/1e3/bw*100:.1f}%", flush=True)
        for bn, bk, st, wv in itertools.product((64, 128), (64, 128), (4,), (1.0, 2.0, 4.0)):
            tile = RowTile(bn, bk, 4, st, wv)
            try:
                t = time_graph(make_triton(tile), x)
                print(f"M={m} {tile} {t:.0f} us {wbytes/t/1e3/bw*100:.1f}%", flush=True)
            except Exception as exc:  # a tile over the shared memory
                print(f"M={m} {tile} failed {type(exc).__name__}: {str(exc)[:100]}", flush=True)


mode = sys.argv[1] if len(sys.argv) > 1 else "sweep"
if mode == "products":
    for m in [int(v) for v in sys.argv[3].split(",")]:
        for spec in sys.argv[2].split(","):
            products(parse_tile(spec), m)
else:
    sweep([int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else [16, 32])
