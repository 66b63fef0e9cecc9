"""Offline calibration: text -> statistics -> rotations artifact.

Methods:
    oscar        the product (SPEC §6): keys and values centered by their calibration means;
                 per layer, K and V each take the best of identity / Hadamard / OSCAR and of a
                 small clip grid by attention-output error on held-apart tokens; the streams (keys
                 or values of a layer) whose INT4 (at a clip chosen for INT4) removes the most
                 predicted error per bit, on those tokens and on a retrieval probe, move to INT4
                 while the cache stays within the bit budget; with key_rotations="head" the keys
                 also try an OSCAR rotation per KV head and each KV head picks its own transform
    oscar-paper  SPEC §1 exactly: R_K = U_Q·H·P_br (C_Q pooled over GQA groups),
                 R_V = U_S·H·P_br (C_S with weights k C_Q kᵀ), no centering, INT2 everywhere
    ktk          like oscar-paper, but R_K from the key covariance KᵀK (ablation)
    vtv          like oscar-paper, but R_V from the value covariance VᵀV (ablation)
    hadamard     R = H for K and V (QuaRot-style, data-free)
    identity     R = I (naive INT2, data-free)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .. import rope
from ..config import CacheConfig, QuantConfig
from ..errors import CalibrationError, OscarError
from ..methods import data_free_artifact
from ..models import attention_shape, model_identity
from ..quant.format import check_inner
from .artifact import LayerRotation, RotationArtifact
from .collect import Collector, collecting
from .rotations import check_power_of_two, compose_rotation, sorted_eigh
from .selection import (CLIP_GRID_K, CLIP_GRID_V, LLOYD_INNER_GRID, apply_budget, choose_layer, chosen_key_error, retrieval_errors,
                        retrieval_probe)

CALIBRATION_METHODS = ("oscar", "oscar-paper", "ktk", "vtv", "hadamard", "identity")
VALUE_WEIGHTS = ("proxy", "attention")
KEY_ROTATIONS = ("layer", "head")
CALIBRATION_POSITIONS = ("start", "spread")
LEVELS = ("uniform", "lloyd")
HIGH_ERROR = 0.05  # predicted relative attention-output error above which calibration warns
# The drift check: a layer whose predicted key error at the far end of the context exceeds both
# DRIFT_RATIO times its error at the calibration positions and DRIFT_MIN is named in a warning.
DRIFT_RATIO = 2.0
DRIFT_MIN = 0.01


@dataclass(frozen=True)
class CalibrationConfig:
    """How to calibrate.

    chunk_tokens: tokens per forward; max_chunks: chunks for the covariances, after the skipped
    warm-up chunk. The product method holds one more chunk apart to score the candidates.
    max_bits: bit budget per element (None: pure INT2 + 0.25; 0: pure INT2), counted in bytes at
    `budget_context` tokens with the cache layout `cache`.
    """

    method: str = "oscar"
    chunk_tokens: int = 1024
    max_chunks: int = 16
    min_chunks: int = 2
    max_bits: float | None = None
    budget_context: int = 32768
    clip_grid_k: tuple[float, ...] = CLIP_GRID_K  # clip ratios the product tries for keys
    clip_grid_v: tuple[float, ...] = CLIP_GRID_V  # and for values
    # C_S token weights: "proxy" = k C_Q kᵀ (SPEC §2, the default); "attention" = the attention
    # probability mass each key receives in its calibration chunk (OSCAR+ option, exact).
    value_weights: str = "proxy"
    # Positions the chunks are run at: "start" = 0..chunk_tokens-1 for every chunk (the paper);
    # "spread" = each chunk shifted to its own offset, evenly over the model's supported positions,
    # so that μ_K (taken after RoPE) is the mean over the whole range a key can sit at.
    positions: str = "start"
    # The budget also counts each stream's error on a retrieval probe (the held-apart chunk's first
    # half twice; `selection.retrieval_probe`). False: the held-apart text alone (the ablation).
    retrieval_probe: bool = True
    # "layer": one R_K per layer (the paper); "head" (OSCAR+ option): also an OSCAR R_K from each KV
    # head's own C_Q, and each KV head may pick its own key transform (`selection.choose_layer`).
    key_rotations: str = "layer"
    # INT2 levels: "uniform" (the paper) or "lloyd" (OSCAR+ option): each layer's INT2 streams may take
    # Lloyd–Max inner levels (`quant.format`), searched with the clip ratio (`selection.choose_layer`).
    levels: str = "uniform"
    inner: float | None = None  # with levels="lloyd": this inner level for every INT2 stream, no search

    def __post_init__(self) -> None:
        if self.method not in CALIBRATION_METHODS:
            raise OscarError(f"unknown calibration method {self.method!r}; choose from {', '.join(CALIBRATION_METHODS)}.")
        if self.chunk_tokens < 16:
            raise OscarError(f"chunk_tokens={self.chunk_tokens} is too small; use at least 16 (default 1024).")
        if not 1 <= self.min_chunks <= self.max_chunks:
            raise OscarError(f"need 1 <= min_chunks ({self.min_chunks}) <= max_chunks ({self.max_chunks}).")
        for grid in (self.clip_grid_k, self.clip_grid_v):
            if not grid or any(not c <= 1.0 for c in grid):
                raise OscarError(f"clip grid {grid} must be a non-empty list of ratios <= 1 (0 = no clip).")
        if self.value_weights not in VALUE_WEIGHTS:
            raise OscarError(f"value_weights={self.value_weights!r} must be one of {', '.join(VALUE_WEIGHTS)}.")
        if self.key_rotations not in KEY_ROTATIONS:
            raise OscarError(f"key_rotations={self.key_rotations!r} must be one of {', '.join(KEY_ROTATIONS)}.")
        if self.levels not in LEVELS:
            raise OscarError(f"levels={self.levels!r} must be one of {', '.join(LEVELS)}.")
        if self.inner is not None:
            if self.levels != "lloyd":
                raise OscarError("an inner level is for Lloyd-Max levels: pass it with levels='lloyd' (--levels lloyd).")
            check_inner(self.inner)
        if self.positions not in CALIBRATION_POSITIONS:
            raise OscarError(f"positions={self.positions!r} must be one of {', '.join(CALIBRATION_POSITIONS)}.")
        if self.max_bits is not None and self.max_bits < 0:
            raise OscarError(f"max_bits={self.max_bits} must be >= 0 (0 = pure INT2).")


def token_chunks(token_ids: torch.Tensor, chunk_tokens: int, bos_id: int | None = None) -> list[torch.Tensor]:
    """Split a 1-D token stream into full chunks of `chunk_tokens` (the remainder is dropped).

    With `bos_id`, every chunk is that token followed by chunk_tokens - 1 tokens of text.
    """
    body = chunk_tokens - (bos_id is not None)
    n = token_ids.numel() // body
    chunks = [token_ids[i * body : (i + 1) * body] for i in range(n)]
    if bos_id is not None:
        chunks = [torch.cat([torch.tensor([bos_id], dtype=c.dtype), c]) for c in chunks]
    return chunks


def position_offsets(count: int, chunk_tokens: int, max_positions: int) -> list[int]:
    """`count` first positions spaced evenly from 0 to max_positions - chunk_tokens (all 0 if no room)."""
    room = max(max_positions - chunk_tokens, 0)
    if count <= 1 or room == 0:
        return [0] * count
    return [round(i * room / (count - 1)) for i in range(count)]


def _turned_mean(model, mean: torch.Tensor | None, layer_type: str, offset: int) -> torch.Tensor | None:
    """The key mean turned by RoPE to `offset` (what key_centering="rope" centers there), or None
    where the layer is not centered or the model's RoPE frequencies are not known."""
    if mean is None:
        return None
    try:
        freqs = rope.inverse_frequencies(model, layer_type)
    except OscarError:
        return None
    return rope.turn(mean.double(), offset * freqs).to(mean.dtype)


def far_offset(config: CalibrationConfig, max_positions: int) -> int:
    """Where the drift check runs the held-apart chunk again: the last chunk of the model's
    context; 0 (no check) for spread positions or when the context is under 4 chunks long."""
    far = max_positions - config.chunk_tokens
    return far if config.positions == "start" and far >= 3 * config.chunk_tokens else 0


def _run(model, chunks: list[torch.Tensor], collector: Collector, progress: tqdm,
         offsets: list[int] | None = None) -> None:
    """Forward each chunk for its statistics; chunk i runs at positions offsets[i] + 0..T-1.

    RoPE sees the shifted positions; the causal mask does not depend on them, so every layer's
    output is that of the unshifted chunk and only q and k turn by the offset."""
    device = next(model.parameters()).device
    with torch.no_grad(), collecting(model, collector):
        for i, chunk in enumerate(chunks):
            kwargs = {}
            if offsets is not None:
                kwargs["position_ids"] = (offsets[i] + torch.arange(chunk.numel(), device=device))[None]
            model(chunk[None].to(device), use_cache=False, logits_to_keep=1, **kwargs)  # statistics only
            progress.update(1)


def calibrate(model, token_ids: torch.Tensor, quant: QuantConfig, config: CalibrationConfig = CalibrationConfig(),
              sources: list[str] | None = None, show_progress: bool = True,
              cache: CacheConfig = CacheConfig(), bos_id: int | None = None) -> RotationArtifact:
    """Calibrate rotations for `model` on the token stream `token_ids` ([N] long).

    The first chunk is a warm-up and is skipped (as in the reference); the next
    `max_chunks` chunks give the covariances and means; the product method scores its
    per-layer candidates on one further chunk. Returns an artifact ready to save.
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
    product = config.method == "oscar"
    chunks = token_chunks(token_ids.reshape(-1), config.chunk_tokens, bos_id)
    needed = 1 + config.min_chunks + (1 if product else 0)
    if len(chunks) < needed:
        held = " and one is held apart to score the per-layer choices" if product else ""
        raise CalibrationError(
            f"calibration text has {token_ids.numel()} tokens: {len(chunks)} chunk(s) of {config.chunk_tokens}, "
            f"but {needed} are needed (one warm-up chunk is skipped{held}). Pass more text (--text FILE...) "
            "or a smaller --chunk-tokens."
        )
    held_apart = None
    if product:
        held_apart = chunks[min(len(chunks) - 1, 1 + config.max_chunks)]
        chunks = chunks[1 : min(len(chunks) - 1, 1 + config.max_chunks)]
    else:
        chunks = chunks[1 : 1 + config.max_chunks]
    collector = Collector(value_weights=config.value_weights)
    far = far_offset(config, shape.max_positions) if product else 0
    probe = product and config.retrieval_probe
    passes = 2 * len(chunks) + (1 if product else 0) + (1 if far else 0) + (1 if probe else 0)
    offsets = held_offset = None
    if config.positions == "spread":
        # The held-apart chunk takes the middle of the range, between the covariance chunks' offsets.
        offsets = position_offsets(len(chunks), config.chunk_tokens, shape.max_positions)
        held_offset = position_offsets(3, config.chunk_tokens, shape.max_positions)[1:2]
    with tqdm(total=passes, desc="calibrating", unit="chunk", disable=not show_progress) as progress:
        _run(model, chunks, collector, progress, offsets)
        collector.second_pass = True
        _run(model, chunks, collector, progress, offsets)
        layers = [_layer_rotations(collector.stats[i], config.method) for i in range(shape.num_layers)]
        if product:
            def window_of(layer: int) -> int | None:
                """The layer's sliding window, None for full attention."""
                return shape.sliding_window if shape.layer_types[layer] == "sliding_attention" else None

            head_rotations = [head_key_rotations(collector.stats[i]) if config.key_rotations == "head" else None
                              for i in range(shape.num_layers)]

            def score(layer: int, q, k, v) -> None:
                layers[layer].choice = choose_layer(layers[layer], q[0], k[0], v[0], quant, cache, window_of(layer),
                                                    config.clip_grid_k, config.clip_grid_v, head_rotations[layer],
                                                    LLOYD_INNER_GRID if config.levels == "lloyd" else (), config.inner)

            collector.on_layer = score
            _run(model, [held_apart], collector, progress, held_offset)
            if far:
                # Drift check: the same tokens at the end of the context. The key mean is taken
                # after RoPE, so a key offset that turns with position (a k_proj bias, or any
                # pre-RoPE mean) is no longer removed there, and the INT2 keys pay for it.
                # With key_centering="rope" (the cache's default) the mean is turned by RoPE to the
                # check's offset, R(far)·μ_K: "error_k_far_rope" is that error.
                def score_far(layer: int, q, k, v) -> None:
                    choice = layers[layer].choice
                    sliding = window_of(layer)
                    choice["error_k_far"] = chosen_key_error(layers[layer], q[0], k[0], v[0], quant, cache, sliding)
                    turned = _turned_mean(model, layers[layer].k_mean, shape.layer_types[layer], far)
                    if turned is not None:
                        choice["error_k_far_rope"] = chosen_key_error(layers[layer], q[0], k[0], v[0], quant, cache,
                                                                      sliding, turned)

                collector.on_layer = score_far
                _run(model, [held_apart], collector, progress, [far])
            if probe:
                def score_probe(layer: int, q, k, v) -> None:
                    layers[layer].choice.update(retrieval_errors(layers[layer], q[0], k[0], v[0], quant, cache,
                                                                 window_of(layer)))

                collector.on_layer = score_probe
                _run(model, [retrieval_probe(held_apart, bos_id)], collector, progress, held_offset)
    calibration = {
        "tokens": len(chunks) * config.chunk_tokens,
        "chunk_tokens": config.chunk_tokens,
        "chunks": len(chunks),
        "warmup_chunks_skipped": 1,
        "held_apart_tokens": config.chunk_tokens if product else 0,
        "clip_grid_k": list(config.clip_grid_k) if product else None,
        "clip_grid_v": list(config.clip_grid_v) if product else None,
        "value_weights": config.value_weights,
        "positions": config.positions,
        "max_offset": max(offsets) if offsets else 0,
        "drift_check_offset": far,
        "retrieval_probe": probe,
        "key_rotations": config.key_rotations if product else "layer",
        "levels": config.levels if product else "uniform",
        "inner": config.inner if product else None,
        "sources": list(sources or []),
        "model_source": getattr(model, "oscar_source", None),
    }
    artifact = RotationArtifact(config.method, model_identity(model), layers, quant.group_size, quant.clip_ratio_k,
                                quant.clip_ratio_v, calibration)
    if product:
        apply_budget(artifact, shape, cache, config.max_bits, config.budget_context)
    return artifact


def head_key_rotations(stats) -> torch.Tensor:
    """[Hkv, d, d] float64: the OSCAR R_K of each KV head from its own C_Q (its query group's)."""
    return torch.stack([compose_rotation(vectors, values) for values, vectors in
                        (sorted_eigh(c_q) for c_q in stats.query_covariance())])


def _layer_rotations(stats, method: str) -> LayerRotation:
    """Rotations of one layer from its statistics (and, for the product, means and paper rotations)."""
    c_q = stats.query_covariance().mean(0)
    c_s = stats.score_weighted_value_covariance(centered=False).mean(0)
    k_cov = c_q if method != "ktk" else (stats.kk / stats.tokens).mean(0)
    v_cov = c_s if method != "vtv" else (stats.vv / stats.tokens).mean(0)
    k_values, k_vectors = sorted_eigh(k_cov)
    v_values, v_vectors = sorted_eigh(v_cov)
    paper_k = compose_rotation(k_vectors, k_values).float()
    paper_v = compose_rotation(v_vectors, v_values).float()
    if method != "oscar":
        return LayerRotation(paper_k, paper_v, k_values.float(), v_values.float())
    # The product rotates centered values: its C_S is that of v - μ_V.
    centered_values, centered_vectors = sorted_eigh(stats.score_weighted_value_covariance(centered=True).mean(0))
    return LayerRotation(
        paper_k, compose_rotation(centered_vectors, centered_values).float(), k_values.float(),
        centered_values.float(), k_mean=stats.key_mean().float(), v_mean=stats.value_mean().float(),
        paper_k_rotation=paper_k, paper_v_rotation=paper_v,
    )
