"""Which half of the INT2 history costs needle retrieval: the keys or the values?

Runs `oscarkv eval niah`'s cases for method `oscar` through the reference cache three times:
both streams in INT2 (the product), keys INT2 with values kept in the window dtype, and values
INT2 with keys kept in the window dtype. A developer diagnostic, not a product option: it
replaces one history store of every layer with a full-precision one.

    PYTHONPATH=src python scripts/niah_kv_ablation.py smollm2-135m --rotations rot.safetensors \
        --lengths 2048,4096 --depths 0.25,0.5,0.75 --trials 6 --group-size 64
"""

from __future__ import annotations

import argparse
import json

from oscarkv.assets import load_text
from oscarkv.cache import mixed
from oscarkv.cache.history import HistoryStore
from oscarkv.calibration.artifact import RotationArtifact
from oscarkv.config import CacheConfig, QuantConfig
from oscarkv.evaluation.niah import build_cases, evaluate_niah, summarise
from oscarkv.models import load_model, required_bos

ORIGINAL_INIT = mixed.OscarLayer.lazy_initialization


def keep_full_precision(stream: str | None):
    """Make every OscarLayer keep `stream` ("k" or "v") of its history unquantized (None: neither)."""

    def init(self, key_states, value_states):
        ORIGINAL_INIT(self, key_states, value_states)
        if stream is not None:
            quant = self.spec.quant
            setattr(self, f"history_{stream}", HistoryStore(False, quant.group_size, 0.0, quant.scale_dtype,
                                                            self.config.window_dtype))

    mixed.OscarLayer.lazy_initialization = init


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rotations", required=True)
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--depths", default="0.25,0.5,0.75")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--text", default="news")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    artifact = RotationArtifact.load(args.rotations)
    model, tokenizer = load_model(args.model, device=args.device)
    quant = QuantConfig(args.group_size or artifact.group_size, artifact.clip_ratio_k, artifact.clip_ratio_v)
    cache = CacheConfig(kernel="reference")
    cases = build_cases(tokenizer, load_text(args.text), [int(x) for x in args.lengths.split(",")],
                        [float(x) for x in args.depths.split(",")], args.trials, cache,
                        required_bos(model, tokenizer), 0)
    for label, stream in (("keys and values INT2", None), ("keys INT2, values full", "v"),
                          ("values INT2, keys full", "k")):
        keep_full_precision(stream)
        for row in summarise(evaluate_niah(model, tokenizer, cases, ["oscar"], quant, cache, artifact)):
            print(json.dumps(dict(row, variant=label)), flush=True)


if __name__ == "__main__":
    main()
