"""Which half of the INT2 history costs needle retrieval: the keys or the values?

Runs `oscarkv eval niah`'s cases for method `oscar` through the reference cache three times:
both streams in INT2 (the product), keys INT2 with values kept in the window dtype, and values
INT2 with keys kept in the window dtype. A developer diagnostic, not a product option: it
replaces one history store of every layer with a full-precision one.

    PYTHONPATH=src python scripts/niah_kv_ablation.py smollm2-135m --rotations rot.safetensors \
        --lengths 2048,4096 --depths 0.25,0.5,0.75 --trials 6 --group-size 64

With --int4-keys 0-30,15-30 it runs instead one variant per layer range [lo, hi): the keys of those
layers in INT4 (at the layer's calibrated INT4 key clip), everything else in INT2 (the artifact's
INT4 fallback layers included), so that the only extra bits are those keys. This simulates a
per-stream bit width, which the format does not have yet.
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


def int4_keys(layers: range, artifact: RotationArtifact):
    """Make the OscarLayers of `layers` store their history keys in INT4 at the artifact's INT4 key clip."""

    def init(self, key_states, value_states):
        ORIGINAL_INIT(self, key_states, value_states)
        index = next(i for i, layer in enumerate(self.owner.layers) if layer is self)
        if index in layers:
            quant = self.spec.quant
            clip = artifact.layers[index].choice.get("clip_k_int4", quant.clip_ratio_k)
            self.history_k = HistoryStore(True, quant.group_size, clip, quant.scale_dtype, self.config.window_dtype, 4)

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
    parser.add_argument("--int4-keys", default=None,
                        help="layer ranges lo-hi (comma-separated) whose keys go to INT4, one variant each")
    args = parser.parse_args()
    artifact = RotationArtifact.load(args.rotations)
    model, tokenizer = load_model(args.model, device=args.device)
    quant = QuantConfig(args.group_size or artifact.group_size, artifact.clip_ratio_k, artifact.clip_ratio_v)
    cache = CacheConfig(kernel="reference")
    cases = build_cases(tokenizer, load_text(args.text), [int(x) for x in args.lengths.split(",")],
                        [float(x) for x in args.depths.split(",")], args.trials, cache,
                        required_bos(model, tokenizer), 0)
    if args.int4_keys:
        for layer in artifact.layers:  # the chosen keys are the only INT4 streams
            layer.choice["bits"] = 2
        variants = []
        for span in args.int4_keys.split(","):
            lo, hi = (int(x) for x in span.split("-"))
            variants.append((f"keys INT4 on layers {lo}-{hi - 1}", lambda r=range(lo, hi): int4_keys(r, artifact)))
    else:
        variants = [(label, lambda stream=stream: keep_full_precision(stream))
                    for label, stream in (("keys and values INT2", None), ("keys INT2, values full", "v"),
                                          ("values INT2, keys full", "k"))]
    for label, patch in variants:
        patch()
        for row in summarise(evaluate_niah(model, tokenizer, cases, ["oscar"], quant, cache, artifact)):
            print(json.dumps(dict(row, variant=label)), flush=True)


if __name__ == "__main__":
    main()
