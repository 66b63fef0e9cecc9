"""The rotations artifact: safetensors tensors plus a JSON metadata header.

Tensors (float32), per layer i:
    layers.{i}.k_rotation   [d, d]   R_K used at run time ([Hkv, d, d]: one per KV head, where
                                     calibration chose per-head key rotations)
    layers.{i}.v_rotation   [d, d]   R_V used at run time
    layers.{i}.k_eigenvalues [d]     spectrum of C_Q (descending; ones for data-free methods)
    layers.{i}.v_eigenvalues [d]     spectrum of C_S
    layers.{i}.k_mean [Hkv, d], layers.{i}.v_mean [Hkv, d]        centering (SPEC §6), if centered
    layers.{i}.paper_k_rotation, layers.{i}.paper_v_rotation     SPEC §1 rotations, kept for comparison

Metadata key "oscarkv" holds JSON: format version, method, model identity, quantization
settings, calibration provenance, and per layer the chosen transform, clip ratios, bits
and predicted attention-output errors. Loading checks all of it; nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import ArtifactError, OscarError
from ..quant.format import check_inner
from .rotations import check_orthogonal

FORMAT_VERSION = 2  # 2: centering means, per-layer choices and bits (1: rotations only)
METADATA_KEY = "oscarkv"
SIGNATURE_RTOL = 2e-2  # weight norms agree to this between a bf16 and an fp32 load of one model


@dataclass(frozen=True)
class ModelIdentity:
    """What an artifact must match: the attention shapes and a fingerprint of the weights."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    # k_proj weights of the first and last layer projected on a fixed ±1 vector (8 rows each):
    # cheap, robust to bf16/fp32 loading, and unrelated between any two different models.
    weight_signature: tuple[float, ...] = ()

    def mismatch(self, other: ModelIdentity, shapes_only: bool = False) -> str | None:
        """A sentence naming the first difference, or None when `other` is the same model (shapes_only: has the
        same shapes, for a check from the model's config before its weights load)."""
        for name in ("model_type", "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size"):
            if getattr(self, name) != getattr(other, name):
                return f"{name} is {getattr(self, name)!r} in the artifact but {getattr(other, name)!r} in the model"
        if shapes_only:
            return None
        if len(self.weight_signature) != len(other.weight_signature):
            return "the weight fingerprints have different lengths"
        a = torch.tensor(self.weight_signature, dtype=torch.float64)
        b = torch.tensor(other.weight_signature, dtype=torch.float64)
        scale = max(a.pow(2).mean().sqrt().item(), 1e-12)
        if (a - b).abs().max().item() > SIGNATURE_RTOL * scale:
            return "the weights differ (the k_proj fingerprints do not match)"
        return None


OPTIONAL_TENSORS = ("k_mean", "v_mean", "paper_k_rotation", "paper_v_rotation")


def stream_bits(choice: dict, kind: str) -> int:
    """Code width of stream `kind` ("k" or "v") in a layer's choice record. Artifacts from before
    per-stream widths record one "bits" for both streams."""
    return int(choice.get(f"bits_{kind}", choice.get("bits", 2)))


@dataclass
class LayerRotation:
    k_rotation: torch.Tensor  # [d, d], or [Hkv, d, d]: one per KV head (`--key-rotations head`)
    v_rotation: torch.Tensor  # [d, d]
    k_eigenvalues: torch.Tensor  # [d]
    v_eigenvalues: torch.Tensor  # [d]
    k_mean: torch.Tensor | None = None  # [Hkv, d], subtracted from every key before R_K
    v_mean: torch.Tensor | None = None  # [Hkv, d], folded into the v_proj / o_proj biases
    paper_k_rotation: torch.Tensor | None = None
    paper_v_rotation: torch.Tensor | None = None
    # k_transform, v_transform, clip_k, clip_v (at INT2), clip_k_int4, clip_v_int4, bits_k, bits_v,
    # inner_k, inner_v (Lloyd–Max inner levels at INT2, `--levels lloyd`), and predicted errors (see
    # calibration.selection)
    choice: dict = field(default_factory=dict)

    def stream_bits(self, kind: str) -> int:
        """Code width of stream `kind` ("k" or "v"): 2, or 4 where calibration moved it to INT4."""
        return stream_bits(self.choice, kind)

    @property
    def key_bits(self) -> int:
        return self.stream_bits("k")

    @property
    def value_bits(self) -> int:
        return self.stream_bits("v")

    def inner(self, kind: str) -> float | None:
        """The Lloyd–Max inner level of stream `kind` (`quant.format`) where it is stored in INT2 with
        them; None: the uniform grid (also for an INT4 stream)."""
        value = self.choice.get(f"inner_{kind}")
        return None if value is None or self.stream_bits(kind) != 2 else float(value)

    def clip(self, kind: str, default: float) -> float:
        """The clip ratio of stream `kind` ("k" or "v") at its bits: an INT4 stream uses its own
        (`clip_k_int4`; artifacts from before it existed use the INT2 one); `default` where the
        artifact chose none."""
        if self.stream_bits(kind) == 4 and f"clip_{kind}_int4" in self.choice:
            return float(self.choice[f"clip_{kind}_int4"])
        return float(self.choice.get(f"clip_{kind}", default))


@dataclass
class RotationArtifact:
    """Per-layer rotations with their provenance."""

    method: str
    model: ModelIdentity
    layers: list[LayerRotation]
    group_size: int
    clip_ratio_k: float
    clip_ratio_v: float
    calibration: dict = field(default_factory=dict)  # tokens, sources, chunks, budget...
    format_version: int = FORMAT_VERSION

    @property
    def centered(self) -> bool:
        """True when some layer centers its keys or values."""
        return any(layer.k_mean is not None or layer.v_mean is not None for layer in self.layers)

    def metadata(self) -> dict:
        return {
            "format_version": self.format_version,
            "method": self.method,
            "model": asdict(self.model),
            "group_size": self.group_size,
            "clip_ratio_k": self.clip_ratio_k,
            "clip_ratio_v": self.clip_ratio_v,
            "calibration": self.calibration,
            "layers": [layer.choice for layer in self.layers],
        }

    def paper_variant(self) -> RotationArtifact:
        """The SPEC §1-§4 method from the same calibration: paper rotations, no centering, INT2."""
        if all(layer.paper_k_rotation is None for layer in self.layers):
            return self  # already a paper-style artifact (oscar-paper, ktk, vtv, data-free)
        layers = [LayerRotation(layer.paper_k_rotation, layer.paper_v_rotation, layer.k_eigenvalues,
                                layer.v_eigenvalues) for layer in self.layers]
        return RotationArtifact("oscar-paper", self.model, layers, self.group_size, self.clip_ratio_k,
                                self.clip_ratio_v, dict(self.calibration))

    def check_model(self, identity: ModelIdentity, shapes_only: bool = False) -> None:
        problem = self.model.mismatch(identity, shapes_only)
        if problem:
            raise ArtifactError(
                f"This rotations artifact was made for another model: {problem}. "
                "Calibrate one for this model with `oscarkv calibrate MODEL --out rot.safetensors`."
            )

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically: a failure leaves no half-written file at `path`."""
        path = Path(path)
        self._check()
        tensors = {}
        for i, layer in enumerate(self.layers):
            for name in ("k_rotation", "v_rotation", "k_eigenvalues", "v_eigenvalues", *OPTIONAL_TENSORS):
                if getattr(layer, name) is not None:
                    tensors[f"layers.{i}.{name}"] = getattr(layer, name).float().contiguous().clone()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={METADATA_KEY: json.dumps(self.metadata())})
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path

    def _check(self) -> None:
        d = self.model.head_dim
        if len(self.layers) != self.model.num_layers:
            raise ArtifactError(
                f"the artifact has {len(self.layers)} layers but its model has {self.model.num_layers}; "
                "the file is damaged: re-run `oscarkv calibrate`."
            )
        for i, layer in enumerate(self.layers):
            for name in ("k_mean", "v_mean"):
                mean = getattr(layer, name)
                if mean is not None and (tuple(mean.shape) != (self.model.num_kv_heads, d)
                                         or not torch.isfinite(mean).all()):
                    raise ArtifactError(
                        f"layers.{i}.{name} has shape {tuple(mean.shape)} or non-finite values, expected finite "
                        f"({self.model.num_kv_heads}, {d}); re-run `oscarkv calibrate`."
                    )
            for kind in ("k", "v"):
                if layer.stream_bits(kind) not in (2, 4):
                    raise ArtifactError(f"layers.{i} asks for {layer.stream_bits(kind)} bits for its {kind} stream; "
                                        "only 2 and 4 exist. Re-run `oscarkv calibrate`.")
                try:
                    check_inner(layer.inner(kind))
                except (OscarError, TypeError, ValueError) as exc:
                    raise ArtifactError(f"layers.{i} has an unusable inner level for its {kind} stream ({exc}); "
                                        "re-run `oscarkv calibrate`.") from None
            for name in ("k_rotation", "v_rotation", "paper_k_rotation", "paper_v_rotation"):
                r = getattr(layer, name)
                if r is None:
                    continue
                shapes = [(d, d)] + ([(self.model.num_kv_heads, d, d)] if name == "k_rotation" else [])
                if tuple(r.shape) not in shapes:
                    expected = " or ".join(str(s) for s in shapes)
                    raise ArtifactError(
                        f"layers.{i}.{name} has shape {tuple(r.shape)}, expected {expected}; "
                        "re-run `oscarkv calibrate`."
                    )
                if not torch.isfinite(r).all():
                    raise ArtifactError(f"layers.{i}.{name} holds non-finite values; re-run `oscarkv calibrate`.")
                check_orthogonal(r, f"layers.{i}.{name}")

    @classmethod
    def load(cls, path: str | os.PathLike) -> RotationArtifact:
        """Read and validate an artifact (shapes, orthogonality, format version)."""
        path = Path(path)
        if not path.is_file():
            raise ArtifactError(f"rotations file {str(path)!r} does not exist; create it with `oscarkv calibrate`.")
        try:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                header = handle.metadata() or {}
            tensors = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ArtifactError(
                f"{str(path)!r} is not a readable safetensors file ({exc}); it is corrupt or truncated: "
                "re-run `oscarkv calibrate`."
            ) from exc
        if METADATA_KEY not in header:
            raise ArtifactError(
                f"{str(path)!r} has no oscarkv metadata: it is not an oscarkv rotations artifact. "
                "Create one with `oscarkv calibrate MODEL --out FILE`."
            )
        try:
            meta = json.loads(header[METADATA_KEY])
            version = int(meta["format_version"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ArtifactError(f"{str(path)!r} has an unreadable metadata header ({exc}); re-run `oscarkv calibrate`.")
        if version != FORMAT_VERSION:
            older = " (it has no centering means or per-layer choices)" if version < FORMAT_VERSION else ""
            raise ArtifactError(
                f"{str(path)!r} has artifact format version {version}{older}; this oscarkv reads version "
                f"{FORMAT_VERSION}. Re-calibrate: `oscarkv calibrate MODEL --out {path.name}`."
            )
        try:
            model = meta["model"]
            identity = ModelIdentity(**{**model, "weight_signature": tuple(model["weight_signature"])})
            choices = meta.get("layers") or [{} for _ in range(identity.num_layers)]
            layers = [
                LayerRotation(
                    tensors[f"layers.{i}.k_rotation"],
                    tensors[f"layers.{i}.v_rotation"],
                    tensors[f"layers.{i}.k_eigenvalues"],
                    tensors[f"layers.{i}.v_eigenvalues"],
                    **{name: tensors.get(f"layers.{i}.{name}") for name in OPTIONAL_TENSORS},
                    choice=dict(choices[i]),
                )
                for i in range(identity.num_layers)
            ]
            artifact = cls(
                method=meta["method"],
                model=identity,
                layers=layers,
                group_size=int(meta["group_size"]),
                clip_ratio_k=float(meta["clip_ratio_k"]),
                clip_ratio_v=float(meta["clip_ratio_v"]),
                calibration=meta.get("calibration", {}),
                format_version=version,
            )
        except (KeyError, TypeError, IndexError) as exc:
            raise ArtifactError(
                f"{str(path)!r} is missing {exc} in its tensors or metadata; it is truncated or damaged: "
                "re-run `oscarkv calibrate`."
            ) from exc
        artifact._check()
        return artifact
