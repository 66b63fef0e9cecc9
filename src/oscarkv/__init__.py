"""oscarkv: a 2-bit KV cache for LLMs with offline spectral covariance-aware rotations (OSCAR).

Data flow: calibrate -> rotations artifact -> patch model -> write path -> read path.

    model, tokenizer = oscarkv.load("smollm2-135m", rotations="rot.safetensors")
    model.generate(**tokenizer("Hello", return_tensors="pt"), max_new_tokens=20)
"""

from __future__ import annotations

from .config import CacheConfig, QuantConfig
from .errors import ArtifactError, CalibrationError, OscarError, UnsupportedModelError
from .quant import Int2Tensor, cache_bits_per_element, dequantize_int2, int2_bits_per_element, quantize_int2

__version__ = "0.1.0"


def _artifact(rotations):
    """A `RotationArtifact` from a path (loaded and checked) or as given (None or an artifact)."""
    from .calibration.artifact import RotationArtifact

    if isinstance(rotations, (str, bytes)) or hasattr(rotations, "__fspath__"):
        return RotationArtifact.load(rotations)
    return rotations


def patch(model, rotations=None, method: str = "oscar", quant: QuantConfig | None = None,
          cache: CacheConfig | None = None):
    """Patch a loaded transformers model in place so its KV cache is stored by `method`.

    rotations: path to an artifact or a `RotationArtifact` (required for method 'oscar').
    method: 'oscar', 'naive', 'hadamard' or 'bf16'. Returns the model.
    """
    from .integrations.transformers import patch_model
    from .methods import method_setup

    artifact = _artifact(rotations)
    if quant is None and artifact is not None:
        quant = QuantConfig(artifact.group_size, artifact.clip_ratio_k, artifact.clip_ratio_v)
    elif quant is None:
        from .models import attention_shape

        quant = QuantConfig.for_head_dim(attention_shape(model).head_dim)
    setup = method_setup(method, model, quant, cache or CacheConfig(), artifact)
    return patch_model(model, setup.artifact, setup.quant, setup.cache)


def load(model: str, rotations=None, method: str = "oscar", quant: QuantConfig | None = None,
         cache: CacheConfig | None = None, device=None, dtype=None):
    """Load MODEL (alias, HF directory or GGUF) and patch it. Returns (model, tokenizer).

    The method and the artifact are checked against the model's config before its weights load (the
    weights' fingerprint after)."""
    from .methods import check_methods
    from .models import check_artifact_shapes, load_model, model_config

    artifact = _artifact(rotations)
    check_methods([method], artifact is not None)
    check_artifact_shapes(artifact, model_config(model))
    hf_model, tokenizer = load_model(model, device=device, dtype=dtype)
    return patch(hf_model, artifact, method, quant, cache), tokenizer


__all__ = [
    "ArtifactError",
    "CacheConfig",
    "CalibrationError",
    "Int2Tensor",
    "OscarError",
    "QuantConfig",
    "UnsupportedModelError",
    "cache_bits_per_element",
    "dequantize_int2",
    "int2_bits_per_element",
    "load",
    "patch",
    "quantize_int2",
]
