"""How far a key bias drifts from its centering mean at long positions (Qwen2-style k_proj bias).

Centering (SPEC §6) subtracts μ_K, the mean key after RoPE, measured on calibration chunks
(positions 0..chunk-1). A constant pre-RoPE bias b becomes R(p)·b at position p, which turns
away from that mean as p grows. This prints |R(p)·b - mean_{p' < chunk} R(p')·b| per layer and KV
head: the part of the bias that centering no longer removes at position p and that the INT2
groups must then cover.

With --spread N the mean is taken as `calibrate --positions spread` takes it: over positions
spread evenly from 0 to N - chunk (the chunk starts; their inner positions add little).

    PYTHONPATH=src python scripts/rope_bias_drift.py MODEL.gguf [--theta 1e6] [--chunk 1024] [--head-dim 128] [--layers 0,1,13,27]
                                      [--spread 32768]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from gguf import GGUFReader

from oscarkv.rope import turn

POSITIONS = (512, 4096, 8192, 16384, 20000, 24000, 28000, 32000)


def rope(vector: np.ndarray, position: int, inverse_frequencies: np.ndarray) -> np.ndarray:
    """`oscarkv.rope.turn` (the rotate-half layout of Hugging Face models) on numpy float64 vectors."""
    return turn(torch.from_numpy(vector), torch.from_numpy(position * inverse_frequencies)).numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gguf")
    parser.add_argument("--theta", type=float, default=1e6, help="RoPE base (Qwen2.5: 1e6)")
    parser.add_argument("--chunk", type=int, default=1024, help="calibration chunk length (positions of μ_K)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", default="0,1,13,27")
    parser.add_argument("--spread", type=int, default=0, help="mean over positions 0..N-chunk (0: over 0..chunk-1)")
    args = parser.parse_args()
    tensors = {t.name: t for t in GGUFReader(args.gguf).tensors}
    for layer in (int(x) for x in args.layers.split(",")):
        bias = np.array(tensors[f"blk.{layer}.attn_k.bias"].data, dtype=np.float64)
        inverse_frequencies = args.theta ** (-np.arange(0, args.head_dim, 2) / args.head_dim)
        for head, b in enumerate(bias.reshape(-1, args.head_dim)):
            if args.spread:
                positions = np.linspace(0, args.spread - args.chunk, 4096).round().astype(int)
            else:
                positions = range(args.chunk)
            mean = np.mean([rope(b, p, inverse_frequencies) for p in positions], axis=0)
            drift = " ".join(f"{p}:{np.linalg.norm(rope(b, p, inverse_frequencies) - mean):.1f}" for p in POSITIONS)
            print(f"layer {layer} kv-head {head} |b|={np.linalg.norm(b):.1f}  residual at position {drift}")


if __name__ == "__main__":
    main()
