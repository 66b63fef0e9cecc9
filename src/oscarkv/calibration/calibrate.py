"""Offline calibration (SPEC §1): text -> statistics -> rotations artifact.

Methods:
    oscar     R_K = U_Q·H·P_br (C_Q pooled over GQA groups), R_V = U_S·H·P_br (C_S, weights k C_Q kᵀ)
    ktk       like oscar, but R_K from the key covariance KᵀK (ablation)
    vtv       like oscar, but R_V from the value covariance VᵀV (ablation)
    hadamard  R = H for K and V (QuaRot-style, data-free)
    identity  R = I (naive INT2, data-free)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..config import QuantConfig
from ..errors import CalibrationError, OscarError
from ..methods import data_free_artifact
from ..models import attention_shape, model_identity
from .artifact import LayerRotation, RotationArtifact
from .collect import Collector, collecting
from .rotations import check_power_of_two, compose_rotation, sorted_eigh

CALIBRATION_METHODS = ("oscar", "ktk", "vtv", "hadamard", "identity")


@dataclass(frozen=True)
class CalibrationConfig:
    """chunk_tokens: tokens per forward; max_chunks: chunks used after the skipped warm-up chunk."""

    method: str = "oscar"
    chunk_tokens: int = 1024
    max_chunks: int = 16
    min_chunks: int = 2

    def __post_init__(self) -> None:
        if self.method not in CALIBRATION_METHODS:
            raise OscarError(f"unknown calibration method {self.method!r}; choose from {', '.join(CALIBRATION_METHODS)}.")
        if self.chunk_tokens < 16:
            raise OscarError(f"chunk_tokens={self.chunk_tokens} is too small; use at least 16 (default 1024).")
        if not 1 <= self.min_chunks <= self.max_chunks:
            raise OscarError(f"need 1 <= min_chunks ({self.min_chunks}) <= max_chunks ({self.max_chunks}).")


def token_chunks(token_ids: torch.Tensor, chunk_tokens: int) -> list[torch.Tensor]:
    """Split a 1-D token stream into full chunks of `chunk_tokens` (the remainder is dropped)."""
    n = token_ids.numel() // chunk_tokens
    return [token_ids[i * chunk_tokens : (i + 1) * chunk_tokens] for i in range(n)]


def _run(model, chunks: list[torch.Tensor], collector: Collector, progress: tqdm) -> None:
    device = next(model.parameters()).device
    with torch.no_grad(), collecting(model, collector):
        for chunk in chunks:
            model(chunk[None].to(device), use_cache=False, logits_to_keep=1)  # statistics only: skip the LM head
            progress.update(1)


def calibrate(model, token_ids: torch.Tensor, quant: QuantConfig, config: CalibrationConfig = CalibrationConfig(),
              sources: list[str] | None = None, show_progress: bool = True) -> RotationArtifact:
    """Calibrate rotations for `model` on the token stream `token_ids` ([N] long).

    The first chunk is a warm-up and is skipped (as in the reference); the next
    `max_chunks` chunks are used. Returns an artifact ready to save.
    """
    if hasattr(model, "oscar"):
        raise OscarError("this model is already patched by oscarkv; calibrate a freshly loaded model.")
    shape = attention_shape(model)
    quant.check_head_dim(shape.head_dim)
    if config.method in ("identity", "hadamard"):
        if config.method == "hadamard":
            check_power_of_two(shape.head_dim)
        return data_free_artifact(model, config.method, quant)
    check_power_of_two(shape.head_dim)
    chunks = token_chunks(token_ids.reshape(-1), config.chunk_tokens)
    needed = 1 + config.min_chunks
    if len(chunks) < needed:
        raise CalibrationError(
            f"calibration text has {token_ids.numel()} tokens: {len(chunks)} chunk(s) of {config.chunk_tokens}, "
            f"but {needed} are needed (one warm-up chunk is skipped). Pass more text (--text FILE...) "
            "or a smaller --chunk-tokens."
        )
    chunks = chunks[1 : 1 + config.max_chunks]
    collector = Collector()
    with tqdm(total=2 * len(chunks), desc="calibrating", unit="chunk", disable=not show_progress) as progress:
        _run(model, chunks, collector, progress)
        collector.second_pass = True
        _run(model, chunks, collector, progress)

    layers = []
    for layer in range(shape.num_layers):
        stats = collector.stats[layer]
        c_q = stats.query_covariance().mean(0)
        c_s = (stats.sv / stats.weight.clamp(min=1e-300)[:, None, None]).mean(0)
        k_cov = c_q if config.method != "ktk" else (stats.kk / stats.tokens).mean(0)
        v_cov = c_s if config.method != "vtv" else (stats.vv / stats.tokens).mean(0)
        k_values, k_vectors = sorted_eigh(k_cov)
        v_values, v_vectors = sorted_eigh(v_cov)
        layers.append(LayerRotation(
            compose_rotation(k_vectors, k_values).float(),
            compose_rotation(v_vectors, v_values).float(),
            k_values.float(),
            v_values.float(),
        ))
    return RotationArtifact(
        method=config.method,
        model=model_identity(model),
        layers=layers,
        group_size=quant.group_size,
        clip_ratio_k=quant.clip_ratio_k,
        clip_ratio_v=quant.clip_ratio_v,
        calibration={
            "tokens": len(chunks) * config.chunk_tokens,
            "chunk_tokens": config.chunk_tokens,
            "chunks": len(chunks),
            "warmup_chunks_skipped": 1,
            "sources": list(sources or []),
            "model_source": getattr(model, "oscar_source", None),
        },
    )
