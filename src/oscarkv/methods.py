"""KV-cache methods on one machinery: the BF16 baseline, naive INT2, Hadamard INT2 and OSCAR.

Every method is (rotations, quantization, cache layout); they differ only in the first
and in whether the history is quantized, so comparisons are like for like.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .calibration.artifact import LayerRotation, RotationArtifact
from .calibration.rotations import hadamard
from .config import CacheConfig, QuantConfig
from .errors import OscarError
from .models import attention_shape, model_identity

METHODS = ("bf16", "oscar", "oscar-paper", "naive", "hadamard", "kivi2", "int4", "fp8", "turboquant3")
ARTIFACT_METHODS = ("oscar", "oscar-paper")  # the methods that read a calibrated rotations artifact
# What `oscarkv serve` runs: the token-grouped INT methods on the paged cache, bf16 on the dense one.
SERVE_METHODS = ("oscar", "oscar-paper", "naive", "hadamard", "int4", "bf16")
DESCRIPTIONS = {
    "bf16": "BF16 cache everywhere (the reference)",
    "oscar": "the artifact as calibrated: centering, per-layer transform and clip, INT4 where the budget put it",
    "oscar-paper": "SPEC §1-§4 exactly: paper rotations, no centering, INT2 everywhere",
    "naive": "no rotation, INT2 history",
    "hadamard": "Walsh-Hadamard rotation of K and V (QuaRot-style), INT2 history",
    "kivi2": "KIVI-2: no rotation, keys per channel over token groups, values per token, no clipping "
             "(group = --group-size, so the bits equal the other INT2 methods')",
    "int4": "Walsh-Hadamard rotation, INT4 history (per-token asymmetric groups, no clipping)",
    "fp8": "FP8 e4m3 history with unit scales (saturating at ±448), no rotation",
    "turboquant3": "vLLM's turboquant_3bit_nc: Hadamard-rotated unit keys on 8 Lloyd-Max centroids + fp16 norm, "
                   "3-bit per-token values; first 2 and last 2 layers uncompressed (~3.2-3.4 bits)",
}


BOUNDARY_LAYERS = 2  # turboquant3: the first and last layers vLLM keeps uncompressed


def data_free_artifact(model, method: str, quant: QuantConfig) -> RotationArtifact:
    """Rotations that need no calibration: `identity` or `hadamard`, for every layer."""
    shape = attention_shape(model)
    d = shape.head_dim
    if method == "identity":
        rotation = torch.eye(d)
    elif method == "hadamard":
        rotation = hadamard(d, torch.float32)
    else:
        raise OscarError(f"{method!r} is not a data-free method (identity, hadamard).")
    ones = torch.ones(d)
    layers = [LayerRotation(rotation.clone(), rotation.clone(), ones, ones) for _ in range(shape.num_layers)]
    return RotationArtifact(method, model_identity(model), layers, quant.group_size, quant.clip_ratio_k,
                            quant.clip_ratio_v, calibration={"tokens": 0, "sources": []})


@dataclass
class MethodSetup:
    name: str
    artifact: RotationArtifact
    quant: QuantConfig
    cache: CacheConfig


def method_setup(name: str, model, quant: QuantConfig, cache: CacheConfig,
                 artifact: RotationArtifact | None = None) -> MethodSetup:
    """The artifact and configs that realise method `name` on `model` (`check_methods` first)."""
    check_methods([name], artifact is not None)
    if name == "bf16":
        return MethodSetup(name, data_free_artifact(model, "identity", quant), quant,
                           replace(cache, quantize_history=False))
    if name == "naive":
        return MethodSetup(name, data_free_artifact(model, "identity", quant), quant, cache)
    if name == "hadamard":
        return MethodSetup(name, data_free_artifact(model, "hadamard", quant), quant, cache)
    if name == "kivi2":
        return MethodSetup(name, data_free_artifact(model, "identity", quant),
                           replace(quant, clip_ratio_k=0.0, clip_ratio_v=0.0), replace(cache, key_grouping="channel"))
    if name == "int4":
        artifact = data_free_artifact(model, "hadamard", quant)
        for layer in artifact.layers:
            layer.choice = {"bits_k": 4, "bits_v": 4, "clip_k": 0.0, "clip_v": 0.0}
        return MethodSetup(name, artifact, quant, cache)
    if name == "turboquant3":
        artifact = data_free_artifact(model, "identity", quant)
        layers = len(artifact.layers)
        for i, layer in enumerate(artifact.layers):  # vLLM's boundary protection of dense models
            if i < BOUNDARY_LAYERS or i >= layers - BOUNDARY_LAYERS:
                layer.choice = {"plain_history": True}
        return MethodSetup(name, artifact, quant, replace(cache, history_format="turboquant3"))
    if name == "fp8":
        return MethodSetup(name, data_free_artifact(model, "identity", quant), quant,
                           replace(cache, quantize_history=False, history_dtype=torch.float8_e4m3fn))
    if name in ARTIFACT_METHODS:
        return MethodSetup(name, artifact if name == "oscar" else artifact.paper_variant(), quant, cache)
    raise AssertionError(f"method {name!r} is in METHODS but has no setup here")


ARTIFACT_ARGUMENT = "pass rotations=FILE (a path or a RotationArtifact)"  # the Python API's; the CLI's: --rotations


def check_methods(names: list[str], have_artifact: bool, how: str = ARTIFACT_ARGUMENT) -> None:
    """Refuse a method list that cannot run, before anything loads: no method, an unknown name, or a method
    that reads a rotations artifact (ARTIFACT_METHODS) when none is given (`how` says how to give one)."""
    if not names:
        raise OscarError(f"no method given; choose from {', '.join(METHODS)}.")
    unknown = [name for name in names if name not in METHODS]
    if unknown:
        raise OscarError(f"unknown method{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(METHODS)}.")
    needing = [name for name in names if name in ARTIFACT_METHODS]
    if needing and not have_artifact:
        verb = "need" if len(needing) > 1 else "needs"
        raise OscarError(f"method{'s' * (len(needing) > 1)} {', '.join(map(repr, needing))} {verb} a rotations "
                         f"artifact: {how} (make one with `oscarkv calibrate MODEL --out FILE`).")


def method_setups(names: list[str], model, quant: QuantConfig, cache: CacheConfig,
                  artifact: RotationArtifact | None = None) -> list[MethodSetup]:
    """Every method's setup, made before any of them runs, so that an evaluation of several methods fails at
    its start, not after the first ones' work: `check_methods`, and an artifact made for another model."""
    check_methods(names, artifact is not None)
    if artifact is not None and any(name in ARTIFACT_METHODS for name in names):
        artifact.check_model(model_identity(model))
    return [method_setup(name, model, quant, cache, artifact) for name in names]
