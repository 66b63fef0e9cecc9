"""EXPERIMENT (GPU): the batch-1 history programs prefetch the weights of the layer's next products
(o_proj, then the first rows of gate/up) into L2 while the attention leaves DRAM bandwidth unused.

    PYTHONPATH=src:scripts python scripts/probe_l2_prefetch.py
"""
from __future__ import annotations

import math
import sys

import torch

from oscarkv.benchmarks.attention import copy_bandwidth_gbs
from oscarkv.benchmarks.decode import decode_run, weight_bytes
from oscarkv.integrations import decode_attention
from oscarkv.kernels import triton_attention as ta
from oscarkv.models import load_model

CHUNK_LINE = 128


def table(regions, lines: int) -> torch.Tensor:
    chunk = 32 * lines * CHUNK_LINE
    addresses = []
    for tensor, nbytes in regions:
        base = tensor.data_ptr()
        nbytes = min(nbytes, tensor.numel() * tensor.element_size())
        addresses += [base + k * chunk for k in range(math.ceil(nbytes / chunk))]
    return torch.tensor(addresses, dtype=torch.int64, device="cuda")


def main() -> None:
    model, _ = load_model("random:qwen3-4b", device="cuda", dtype=torch.bfloat16)
    copy_gbs = copy_bandwidth_gbs(torch.device("cuda"))
    weights = weight_bytes(model)
    print(torch.cuda.get_device_name(), f"copy {copy_gbs:.0f} GB/s", flush=True)
    layers = model.model.layers
    current = {}
    original = decode_attention._forward

    def forward(module, norms, previous, *args, **kwargs):
        ta._NEXT_PREFETCH = current.get(module.layer_idx)
        try:
            return original(module, norms, previous, *args, **kwargs)
        finally:
            ta._NEXT_PREFETCH = None

    decode_attention._forward = forward
    mb = 1 << 20
    contexts = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "100000,30000").split(",")]
    for context in contexts:
        slots = 8 * math.ceil((context - 320) / 64)

        def plan(mlp_mb: int, last: bool):
            def use():
                current.clear()
                if mlp_mb < 0:
                    return
                for i, layer in enumerate(layers):
                    o = layer.self_attn.o_proj.weight
                    regions = [(o, o.numel() * 2), (layer.mlp.gate_proj.weight, mlp_mb * mb),
                               (layer.mlp.up_proj.weight, mlp_mb * mb)]
                    total = sum(min(n, t.numel() * 2) for t, n in regions)
                    lines = 1 << max(0, math.ceil(math.log2(total / (slots * 32 * CHUNK_LINE))))
                    current[i] = (table(regions, lines), lines, last)
            return use

        variants = {"none": plan(-1, True), "o_proj last": plan(0, True), "o+8+8 last": plan(8, True),
                    "o+12+12 last": plan(12, True), "o+8+8 normal": plan(8, False)}
        times = {k: [] for k in variants}
        for _ in range(3):
            for name, use in variants.items():
                use()
                times[name].append(decode_run(model, "int2", 1, context, 48, weights, copy_gbs).step_ms)
        print(f"1 x {context}: " + "; ".join(f"{k}: " + ", ".join(f"{t:.3f}" for t in v) for k, v in times.items()),
              flush=True)


if __name__ == "__main__":
    main()
