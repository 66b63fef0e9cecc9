"""Streaming float64 statistics of q, k, v taken inside attention (after RoPE and q/k-norm).

A calibration attention function, registered under its own name, sees exactly the
tensors the model attends with; it accumulates the statistics and then runs plain SDPA so
the forward continues unchanged. Nothing but d×d sums is kept between chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..errors import CalibrationError

CALIBRATION_ATTENTION = "oscar_calibrate"


@dataclass
class LayerStats:
    """Sums per KV head, float64. C = sum / count gives each covariance."""

    qq: torch.Tensor  # [Hkv, d, d]  Σ qᵀq over the query heads of each KV head
    kk: torch.Tensor  # [Hkv, d, d]  Σ kᵀk
    vv: torch.Tensor  # [Hkv, d, d]  Σ vᵀv
    k_sum: torch.Tensor  # [Hkv, d]  Σ k
    v_sum: torch.Tensor  # [Hkv, d]  Σ v
    sv: torch.Tensor  # [Hkv, d, d]  Σ w·vᵀv, w = k C_Q kᵀ or attention mass (second pass)
    sv_sum: torch.Tensor  # [Hkv, d] Σ w·v                  (second pass)
    weight: torch.Tensor  # [Hkv]    Σ w                    (second pass)
    queries: int = 0  # rows summed into qq per KV head
    tokens: int = 0  # rows summed into kk, vv

    @classmethod
    def empty(cls, kv_heads: int, d: int) -> LayerStats:
        z = lambda *shape: torch.zeros(kv_heads, *shape, dtype=torch.float64)  # noqa: E731
        return cls(z(d, d), z(d, d), z(d, d), z(d), z(d), z(d, d), z(d), z())

    def query_covariance(self) -> torch.Tensor:
        """C_Q per KV head [Hkv, d, d]."""
        return self.qq / max(self.queries, 1)

    def key_mean(self) -> torch.Tensor:
        """μ_K per KV head [Hkv, d] (keys after RoPE and k-norm)."""
        return self.k_sum / max(self.tokens, 1)

    def value_mean(self) -> torch.Tensor:
        """μ_V per KV head [Hkv, d]."""
        return self.v_sum / max(self.tokens, 1)

    def score_weighted_value_covariance(self, centered: bool) -> torch.Tensor:
        """C_S per KV head [Hkv, d, d]: Σ w v vᵀ / Σ w, of v - μ_V when `centered`."""
        total = self.weight.clamp(min=1e-300)[:, None, None]
        c_s = self.sv / total
        if centered:
            mean = self.value_mean()
            weighted_mean = self.sv_sum / total[..., 0]
            c_s = (c_s - weighted_mean[:, :, None] * mean[:, None, :] - mean[:, :, None] * weighted_mean[:, None, :]
                   + mean[:, :, None] * mean[:, None, :])
        return c_s


@dataclass
class Collector:
    """Accumulates `LayerStats` for every layer during one calibration pass."""

    stats: dict[int, LayerStats] = field(default_factory=dict)
    second_pass: bool = False
    # C_S token weights in the second pass: "proxy" = k C_Q kᵀ (SPEC §2); "attention" = the attention
    # probability mass each key really receives, summed over the queries of its chunk and group.
    value_weights: str = "proxy"
    # Third use: when set, called as on_layer(layer, q, k, v) instead of accumulating (held-apart tokens).
    on_layer: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None

    def observe(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None = None,
                window: int | None = None) -> None:
        """q: [B, Hq, T, d]; k, v: [B, Hkv, T, d] (calibration batches are unpadded).

        scaling, window: the layer's softmax scale and sliding window (for exact attention weights)."""
        for name, t in (("queries", q), ("keys", k), ("values", v)):
            if not torch.isfinite(t).all():
                raise CalibrationError(
                    f"non-finite {name} in layer {layer} during calibration: the model overflows on this text "
                    "in its dtype. Calibrate in float32 (on CPU the default) or with other text."
                )
        if self.on_layer is not None:
            self.on_layer(layer, q, k, v)
            return
        b, hq, t_len, d = q.shape
        hkv = k.shape[1]
        qf = q.double().transpose(1, 2).reshape(b * t_len, hkv, hq // hkv, d)  # [N, Hkv, g, d]
        kf = k.double().transpose(1, 2).reshape(b * t_len, hkv, d)
        vf = v.double().transpose(1, 2).reshape(b * t_len, hkv, d)
        stats = self.stats.setdefault(layer, LayerStats.empty(hkv, d))
        if not self.second_pass:
            stats.qq += torch.einsum("nhgd,nhge->hde", qf, qf).cpu()
            stats.kk += torch.einsum("nhd,nhe->hde", kf, kf).cpu()
            stats.vv += torch.einsum("nhd,nhe->hde", vf, vf).cpu()
            stats.k_sum += kf.sum(0).cpu()
            stats.v_sum += vf.sum(0).cpu()
            stats.queries += qf.shape[0] * qf.shape[2]
            stats.tokens += kf.shape[0]
        else:
            if self.value_weights == "attention":
                w = attention_mass(q, k, scaling if scaling is not None else d ** -0.5, window)
            else:
                c_q = stats.query_covariance().to(kf.device)
                w = torch.einsum("nhd,hde,nhe->nh", kf, c_q, kf).clamp(min=0)  # attention-weight proxy per token
            stats.sv += torch.einsum("nh,nhd,nhe->hde", w, vf, vf).cpu()
            stats.sv_sum += torch.einsum("nh,nhd->hd", w, vf).cpu()
            stats.weight += w.sum(0).cpu()


def attention_mass(q: torch.Tensor, k: torch.Tensor, scaling: float, window: int | None = None) -> torch.Tensor:
    """The causal attention probability each key receives, summed over all queries of its group.

    q: [B, Hq, T, d]; k: [B, Hkv, T, d] -> [B*T, Hkv] float64 (rows in the order of `observe`).
    `window`: sliding-window layers see only the last `window` keys.
    """
    b, hq, t_len, _ = q.shape
    hkv = k.shape[1]
    qg = q.float().reshape(b, hkv, hq // hkv, t_len, -1)
    scores = torch.einsum("bhgtd,bhsd->bhgts", qg, k.float()) * scaling
    rows = torch.arange(t_len, device=q.device)
    hidden = rows[None, :] > rows[:, None]  # key after query
    if window:
        hidden |= rows[None, :] <= rows[:, None] - window
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return probs.sum(dim=(2, 3)).double().transpose(1, 2).reshape(b * t_len, hkv)


def _make_attention(collector: Collector):
    def calibration_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
        scaling = kwargs.get("scaling") or getattr(module, "scaling", None)
        window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
        collector.observe(module.layer_idx, query.detach(), key.detach(), value.detach(), scaling, window)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return calibration_attention


@contextmanager
def collecting(model: nn.Module, collector: Collector):
    """Route the model's attention through the collector for the duration of the block."""
    AttentionInterface.register(CALIBRATION_ATTENTION, _make_attention(collector))
    AttentionMaskInterface.register(CALIBRATION_ATTENTION, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(CALIBRATION_ATTENTION)
    try:
        yield collector
    finally:
        model.set_attn_implementation(previous)
