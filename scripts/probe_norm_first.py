"""Developer tool (GPU): a decoder layer's RMSNorms inside the matrix-vector launches after them (`NormFirst`)
against the Triton norm launches before them, in a CUDA graph of the batch-1 products of 36 Qwen3-4B
layers (each with its own weights, so nothing stays in L2), every launch overlapped as in a decode step.

Per layer: [add + norm] -> q/k/v -> o -> [add + norm] -> silu(gate)*up -> down, the norms either as
their own launches (`triton_norm.launch_rms_norm`, what the static decode path runs now) or folded
into the q/k/v and gate/up launches. The attention between q/k/v and o is left out (o reads q).

    PYTHONPATH=src python scripts/probe_norm_first.py
"""
import torch

from oscarkv.benchmarks.attention import copy_bandwidth_gbs
from oscarkv.kernels import triton_gemv as tg
from oscarkv.kernels.triton_norm import launch_rms_norm

HIDDEN, INTERMEDIATE, Q, KV, LAYERS, EPS = 2560, 9728, 4096, 1024, 36, 1e-6


def main() -> None:
    dev = torch.device("cuda")
    copy = copy_bandwidth_gbs(dev)
    torch.manual_seed(0)

    def weight(n, k):
        return torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5

    layers = [dict(q=weight(Q, HIDDEN), k=weight(KV, HIDDEN), v=weight(KV, HIDDEN), o=weight(HIDDEN, Q),
                   g=weight(INTERMEDIATE, HIDDEN), u=weight(INTERMEDIATE, HIDDEN), d=weight(HIDDEN, INTERMEDIATE),
                   n1=1 + 0.1 * torch.randn(HIDDEN, device=dev, dtype=torch.bfloat16),
                   n2=1 + 0.1 * torch.randn(HIDDEN, device=dev, dtype=torch.bfloat16))
              for _ in range(LAYERS)]
    nbytes = sum(t.numel() * 2 for t in layers[0].values()) * LAYERS
    x0 = torch.randn(HIDDEN, device=dev, dtype=torch.bfloat16)
    r0 = torch.randn(HIDDEN, device=dev, dtype=torch.bfloat16)

    def row(n):
        return torch.empty(n, device=dev, dtype=torch.bfloat16)

    qkv, o, a, d = row(Q + 2 * KV), row(HIDDEN), row(INTERMEDIATE), row(HIDDEN)
    sums = [row(HIDDEN) for _ in range(2 * LAYERS)]
    normed = [row(HIDDEN) for _ in range(2 * LAYERS)]

    def run(folded: bool):
        x, residual = x0, r0  # a layer's input: the last product's output and the residual before it
        for i, p in enumerate(layers):
            for j, (nw, product) in enumerate(((p["n1"], "qkv"), (p["n2"], "mlp"))):
                s, n = sums[2 * i + j], normed[2 * i + j]
                norm = tg.NormFirst(nw, EPS, n, residual, s) if folded else None
                if not folded:
                    launch_rms_norm(x, nw, EPS, n, overlap=True, residual=residual, summed=s)
                source = x if folded else n
                if product == "qkv":
                    tg.launch_gemv(source, [p["q"], p["k"], p["v"]], [None] * 3, qkv, True, norm=norm)
                    tg.launch_gemv(qkv[:Q], p["o"], None, o, True)
                    x = o
                else:
                    tg.launch_gemv_silu_mul(source, p["g"], p["u"], a, True, norm=norm)
                    tg.launch_gemv(a, p["d"], None, d, True)
                    x = d
                residual = s

    print(f"{torch.cuda.get_device_name()}; copy bandwidth {copy:.0f} GB/s; weights {nbytes / 1e9:.3f} GB, byte "
          f"time {nbytes / copy / 1e6:.3f} ms", flush=True)
    finals, graphs = {}, {}
    for name, folded in (("norm launches", False), ("norms in the products", True)):
        run(folded)
        finals[name] = (d.clone(), sums[-1].clone())
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            run(folded)
    times = {name: [] for name in graphs}
    for _ in range(5):
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / 20)
    for name, ts in times.items():
        print(f"{name:>22}: {min(ts):.3f} ms per 36 layers (runs: {', '.join(f'{t:.3f}' for t in ts)}), "
              f"{nbytes / min(ts) / 1e6 / copy * 100:.1f}% of copy", flush=True)
    a_out, b_out = finals["norm launches"], finals["norms in the products"]
    print("last layer's output and residual equal:", bool(torch.equal(a_out[0], b_out[0])),
          bool(torch.equal(a_out[1], b_out[1])), flush=True)


if __name__ == "__main__":
    main()
