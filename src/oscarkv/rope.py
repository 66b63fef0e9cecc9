"""What RoPE does to a key's mean at later positions, for centering that follows position.

Calibration measures the key mean μ_K after RoPE, on chunks that start at position 0. A key
at position p + o is R(o) times the same key at position p (RoPE turns each channel pair by
an angle proportional to the position), so the mean of the keys over positions
[o, o + chunk) is exactly R(o)·μ_K. Centering the history keys of that block of positions
by R(o)·μ_K instead of μ_K keeps every key as well centered as in calibration, at any
distance into the context (`CacheConfig(key_centering="rope")`). The difference
(R(o) - 1)·μ_K is added back to those keys when they are read, so centering stays exact.

Every model family oscarkv patches applies RoPE as transformers' `apply_rotary_pos_emb`:
channel i is paired with channel i + D/2 (`rotate_half`), at angle position·inv_freq[i].
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import OscarError


def inverse_frequencies(model: nn.Module, layer_type: str | None = None) -> torch.Tensor:
    """The model's RoPE inverse frequencies [D/2] (float64) for layers of `layer_type`."""
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    if rotary is None:
        raise OscarError("key_centering='rope' needs a model with rotary position embeddings (a `rotary_emb` "
                         "module); this model has none. Use key_centering='fixed'.")
    freqs = getattr(rotary, f"{layer_type}_inv_freq", None) if layer_type else None
    if freqs is None:
        freqs = getattr(rotary, "inv_freq", None)
    rope_type = getattr(rotary, "rope_type", "default")
    if isinstance(rope_type, dict):
        rope_type = rope_type.get(layer_type, "default")
    if freqs is None or rope_type == "dynamic":
        raise OscarError(f"key_centering='rope' needs fixed RoPE frequencies; this model's rotary embedding "
                         f"(rope_type={rope_type!r}) does not expose them. Use key_centering='fixed'.")
    return freqs.detach().to("cpu", torch.float64)


def config_inverse_frequencies(config, head_dim: int) -> torch.Tensor:
    """The inverse frequencies [D/2] (float64) of a model config with plain RoPE (rope_type "default",
    every channel rotated), for engines that hold a config but no transformers rotary module (vLLM)."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if rope_type != "default" or theta is None or partial != 1.0:
        raise OscarError(f"key_centering='rope' here needs plain RoPE (rope_type 'default', every channel); this "
                         f"config has rope_type={rope_type!r}, partial_rotary_factor={partial}. Use "
                         "key_centering='fixed'.")
    return 1.0 / (float(theta) ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def turn(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """RoPE's rotation of x [..., D] by angles [..., D/2] (channel i paired with i + D/2)."""
    half = x.shape[-1] // 2
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def mean_shifts(mean: torch.Tensor, inv_freq: torch.Tensor, block: int, max_positions: int) -> torch.Tensor:
    """(R(o) - 1)·mean for o = 0, block, 2·block, ... below max_positions: [blocks, Hkv, D] float64.

    mean: [Hkv, D], the key mean of positions [0, block) after RoPE.
    """
    if mean.shape[-1] != 2 * inv_freq.numel():
        raise OscarError(f"the key mean has {mean.shape[-1]} channels but the model's RoPE turns "
                         f"{2 * inv_freq.numel()}; partial-rotary models are not supported by key_centering='rope'.")
    blocks = max(1, -(-max_positions // block))
    offsets = torch.arange(blocks, dtype=torch.float64) * block
    angles = offsets[:, None, None] * inv_freq[None, None, :]  # [blocks, 1, D/2]
    mean = mean.to(torch.float64)[None]
    return turn(mean, angles) - mean


def shift_rows(table: torch.Tensor, positions: torch.Tensor, block: int) -> torch.Tensor:
    """table[min(position // block, last)] for positions [...] (negative positions: block 0)."""
    index = positions.clamp(min=0).div(block, rounding_mode="floor").clamp(max=table.shape[0] - 1)
    return table[index]
