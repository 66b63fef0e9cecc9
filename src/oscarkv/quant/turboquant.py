"""TurboQuant 3-bit ("turboquant_3bit_nc" in vLLM 0.32), reimplemented as a baseline codec.

What vLLM stores per token and KV head (read from vllm/v1/attention/ops/triton_turboquant_store.py,
triton_turboquant_decode.py and model_executor/layers/quantization/turboquant/ of the 0.32.0 wheel):

keys    n = ||k||; y = (k / (n + 1e-8)) · H, H the orthonormal Walsh-Hadamard matrix (Sylvester
        order, shared by all layers, no random signs); each coordinate of y becomes the index of
        its nearest of the 2^b Lloyd-Max centroids of N(0, 1/D) (b = 3: 8 centroids), found
        against the midpoints (y >= midpoint moves up). Stored: b-bit indices (8 indices in
        3 bytes for b = 3) and n as float16.
        Read: c = centroids[idx], re-normalised to unit length ("nc", norm correction), then
        k_hat = fp16(n) · c · Hᵀ (vLLM rotates the queries by H instead; the scores are equal).
values  one asymmetric group per token over all D channels: scale = (max - min)/7, floored at
        1e-8; codes = clamp(int((v - min)/scale + 0.5), 0, 7) with the float32 scale and min;
        stored: 3-bit codes, and scale and min as float16. Read: codes · fp16(scale) + fp16(min).

Bytes per token and KV head: 3D/8 + 2 (keys) and 3D/8 + 4 (values): 3.375 bits per element
for D = 64, 3.19 for D = 128. vLLM also keeps the first 2 and the last 2 attention layers of a
dense model uncompressed ("boundary protection"); `oscarkv.methods` does the same.

Differences from vLLM, all below float32 rounding of the reconstruction: the centroids solve the
Lloyd-Max conditions with the closed-form Gaussian conditional mean instead of trapezoid
integration; the reference packs the codes with torch, not a Triton kernel.
"""

from __future__ import annotations

import functools
import math

import torch

from ..calibration.rotations import hadamard

KEY_NORM_EPS = 1e-8
VALUE_MIN_SCALE = 1e-8


@functools.cache
def lloyd_max_centroids(dim: int, bits: int = 3, iterations: int = 300) -> tuple[float, ...]:
    """The 2^bits Lloyd-Max centroids of N(0, 1/dim), ascending (what a coordinate of a rotated
    unit vector approximately follows)."""
    levels = 1 << bits
    sigma = 1.0 / math.sqrt(dim)
    centroids = [sigma * (-3.5 + 7.0 * (i + 0.5) / levels) for i in range(levels)]

    def density(x: float) -> float:
        return math.exp(-0.5 * (x / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))

    def mass(x: float) -> float:
        return 0.5 * (1.0 + math.erf(x / (sigma * math.sqrt(2))))

    for _ in range(iterations):
        edges = [-math.inf] + [(a + b) / 2 for a, b in zip(centroids, centroids[1:])] + [math.inf]
        updated = []
        for lo, hi, old in zip(edges, edges[1:], centroids):
            p = mass(hi) - mass(lo)
            # E[X | lo < X < hi] for X ~ N(0, sigma^2): sigma^2 (phi(lo) - phi(hi)) / P.
            d_lo = 0.0 if math.isinf(lo) else density(lo)
            d_hi = 0.0 if math.isinf(hi) else density(hi)
            updated.append(sigma * sigma * (d_lo - d_hi) / p if p > 1e-300 else old)
        if max(abs(a - b) for a, b in zip(updated, centroids)) < 1e-12 * sigma:
            centroids = updated
            break
        centroids = updated
    return tuple(centroids)


def pack3(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] codes in 0..7 (D a multiple of 8) -> [..., 3D/8] uint8: 8 codes per 3 bytes, code i
    of a group in bits 3i..3i+2 of the group's little-endian 24-bit word."""
    groups = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, 8)
    word = (groups << (3 * torch.arange(8, device=codes.device, dtype=torch.int32))).sum(-1)
    parts = torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=-1)
    return parts.reshape(*codes.shape[:-1], -1).to(torch.uint8)


def unpack3(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack3`: [..., 3D/8] uint8 -> [..., D] int64 codes."""
    parts = packed.to(torch.int64).reshape(*packed.shape[:-1], -1, 3)
    word = parts[..., 0] | (parts[..., 1] << 8) | (parts[..., 2] << 16)
    codes = (word[..., None] >> (3 * torch.arange(8, device=packed.device))) & 7
    return codes.reshape(*packed.shape[:-1], -1)


def encode_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k [..., D] -> (packed 3-bit centroid indices [..., 3D/8] uint8, norms [..., 1] float16)."""
    d = k.shape[-1]
    x = k.float()
    norm = x.norm(dim=-1, keepdim=True)
    y = (x / (norm + KEY_NORM_EPS)) @ hadamard(d, torch.float32).to(x.device)
    centroids = torch.tensor(lloyd_max_centroids(d, 3), dtype=torch.float32, device=x.device)
    midpoints = (centroids[1:] + centroids[:-1]) / 2
    codes = torch.bucketize(y, midpoints, right=True)  # y >= midpoint moves to the next centroid
    return pack3(codes), norm.to(torch.float16)


def decode_keys(packed: torch.Tensor, norm: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(packed indices, norms) -> keys [..., D] in `dtype` (norm-corrected centroids, rotated back)."""
    codes = unpack3(packed)
    d = codes.shape[-1]
    centroids = torch.tensor(lloyd_max_centroids(d, 3), dtype=torch.float32, device=packed.device)
    c = centroids[codes]
    c = c / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-16)
    return (norm.float() * c @ hadamard(d, torch.float32).to(packed.device).T).to(dtype)


def encode_values(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """v [..., D] -> (packed 3-bit codes [..., 3D/8] uint8, scale [..., 1] float16, min [..., 1] float16)."""
    x = v.float()
    low = x.amin(dim=-1, keepdim=True)
    scale = ((x.amax(dim=-1, keepdim=True) - low) / 7.0).clamp_min(VALUE_MIN_SCALE)
    codes = ((x - low) / scale + 0.5).to(torch.int32).clamp(0, 7)  # truncation, as vLLM's int cast
    return pack3(codes), scale.to(torch.float16), low.to(torch.float16)


def decode_values(packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (unpack3(packed).float() * scale.float() + low.float()).to(dtype)


def bits_per_element(head_dim: int) -> float:
    """Stored bits per K/V element: (3D/8 + 2) key bytes and (3D/8 + 4) value bytes per token and head."""
    return 8 * (2 * (3 * head_dim // 8) + 6) / (2 * head_dim)
