"""Plug the mixed-precision cache into a transformers model (see ../shared/TRANSFORMERS.md).

`patch_model` does, in order:
1. checks the artifact against the model (shapes and weight fingerprint);
2. absorbs R_V into the weights: W_v <- R_Vᵀ·W_v per KV head (bias too), and
   W_o <- W_o·blockdiag(R_V) per query head, so attention outputs come out rotated and
   o_proj undoes it for free;
3. registers the attention function "oscar" (and its mask function, without which
   transformers builds no padding mask for an unknown name) and selects it;
4. makes every forward and `generate` use an `OscarCache` unless one is passed;
5. on CUDA, routes plain greedy `generate` calls to the static decode path (CUDA graphs).

Keys are rotated by R_K in the cache's write path and queries in the attention function,
so (qR)(kR)ᵀ = qkᵀ and keys are never rotated back.
"""

from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass, replace

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import rope
from ..attention import oscar_attention_reference
from ..cache.mixed import LayerSpec, OscarCache, OscarLayer
from ..calibration.artifact import RotationArtifact
from ..calibration.rotations import rotate_heads
from ..config import CacheConfig, QuantConfig
from ..errors import OscarError
from ..kernels.ops import triton_available
from .paged import AttendingLayer, PagedOscarCache, paged_layouts
from ..models import attention_modules, attention_shape, model_identity

ATTENTION_NAME = "oscar"


@dataclass
class OscarState:
    """What a patched model carries: the artifact, the configs, and the per-layer write specs."""

    artifact: RotationArtifact
    quant: QuantConfig
    cache: CacheConfig
    specs: list[LayerSpec]
    kv_heads: int
    head_dim: int
    max_positions: int

    def uses_paged(self, device: torch.device) -> bool:
        """The one switch point between the paged cache (GPU kernels) and the reference cache."""
        kernel = self.cache.kernel
        if kernel == "reference" or (kernel == "auto" and not (device.type == "cuda" and triton_available())):
            return False
        if self.cache.history_format != "int" or any(spec.plain_history for spec in self.specs):
            if kernel == "paged":
                raise OscarError("the paged cache stores INT2/INT4 codes only; use kernel='reference' for "
                                 f"history_format={self.cache.history_format!r} (turboquant3).")
            return False
        if self.cache.key_grouping != "token":
            if kernel == "paged":
                raise OscarError("the paged cache groups keys per token; use kernel='reference' for "
                                 "key_grouping='channel' (kivi2).")
            return False
        try:
            paged_layouts(self.specs, self.cache, self.kv_heads, self.head_dim)
        except OscarError:
            if kernel == "paged":
                raise
            return False
        if not self.cache.quantize_history:
            if kernel == "paged":
                raise OscarError("the paged cache always quantizes the history; use kernel='reference' for BF16.")
            return False
        return True

    def new_cache(self, device: torch.device | str = "cpu") -> OscarCache | PagedOscarCache:
        device = torch.device(device)
        if self.uses_paged(device):
            return PagedOscarCache(self.specs, self.cache, self.kv_heads, self.head_dim,
                                   self.cache.max_context or self.max_positions)
        return OscarCache(self.specs, self.cache)


def oscar_attention(module: nn.Module, query: torch.Tensor, key, value, attention_mask, scaling=None,
                    dropout: float = 0.0, sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """Attention function registered as "oscar": reads the compressed cache through its handle."""
    if isinstance(key, AttendingLayer):
        if softcap:
            raise OscarError("the paged and serving caches do not apply attention logit soft-capping; "
                             "use CacheConfig(kernel='reference') for this model.")
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        return key.attend(query, scaling, sliding_window), None
    if not isinstance(key, OscarLayer):
        # No oscarkv cache (use_cache=False): plain attention on unquantized, unrotated keys.
        # Values already come out of the rotated v_proj and o_proj rotates them back.
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, **kwargs)
    layer = key
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = layer.rotate(query)
    out = oscar_attention_reference(layer, q, scaling, sliding_window, softcap)
    return out.to(query.dtype), None


def register_attention() -> None:
    AttentionInterface.register(ATTENTION_NAME, oscar_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def _block_rotate_rows(weight: torch.Tensor, rotation: torch.Tensor, blocks: int) -> torch.Tensor:
    """[blocks*d, in] -> per block Rᵀ·W_block (output rows rotated: y_block @ R)."""
    d = rotation.shape[0]
    w = weight.double().reshape(blocks, d, -1)
    return torch.einsum("ed,hei->hdi", rotation, w).reshape(weight.shape)


def value_transform_weights(v_weight: torch.Tensor, v_bias: torch.Tensor | None, o_weight: torch.Tensor,
                            o_bias: torch.Tensor | None, rotation: torch.Tensor, mean: torch.Tensor | None,
                            num_kv_heads: int, num_heads: int):
    """R_V (and the centering μ_V) folded into the v and o projections, in float64.

    v: W_v <- R_Vᵀ W_v per KV head, bias b <- (b - μ_V) R_V, so it emits (v - μ_V) R_V.
    o: W_o[:, head h] <- W_o[:, h] R_V, bias += W_o · μ_V(h): the attention weights sum to 1,
    so the output of every query head is shifted by exactly -μ_V R_V, which this bias undoes.
    Returns (v_weight, v_bias, o_weight, o_bias); a bias is None only where it was None and no
    centering needs it.
    """
    r = rotation.double().to(v_weight.device)
    d = r.shape[0]
    w_o = o_weight.double()
    new_v_weight = _block_rotate_rows(v_weight, r, num_kv_heads)
    new_o_weight = (w_o.reshape(w_o.shape[0], num_heads, d) @ r).reshape(w_o.shape)
    if mean is not None:
        mu = mean.double().to(v_weight.device)  # [Hkv, d]
        base = torch.zeros(num_kv_heads, d, dtype=torch.float64, device=v_weight.device) if v_bias is None \
            else v_bias.double().reshape(num_kv_heads, d)
        v_bias = ((base - mu) @ r).reshape(-1)
        per_query_head = mu.repeat_interleave(num_heads // num_kv_heads, dim=0).reshape(-1)
        shift = w_o @ per_query_head
        o_bias = shift if o_bias is None else o_bias.double() + shift
    elif v_bias is not None:
        v_bias = (v_bias.double().reshape(num_kv_heads, d) @ r).reshape(-1)
    return new_v_weight, v_bias, new_o_weight, o_bias


def absorb_value_transform(module: nn.Module, rotation: torch.Tensor, mean: torch.Tensor | None, num_kv_heads: int,
                           num_heads: int) -> None:
    """Fold R_V (and the centering μ_V) into the weights of one attention layer
    (`value_transform_weights`). A missing bias is created; patching again always starts from the
    original weights."""
    v_proj, o_proj = module.v_proj, module.o_proj
    if not hasattr(module, "_oscar_original"):
        module._oscar_original = {
            name: None if tensor is None else tensor.detach().clone()
            for name, tensor in (("v_weight", v_proj.weight), ("v_bias", v_proj.bias), ("o_weight", o_proj.weight),
                                 ("o_bias", o_proj.bias))
        }
    original = module._oscar_original
    dtype = v_proj.weight.dtype
    v_weight, v_bias, o_weight, o_bias = value_transform_weights(
        original["v_weight"], original["v_bias"], original["o_weight"], original["o_bias"], rotation, mean,
        num_kv_heads, num_heads)
    with torch.no_grad():
        v_proj.weight.copy_(v_weight)
        o_proj.weight.copy_(o_weight)
        for linear, bias in ((v_proj, v_bias), (o_proj, o_bias)):
            linear.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)


def layer_specs(artifact: RotationArtifact, quant: QuantConfig, layer_types, sliding_window: int | None
                ) -> list[LayerSpec]:
    """The write spec of every layer: this layer's K rotation (None where the artifact chose the
    identity), clip ratios, centering mean, code width and window."""
    specs = []
    for layer, layer_type in zip(artifact.layers, layer_types):
        choice = layer.choice
        layer_quant = replace(quant, clip_ratio_k=layer.clip("k", quant.clip_ratio_k),
                              clip_ratio_v=layer.clip("v", quant.clip_ratio_v))
        identity = choice.get("k_transform", artifact.method) == "identity"
        specs.append(LayerSpec(
            k_rotation=None if identity else layer.k_rotation,
            quant=layer_quant,
            sliding_window=sliding_window if layer_type == "sliding_attention" else None,
            k_mean=layer.k_mean,
            key_bits=layer.key_bits,
            value_bits=layer.value_bits,
            key_inner=layer.inner("k"),
            value_inner=layer.inner("v"),
            plain_history=bool(choice.get("plain_history", False)),
        ))
    return specs


def with_key_shifts(specs: list[LayerSpec], centering: str, artifact: RotationArtifact, layer_types,
                    max_positions: int, frequencies) -> list[LayerSpec]:
    """The specs with the per-block key-mean shifts of key_centering 'rope' (`oscarkv.rope`).

    frequencies(layer_type) -> the RoPE inverse frequencies [D/2] of that layer type; it raises
    OscarError where they are not known. centering 'auto' keeps the fixed mean (returns `specs`)
    where the shifts do not apply, 'rope' raises, 'fixed' never shifts.
    """
    if centering == "fixed" or not artifact.centered:
        return specs
    try:
        positions = artifact.calibration.get("positions", "start")
        if positions != "start":
            raise OscarError(f"key_centering='rope' turns the key mean measured at positions [0, chunk), but this "
                             f"artifact was calibrated with positions={positions!r}; recalibrate with "
                             "--positions start or use key_centering='fixed'.")
        block = int(artifact.calibration.get("chunk_tokens", 1024))
        shifted = []
        for spec, layer_type in zip(specs, layer_types):
            if spec.k_mean is None:
                shifted.append(spec)
                continue
            shifts = rope.mean_shifts(spec.k_mean, frequencies(layer_type), block, max_positions)
            if spec.k_rotation is not None:
                shifts = rotate_heads(shifts, spec.k_rotation.to(torch.float64), head_axis=1)
            shifted.append(replace(spec, k_mean_shifts=shifts.float(), shift_block=block))
        return shifted
    except OscarError:
        if centering == "rope":
            raise
        return specs


def cache_keyword(model: nn.Module) -> str:
    """The keyword under which the model's forward takes its KV cache: "cache" from transformers
    5.24 (which renamed it), "past_key_values" before."""
    return _forward_cache_keyword(type(model))


@functools.cache
def _forward_cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def _given_cache(kwargs: dict):
    """The cache a caller passed under either keyword (transformers 5.24 still accepts the old one)."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def _inject_cache(model: nn.Module, args, kwargs):
    """Forward pre-hook: use an OscarCache where the caller passed none; record padding."""
    cache = _given_cache(kwargs)
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(model.config, "use_cache", True)
    if cache is None and use_cache:
        cache = model.oscar.new_cache(model.device)
        kwargs[cache_keyword(model)] = cache
    if isinstance(cache, (OscarCache, PagedOscarCache)) and cache.get_seq_length() == 0:
        cache.set_padding(kwargs.get("attention_mask"))
    return args, kwargs


def _prepare_cache_with_oscar(self, generation_config, model_kwargs, *args, **kwargs):
    if _given_cache(model_kwargs) is None and generation_config.use_cache is not False:
        model_kwargs[cache_keyword(self)] = self.oscar.new_cache(self.device)
    return type(self)._prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs)


def _generate(self, *args, **kwargs):
    """A patched model's generate: the static decode path where it serves the call exactly, else
    transformers' own (see `oscarkv.integrations.static_decode`)."""
    from .static_decode import generate_static, static_generate_arguments

    arguments = static_generate_arguments(self, args, kwargs)
    if arguments is None:
        return type(self).generate(self, *args, **kwargs)
    return generate_static(self, **arguments)


def patch_model(model: nn.Module, artifact: RotationArtifact, quant: QuantConfig | None = None,
                cache: CacheConfig | None = None) -> nn.Module:
    """Make `model` store its KV cache as OSCAR INT2 (in place; returns the model).

    quant: defaults to the artifact's group size and clip ratios; per-layer clip ratios and
        bits recorded in the artifact take precedence.
    cache: defaults to CacheConfig() (64 sink, 256 recent, BF16 windows, INT2 history).
    """
    artifact.check_model(model_identity(model))
    quant = quant or QuantConfig(artifact.group_size, artifact.clip_ratio_k, artifact.clip_ratio_v)
    cache = cache or CacheConfig()
    shape = attention_shape(model)
    quant.check_head_dim(shape.head_dim)
    for module, layer in zip(attention_modules(model), artifact.layers):
        absorb_value_transform(module, layer.v_rotation, layer.v_mean, shape.num_kv_heads, shape.num_heads)
    specs = layer_specs(artifact, quant, shape.layer_types, shape.sliding_window)
    max_positions = shape.max_positions or 32768
    specs = with_key_shifts(specs, cache.key_centering, artifact, shape.layer_types,
                            cache.max_context or max_positions, lambda kind: rope.inverse_frequencies(model, kind))
    model.oscar = OscarState(artifact, quant, cache, specs, shape.num_kv_heads, shape.head_dim, max_positions)
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    if not getattr(model, "_oscar_hooked", False):
        model.register_forward_pre_hook(_inject_cache, with_kwargs=True)
        model._prepare_cache_for_generation = types.MethodType(_prepare_cache_with_oscar, model)
        model.generate = types.MethodType(_generate, model)
        model._oscar_hooked = True
    return model
