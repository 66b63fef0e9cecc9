"""Typed configuration of the compressed KV cache.

One frozen dataclass per concern; every field is validated on construction so that a
bad value fails where it is written, not deep inside a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from .errors import OscarError, UnsupportedModelError

SCALE_DTYPES = (torch.float16, torch.float32)
KEY_GROUPINGS = ("token", "channel")
KERNELS = ("auto", "paged", "reference")
HISTORY_FORMATS = ("int", "turboquant3")
KEY_CENTERINGS = ("auto", "rope", "fixed")
ExtendPath = Literal["auto", "fused", "dequantize"]
EXTEND_PATHS: tuple[str, ...] = get_args(ExtendPath)


@dataclass(frozen=True)
class QuantConfig:
    """How one history token of one KV head is stored (SPEC §2).

    group_size: channels sharing one (scale, zero) pair; must divide head_dim.
    clip_ratio_k / clip_ratio_v: per-token clip at the value of rank floor(c·d) of |x|;
        c <= 0 disables clipping.
    scale_dtype: storage dtype of scale and zero (float16 by default).
    """

    group_size: int = 128
    clip_ratio_k: float = 0.96
    clip_ratio_v: float = 0.92
    scale_dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        if self.group_size < 4 or self.group_size & (self.group_size - 1):
            raise OscarError(
                f"group_size={self.group_size} must be a power of two >= 4 (e.g. 64 or 128)."
            )
        for name in ("clip_ratio_k", "clip_ratio_v"):
            value = getattr(self, name)
            if not value <= 1.0:
                raise OscarError(f"{name}={value} must be <= 1 (use 0 to disable clipping).")
        if self.scale_dtype not in SCALE_DTYPES:
            raise OscarError(f"scale_dtype={self.scale_dtype} must be torch.float16 or torch.float32.")

    @classmethod
    def for_head_dim(cls, head_dim: int, **overrides) -> QuantConfig:
        """The defaults, with the group size the largest power of two up to the default (128) that divides
        head_dim: 64 for SmolLM2, 32 for a head_dim of 96 (which only the INT2 methods without a Hadamard factor
        and the reference cache take)."""
        if "group_size" not in overrides:
            group = cls.group_size
            while group >= 4 and head_dim % group:
                group //= 2
            if group < 4:
                raise UnsupportedModelError(f"head_dim={head_dim}: no group size of 4 or more divides it, so its "
                                            "history cannot be quantized in groups; use a model with head_dim 64, "
                                            "128 or 256.")
            overrides["group_size"] = group
        return cls(**overrides)

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % self.group_size:
            raise OscarError(
                f"group_size={self.group_size} does not divide head_dim={head_dim}; "
                f"choose a group size that divides it (e.g. {min(head_dim, 64)})."
            )


@dataclass(frozen=True)
class CacheConfig:
    """Layout of the mixed-precision cache (SPEC §3).

    sink_tokens: the first tokens of each sequence, kept in `window_dtype`.
    recent_tokens: the most recent tokens (the current one included), kept in `window_dtype`.
    window_dtype: storage dtype of the sink and recent windows.
    quantize_history: False stores the history as floats instead of INT codes: in
        `history_dtype` (default `window_dtype`: the BF16 baseline; torch.float8_e4m3fn: the FP8
        baseline, values saturated at ±448 as an FP8 cache with unit scales does).
    kernel: which cache runs the model. "paged": the paged cache of the GPU kernels (Triton on
        CUDA, their torch references elsewhere); "reference": the torch reference cache
        (any device, left padding, beam search); "auto": "paged" on a CUDA GPU with Triton
        when the model's shapes suit the kernels and the history is quantized, else "reference".
    page_size: tokens per history page of the paged cache.
    max_context: longest sequence the paged cache reserves pages for (default: the model's
        max_position_embeddings).
    key_grouping: "token" (OSCAR: each key's channels in groups of `group_size`) or "channel"
        (KIVI: each channel over groups of `group_size` consecutive tokens). With "channel",
        tokens move to the history a whole group at a time, so the recent window holds
        `recent_tokens` to `recent_tokens + group_size - 1` tokens; reference cache only,
        no left padding.
    history_format: "int" (INT2/INT4 codes per group with fp16 scale and zero: OSCAR and the INT
        baselines) or "turboquant3" (vLLM's turboquant_3bit_nc codec, `oscarkv.quant.turboquant`;
        reference cache only).
    static_decode: on CUDA, a patched model's `generate` runs plain greedy or sampled (temperature, top_k,
        top_p) decoding of an unpadded or left-padded batch through the static decode path (one CUDA graph per step; see
        `oscarkv.integrations.static_decode`); False keeps transformers' own loop.
    compile_small_ops: the static decode path (CUDA) runs the model's norms, MLPs and rotary
        embedding compiled by torch.compile, a few fused kernels instead of about forty small
        ones per layer (`oscarkv.integrations.fused_ops`), and the RMSNorms of Llama, Mistral and
        Qwen models as oscarkv's Triton kernel with the decoder layers' residual adds folded in
        (`oscarkv.integrations.norms`), and the attention's q/k norms, rotary embedding and query
        rotation in one Triton launch (`oscarkv.integrations.decode_attention`); its prompts (CUDA)
        run those RMSNorms and residual adds as the Triton kernel too; False runs all of them as
        eager PyTorch.
    decode_gemv: the static decode path (CUDA) runs a decode step's linear layers as Triton
        products instead of cuBLAS (batch 1: matrix-vector kernels; batch 2 to 32: few-rows
        tensor-core kernels), q/k/v and a gated MLP's gate/up in one launch each
        (`oscarkv.integrations.gemv`); False keeps cuBLAS.
    key_centering: how the keys of a centered artifact (SPEC §6) are centered. "fixed": every key
        minus μ_K, the mean calibration measured at positions [0, chunk). "rope": a history key
        at position p is centered by R(o)·μ_K instead, the same mean turned by RoPE to its block
        of positions, o = chunk·floor(p / chunk), and the difference is added back to it when it
        is read, so attention is unchanged up to quantization (`oscarkv.rope`). Keys far into a
        long context are then as well centered as those calibration saw (Qwen2.5-Coder NIAH at
        28K-32K: 0-8% with "fixed", 100% with "rope"). "auto" (default): "rope" where it applies
        (an artifact calibrated at start positions, a model with fixed RoPE frequencies), else
        "fixed"; "rope" raises where it does not apply.
    extend_attention: how the paged cache's Triton backend attends in an extend step (several new tokens per
        sequence over stored ones, as a chunked prefill): "dequantize" (the history dequantized once per step,
        then one SDPA; `oscarkv.kernels.extend`), "fused" (the INT2 attention kernel, which decodes the
        history in every block of query rows), or "auto" (default: "dequantize" from 48 new tokens per
        sequence, where it is faster on the H100, else "fused"). Decode steps always run the kernel.
    """

    sink_tokens: int = 64
    recent_tokens: int = 256
    window_dtype: torch.dtype = torch.bfloat16
    quantize_history: bool = True
    history_dtype: torch.dtype | None = None
    kernel: str = "auto"
    page_size: int = 64
    max_context: int | None = None
    key_grouping: str = "token"
    static_decode: bool = True
    compile_small_ops: bool = True
    decode_gemv: bool = True
    history_format: str = "int"
    key_centering: str = "auto"
    extend_attention: ExtendPath = "auto"

    def __post_init__(self) -> None:
        if self.key_grouping not in KEY_GROUPINGS:
            raise OscarError(f"key_grouping={self.key_grouping!r} must be one of {KEY_GROUPINGS}.")
        if self.sink_tokens < 0:
            raise OscarError(f"sink_tokens={self.sink_tokens} must be >= 0.")
        if self.recent_tokens < 1:
            raise OscarError(
                f"recent_tokens={self.recent_tokens} must be >= 1 (the current token is always "
                "attended in full precision)."
            )
        if not self.window_dtype.is_floating_point:
            raise OscarError(f"window_dtype={self.window_dtype} must be a floating-point dtype.")
        if self.history_dtype is not None and not self.history_dtype.is_floating_point:
            raise OscarError(f"history_dtype={self.history_dtype} must be a floating-point dtype.")
        if self.history_format not in HISTORY_FORMATS:
            raise OscarError(f"history_format={self.history_format!r} must be one of {HISTORY_FORMATS}.")
        if self.key_centering not in KEY_CENTERINGS:
            raise OscarError(f"key_centering={self.key_centering!r} must be one of {KEY_CENTERINGS}.")
        if self.extend_attention not in EXTEND_PATHS:
            raise OscarError(f"extend_attention={self.extend_attention!r} must be one of {EXTEND_PATHS}.")
        if self.kernel not in KERNELS:
            raise OscarError(f"kernel={self.kernel!r} must be one of {KERNELS}.")
        if self.max_context is not None and self.max_context < 1:
            raise OscarError(f"max_context={self.max_context} must be >= 1.")
