"""Developer tool (GPU): the batch-1 linear products of 36 Qwen3-4B layers in one CUDA graph, each layer
with its own weights (7.3 GB, so nothing stays in L2), in five ways:

- cuBLAS: F.linear per product, silu(gate)*up in PyTorch;
- K-blocked: the first Triton kernel (2 rows per program, 1024-column blocks, 3 pipeline stages; the
  `_gemv` of scripts/probe_gemv.py), one launch per product;
- whole rows: `kernels/triton_gemv.py`, one launch per product, launches in order;
- fused: q/k/v in one launch and silu(gate)*up in one, launches in order;
- fused, overlapped: the same with programmatic dependent launch (what `gemv_linears` runs on Hopper).

    PYTHONPATH=src:scripts python scripts/probe_gemv_chain.py

The layer's inputs are the previous products' outputs (q feeds o, o feeds gate and up), so each launch
waits for the one before it, as in a decode step; the attention and norms between them are left out."""
import torch
import torch.nn.functional as F

from oscarkv.benchmarks.attention import copy_bandwidth_gbs
from oscarkv.kernels import triton_gemv as tg
from probe_gemv import gemv as k_blocked

HIDDEN, INTERMEDIATE, Q, KV, LAYERS = 2560, 9728, 4096, 1024, 36


def main() -> None:
    dev = torch.device("cuda")
    copy = copy_bandwidth_gbs(dev)
    torch.manual_seed(0)

    def weight(n, k):
        return torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5

    layers = [dict(q=weight(Q, HIDDEN), k=weight(KV, HIDDEN), v=weight(KV, HIDDEN), o=weight(HIDDEN, Q),
                   g=weight(INTERMEDIATE, HIDDEN), u=weight(INTERMEDIATE, HIDDEN), d=weight(HIDDEN, INTERMEDIATE))
              for _ in range(LAYERS)]
    nbytes = sum(t.numel() * 2 for t in layers[0].values()) * LAYERS
    x0 = torch.randn(HIDDEN, device=dev, dtype=torch.bfloat16)
    buf = {name: torch.empty(n, device=dev, dtype=torch.bfloat16) for name, n in
           dict(qkv=Q + 2 * KV, o=HIDDEN, g=INTERMEDIATE, u=INTERMEDIATE, a=INTERMEDIATE, d=HIDDEN).items()}
    q, k, v = buf["qkv"][:Q], buf["qkv"][Q:Q + KV], buf["qkv"][Q + KV:]

    def per_product(product):
        def run():
            x = x0
            for p in layers:
                for name, inp, out in (("q", x, q), ("k", x, k), ("v", x, v), ("o", q, buf["o"]),
                                       ("g", buf["o"], buf["g"]), ("u", buf["o"], buf["u"])):
                    product(inp, p[name], out)
                torch.mul(F.silu(buf["g"]), buf["u"], out=buf["a"])
                product(buf["a"], p["d"], buf["d"])
                x = buf["d"]
        return run

    def fused(overlap):
        def run():
            x = x0
            for p in layers:
                tg.launch_gemv(x, [p["q"], p["k"], p["v"]], [None] * 3, buf["qkv"], overlap)
                tg.launch_gemv(q, p["o"], None, buf["o"], overlap)
                tg.launch_gemv_silu_mul(buf["o"], p["g"], p["u"], buf["a"], overlap)
                tg.launch_gemv(buf["a"], p["d"], None, buf["d"], overlap)
                x = buf["d"]
        return run

    ways = {"cuBLAS": per_product(lambda x, w, out: torch.matmul(w, x, out=out)),
            "K-blocked": per_product(lambda x, w, out: k_blocked(x, w, out, 2, 1024, 4, 3)),
            "whole rows": per_product(lambda x, w, out: tg.launch_gemv(x, w, None, out)),
            "fused": fused(False), "fused, overlapped": fused(True)}
    print(f"H100 copy bandwidth {copy:.0f} GB/s; weights {nbytes / 1e9:.3f} GB, byte time "
          f"{nbytes / copy / 1e6:.3f} ms", flush=True)
    finals = {}
    for name, run in ways.items():
        run()
        finals[name] = buf["d"].clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        times = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 20)
        ms = min(times)
        print(f"{name:>18}: {ms:.3f} ms per 36 layers ({max(times):.3f} slowest of 3), {nbytes / ms / 1e6:.0f} GB/s "
              f"= {nbytes / ms / 1e6 / copy * 100:.1f}% of copy", flush=True)
    same = {name: bool(torch.equal(out, finals["whole rows"])) for name, out in finals.items()}
    print("last layer's output equal to 'whole rows':", same)


if __name__ == "__main__":
    main()
