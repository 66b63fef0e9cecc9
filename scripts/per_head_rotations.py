"""OSCAR+ ablation, predicted: one rotation per KV head instead of one per layer.

(The product option that followed, `oscarkv calibrate --key-rotations head`, is measured in
docs/accuracy.md; this script keeps the first prediction reproducible.)

Runs the product calibration (`oscarkv calibrate`'s method oscar) and, on the same held-apart
tokens and with the same per-layer picks (centering, clip ratio), scores the OSCAR rotations
built from each KV head's own statistics (C_Q of its query group for R_K, its C_S for R_V)
against the layer's pooled ones. The score is the calibration's: the relative error of the
attention output with the keys (or values) read back from INT2, over the queries that read
history. Only layers whose pick is the OSCAR transform are compared (for identity or Hadamard
picks a per-head OSCAR rotation is a different candidate, reported separately).

    PYTHONPATH=src python scripts/per_head_rotations.py smollm2-135m --group-size 64 --max-chunks 8
"""

from __future__ import annotations

import argparse

import torch

from oscarkv import QuantConfig
from oscarkv.assets import load_text
from oscarkv.calibration import calibrate as calibrate_module
from oscarkv.calibration.calibrate import CalibrationConfig, calibrate
from oscarkv.calibration.rotations import compose_rotation, sorted_eigh
from oscarkv.calibration.selection import LayerScorer, roundtrip
from oscarkv.config import CacheConfig
from oscarkv.models import load_model, required_bos


def per_head_rotations(covariances: torch.Tensor) -> torch.Tensor:
    """[Hkv, d, d] covariances -> [Hkv, d, d] OSCAR rotations (eigenvectors, Hadamard, bit reversal)."""
    return torch.stack([compose_rotation(*reversed(sorted_eigh(c))) for c in covariances]).double()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--text", default="wiki")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--max-chunks", type=int, default=8)
    parser.add_argument("--clip-grid-k", default="0,0.96")
    parser.add_argument("--clip-grid-v", default="0,0.92")
    args = parser.parse_args()

    model, tokenizer = load_model(args.model)
    per_head: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    rows = []
    original_rotations = calibrate_module._layer_rotations
    original_choose = calibrate_module.choose_layer
    layer_of = {}

    def layer_rotations(stats, method):
        layer = original_rotations(stats, method)
        index = len(layer_of)
        layer_of[id(layer)] = index
        per_head[index] = (per_head_rotations(stats.query_covariance()),
                           per_head_rotations(stats.score_weighted_value_covariance(centered=True)))
        return layer

    def choose(layer, q, k, v, quant, cache, sliding, grid_k, grid_v, head_k_rotation=None):
        k_mean, v_mean = layer.k_mean, layer.v_mean
        choice = original_choose(layer, q, k, v, quant, cache, sliding, grid_k, grid_v, head_k_rotation)
        index = layer_of[id(layer)]
        scorer = LayerScorer(q, k, v, cache.sink_tokens, cache.recent_tokens, quant.group_size, sliding)
        rk, rv = per_head[index]
        row = {"layer": index}
        for kind, rotation, mean, stream in (("k", rk, k_mean, scorer.k), ("v", rv, v_mean, scorer.v)):
            centered = choice[f"{kind}_centered"]
            clip = choice[f"clip_{kind}"]
            read_back = roundtrip(stream, mean if centered else None, rotation, 2, quant.group_size, clip)
            error = scorer._error(read_back, scorer.v) if kind == "k" else scorer._error(scorer.k, read_back)
            pooled_oscar = choice[f"candidates_{kind}"][f"{'c' if centered else 'u'}:oscar@{clip:g}"]
            row[kind] = (choice[f"{kind}_transform"], pooled_oscar, error, choice[f"error_{kind}"])
        rows.append(row)
        return choice

    calibrate_module._layer_rotations = layer_rotations
    calibrate_module.choose_layer = choose
    text = load_text(args.text)
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    grid = lambda s: tuple(float(x) for x in s.split(","))  # noqa: E731
    config = CalibrationConfig(max_chunks=args.max_chunks, max_bits=0, clip_grid_k=grid(args.clip_grid_k),
                               clip_grid_v=grid(args.clip_grid_v))
    calibrate(model, ids, QuantConfig(group_size=args.group_size), config, cache=CacheConfig(),
              bos_id=required_bos(model, tokenizer))

    print(f"{args.model}, group {args.group_size}: predicted INT2 attention-output error (held-apart tokens)")
    print("layer  K pick      K pooled-oscar  K per-head-oscar   V pick      V pooled-oscar  V per-head-oscar")
    totals = {"k": [0.0, 0.0, 0.0, 0.0], "v": [0.0, 0.0, 0.0, 0.0]}
    for row in sorted(rows, key=lambda r: r["layer"]):
        cells = []
        for kind in ("k", "v"):
            pick, pooled, head, best = row[kind]
            totals[kind][0] += pooled
            totals[kind][1] += head
            totals[kind][2] += best
            totals[kind][3] += min(best, head)
            cells.append(f"{pick:10s}  {pooled:14.3e}  {head:16.3e}")
        print(f"{row['layer']:5d}  " + "   ".join(cells))
    for kind in ("k", "v"):
        pooled, head, best, either = totals[kind]
        print(f"sum over layers, {kind.upper()}: pooled oscar {pooled:.4e}, per-head oscar {head:.4e} "
              f"({head / pooled - 1:+.1%}); the layer's pick {best:.4e}, with per-head oscar as one more "
              f"candidate {either:.4e} ({either / best - 1:+.1%})")


if __name__ == "__main__":
    main()
