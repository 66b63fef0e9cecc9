"""OSCAR+ ablation, predicted: a non-uniform (Lloyd–Max style) 4-level INT2 codebook.

The uniform INT2 grid puts its four levels at min + t·(max - min), t = 0, 1/3, 2/3, 1, of each
group (after the clip). A Lloyd–Max codebook for a bell-shaped group moves the inner two levels
outwards or inwards: t = 0, a, 1 - a, 1. This script runs the product calibration and, on its
held-apart tokens with each layer's picks (centering, transform), scores every (a, clip) pair
with the calibration's own measure: the relative error of the attention output with the keys
(or the values) read back from INT2, over the queries that read history. a = 1/3 is the uniform
grid, so the best uniform and the best non-uniform codebook are compared on the same clip grid.

    PYTHONPATH=src python scripts/lloyd_max_levels.py smollm2-135m --group-size 64 --max-chunks 8
"""

from __future__ import annotations

import argparse

import torch

from oscarkv import QuantConfig
from oscarkv.assets import load_text
from oscarkv.calibration import calibrate as calibrate_module
from oscarkv.calibration.calibrate import CalibrationConfig, calibrate
from oscarkv.calibration.selection import LayerScorer
from oscarkv.config import CacheConfig
from oscarkv.models import load_model, required_bos
from oscarkv.quant.format import clip_rows

UNIFORM = 1 / 3


def roundtrip_levels(x: torch.Tensor, mean: torch.Tensor | None, rotation: torch.Tensor, group_size: int,
                     clip: float, inner: float) -> torch.Tensor:
    """x [Hkv, T, d] read back from 4 levels at min + t·(max - min), t = 0, inner, 1 - inner, 1."""
    rotation = rotation.to(x.dtype)
    centered = x - mean.to(x.dtype)[:, None, :] if mean is not None else x
    rotated = clip_rows(centered @ rotation, clip)
    groups = rotated.reshape(*rotated.shape[:-1], -1, group_size)
    lo = groups.amin(-1, keepdim=True)
    span = (groups.amax(-1, keepdim=True) - lo).clamp(min=1e-8)
    levels = torch.tensor([0.0, inner, 1.0 - inner, 1.0], dtype=x.dtype)
    nearest = ((groups - lo) / span).unsqueeze(-1).sub(levels).abs().argmin(-1)
    restored = (lo + levels[nearest] * span).reshape(rotated.shape) @ rotation.transpose(-1, -2)
    return restored + mean.to(x.dtype)[:, None, :] if mean is not None else restored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--text", default="wiki")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--max-chunks", type=int, default=8)
    parser.add_argument("--inner", default="0.25,0.29,0.3333333,0.36,0.4",
                        help="inner level positions a to try (1/3 = the uniform grid)")
    args = parser.parse_args()
    inners = [float(a) for a in args.inner.split(",")]
    if not any(abs(a - UNIFORM) < 1e-6 for a in inners):
        inners.append(UNIFORM)

    model, tokenizer = load_model(args.model)
    rows = []
    original_choose = calibrate_module.choose_layer

    def choose(layer, q, k, v, quant, cache, sliding, grid_k, grid_v, head_k_rotation=None):
        means = {"k": layer.k_mean, "v": layer.v_mean}
        choice = original_choose(layer, q, k, v, quant, cache, sliding, grid_k, grid_v, head_k_rotation)
        scorer = LayerScorer(q, k, v, cache.sink_tokens, cache.recent_tokens, quant.group_size, sliding)
        row = {"layer": len(rows)}
        for kind, grid, stream in (("k", grid_k, scorer.k), ("v", grid_v, scorer.v)):
            mean = means[kind] if choice[f"{kind}_centered"] else None
            rotation = getattr(layer, f"{kind}_rotation").float()
            scores = {}
            for inner in inners:
                for clip in grid:
                    back = roundtrip_levels(stream, mean, rotation, quant.group_size, clip, inner)
                    scores[(inner, clip)] = (scorer._error(back, scorer.v) if kind == "k"
                                             else scorer._error(scorer.k, back))
            uniform = min(e for (a, _), e in scores.items() if abs(a - UNIFORM) < 1e-6)
            (inner, clip), best = min(scores.items(), key=lambda item: item[1])
            row[kind] = (uniform, best, inner, clip)
        rows.append(row)
        return choice

    calibrate_module.choose_layer = choose
    ids = tokenizer(load_text(args.text), return_tensors="pt").input_ids[0]
    config = CalibrationConfig(max_chunks=args.max_chunks, max_bits=0)
    calibrate(model, ids, QuantConfig(group_size=args.group_size), config, cache=CacheConfig(),
              bos_id=required_bos(model, tokenizer))

    print(f"{args.model}, group {args.group_size}: predicted INT2 attention-output error (held-apart tokens), "
          f"best over the clip grid; inner levels tried: {', '.join(f'{a:.3f}' for a in inners)}")
    print("layer  K uniform   K best      a     clip   V uniform   V best      a     clip")
    totals = {"k": [0.0, 0.0], "v": [0.0, 0.0]}
    for row in rows:
        cells = []
        for kind in ("k", "v"):
            uniform, best, inner, clip = row[kind]
            totals[kind][0] += uniform
            totals[kind][1] += best
            cells.append(f"{uniform:9.3e}  {best:9.3e}  {inner:5.3f}  {clip:4g}")
        print(f"{row['layer']:5d}  " + "   ".join(cells))
    for kind in ("k", "v"):
        uniform, best = totals[kind]
        print(f"sum over layers, {kind.upper()}: uniform {uniform:.4e}, best codebook per layer {best:.4e} "
              f"({best / uniform - 1:+.1%})")


if __name__ == "__main__":
    main()
