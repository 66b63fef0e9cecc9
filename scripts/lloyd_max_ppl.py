"""OSCAR+ ablation, measured: held-out perplexity with a Lloyd–Max style 4-level INT2 codebook.

The uniform INT2 grid reads code c of a group back as lo + c·s, s = (max - min)/3 after the clip:
the levels sit at t = 0, 1/3, 2/3, 1 of the range. The Lloyd–Max codebook of a bell-shaped group
moves the two inner levels: t = 0, a, 1 - a, 1 (`scripts/lloyd_max_levels.py` predicted the gain
from the calibration's own error measure). This script measures it: it swaps the reference
history store's quantizer for one that rounds each element to the nearest of those four levels
(same scale and zero, same bits) and reads codes back at them, for keys and values alike, then
runs `oscarkv eval ppl` with the same artifact, text and positions for each a. a = 1/3 is the
product's quantizer. The kernels are not involved (CPU, reference cache). The product has the
levels since (`oscarkv calibrate --levels lloyd`, per layer and stream); this script keeps the one
global a of the first measurement, applied over whatever the artifact chose.

    PYTHONPATH=src python scripts/lloyd_max_ppl.py smollm2-135m --rotations s.safetensors \
        --inner 0.3333333,0.30,0.36,0.40 --text news --context 2048 --group-size 64 --max-tokens 20000
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import torch

from oscarkv.cache import history
from oscarkv.cli import main as cli_main
from oscarkv.quant import format as qformat


def _levels(inner: float) -> torch.Tensor:
    """The four levels in code units (uniform: 0, 1, 2, 3)."""
    return torch.tensor([0.0, 3 * inner, 3 - 3 * inner, 3.0])


def quantizer(inner: float):
    levels = _levels(inner)
    midpoints = (levels[1:] + levels[:-1]) / 2

    def quantize(x, bits=2, group_size=128, clip_ratio=0.0, scale_dtype=torch.float16, artifact_inner=None):
        # artifact_inner: the artifact's own levels (`calibrate --levels lloyd`); this script overrides them
        q = qformat.quantize(x, bits, group_size, clip_ratio, scale_dtype)  # the scale and zero
        if bits != 2:
            return q
        d = x.shape[-1]
        groups = qformat.clip_rows(x.float(), clip_ratio).reshape(*x.shape[:-1], d // group_size, group_size)
        y = groups * (1.0 / q.scale.float()).unsqueeze(-1) + q.zero.float().unsqueeze(-1)
        codes = (y.unsqueeze(-1) > midpoints.to(y.device)).sum(-1).to(torch.uint8).reshape(*x.shape[:-1], d)
        return qformat.QuantizedTensor(qformat.pack_codes(codes, 2), q.scale, q.zero, group_size, x.dtype, 2)

    def dequantize(q, dtype=None):
        if q.bits != 2:
            return qformat.dequantize(q, dtype)
        codes = qformat.unpack_codes(q.packed, 2).long()
        d = codes.shape[-1]
        values = levels.to(q.scale.device)[codes].reshape(*codes.shape[:-1], d // q.group_size, q.group_size)
        x = (values - q.zero.float().unsqueeze(-1)) * q.scale.float().unsqueeze(-1)
        return x.reshape(*codes.shape[:-1], d).to(dtype or q.dtype)

    return quantize, dequantize


def run_eval(argv: list[str]) -> list[dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(argv)
    if code:
        raise SystemExit(f"eval ppl failed: {out.getvalue()}")
    return [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rotations", required=True)
    parser.add_argument("--inner", default="0.3333333,0.30,0.36,0.40")
    parser.add_argument("--text", default="news")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=20000)
    parser.add_argument("--max-bits", default=None, help="passed to eval ppl (0: every stream in INT2)")
    args = parser.parse_args()
    base = ["eval", "ppl", args.model, "--rotations", args.rotations, "--text", args.text, "--context",
            str(args.context), "--group-size", str(args.group_size), "--max-tokens", str(args.max_tokens), "--json"]
    if args.max_bits is not None:
        base += ["--max-bits", args.max_bits]
    bf16 = run_eval(base + ["--methods", "bf16"])[0]
    print(json.dumps(bf16), flush=True)
    saved = history.quantize, history.dequantize
    try:
        for inner in (float(a) for a in args.inner.split(",")):
            history.quantize, history.dequantize = quantizer(inner)
            row = run_eval(base + ["--methods", "oscar"])[0]
            row.update(inner_level=round(inner, 4), ppl_ratio=row["ppl"] / bf16["ppl"])
            print(json.dumps(row), flush=True)
    finally:
        history.quantize, history.dequantize = saved


if __name__ == "__main__":
    main()
