"""Decode steps: a known attention module's queries and keys prepared in one launch.

Between its projections and the attention, a decode step of a Llama/Qwen-style attention module
runs the q and k RMSNorms (Qwen3), the rotary embedding of q and of k, and, with the INT2 cache,
the queries' rotation by R_K: five small kernels per layer, and the write kernel rotates the keys
by R_K again. `fused_decode_attention(model)` swaps, for the duration of a `with` block, the
forward of each attention module of a known class (`DECODE_ATTENTIONS`) for one that sends
one-token rows to `ops.decode_query_key` (one Triton launch on CUDA, `kernels/triton_decode_qk.py`),
which also centers and rotates the keys where the cache layer takes them so
(`AttendingLayer.takes_rotated_keys`: the paged INT2 cache, whose write then only stores them),
writes the keys and values through the cache, and hands the prepared queries to the cache layer
(`AttendingLayer.attend_decode`). The cache layer does those steps (`AttendingLayer.prepare_decode`):
the paged INT2 cache runs its write in the same launch on the kernels (`ops.decode_query_key_write`).

It takes a row only when the module's own forward would do exactly this with it: one token per
row, the model patched with the "oscar" attention, a cache whose layer attends itself (the paged
INT2 cache or the BF16 slot cache) and is already initialized, cos/sin of the head dimension,
norms of a known RMSNorm class. Anything else (prompts, other caches, other classes) runs the
forward that was in place. On exit the model's own forwards are back.

The static decode path uses it with `CacheConfig.compile_small_ops`, for both caches, so the BF16
baseline gets the same fusion (its queries are not rotated). Rounding: as the Triton RMSNorm, a
norm's sum may run in another order than PyTorch's (one ulp on a few values).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from ..models import attention_modules
from .norms import is_known_rms_norm
from .paged import AttendingLayer
from .swaps import forward_swaps

# classes whose forward is: q = q_norm?(q_proj(x)), k = k_norm?(k_proj(x)), v = v_proj(x) per head;
# q, k = apply_rotary_pos_emb(q, k, cos, sin) (rotate_half); k, v = cache.update(k, v, layer_idx);
# out = attention_interface(q, k, v, scaling=self.scaling, sliding_window=...); o_proj(out)
DECODE_ATTENTIONS = frozenset({"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention"})
CACHE_KEYWORDS = ("past_key_values", "cache", "past_key_value")  # by transformers version


def sliding_window(module: nn.Module) -> int | None:
    """The window the module's forward passes to its attention function."""
    if type(module).__name__ == "MistralAttention":
        return getattr(module.config, "sliding_window", None)
    return getattr(module, "sliding_window", None)


def _norm(module: nn.Module, name: str) -> tuple[torch.Tensor, float] | None | bool:
    """(weight, eps) of the module's q_norm / k_norm, None without one, False if not a known RMSNorm."""
    norm = getattr(module, name, None)
    if norm is None:
        return None
    return (norm.weight, norm.variance_epsilon) if is_known_rms_norm(norm) else False


def _decode_layer(module: nn.Module, hidden: torch.Tensor | None, position_embeddings, cache) -> AttendingLayer | None:
    """The cache layer that takes this call's rows, or None for the module's own forward."""
    if hidden is None or hidden.dim() != 3 or hidden.shape[1] != 1 or position_embeddings is None:
        return None
    if getattr(module.config, "_attn_implementation", None) != "oscar" or cache is None:
        return None
    layers = getattr(cache, "layers", None)
    if layers is None or module.layer_idx >= len(layers):
        return None
    layer = layers[module.layer_idx]
    if not isinstance(layer, AttendingLayer) or not layer.is_initialized:
        return None
    cos, sin = position_embeddings
    b, d = hidden.shape[0], module.head_dim
    if cos.shape[-1] != d or cos.numel() not in (d, b * d) or sin.shape != cos.shape:
        return None
    return layer


def _forward(module: nn.Module, norms: tuple, previous: Callable, *args, **kwargs):
    hidden = kwargs.get("hidden_states")
    position_embeddings = kwargs.get("position_embeddings")
    cache = next((kwargs[n] for n in CACHE_KEYWORDS if kwargs.get(n) is not None), None)
    layer = None if args else _decode_layer(module, hidden, position_embeddings, cache)
    if layer is None:
        return previous(*args, **kwargs)
    b, d = hidden.shape[0], module.head_dim
    q = module.q_proj(hidden).view(b, -1, d)
    k = module.k_proj(hidden).view(b, -1, d)
    v = module.v_proj(hidden).view(b, -1, d)
    cos, sin = (x.reshape(-1, d).expand(b, d) for x in position_embeddings)
    query = layer.prepare_decode(q, k, v, cos, sin, norms, getattr(cache, "backend", "auto"))
    out = layer.attend_decode(query, module.scaling, sliding_window(module))
    return module.o_proj(out.reshape(b, 1, -1)), None


def fused_modules(model: nn.Module) -> list[tuple[nn.Module, tuple]]:
    """(module, (q_norm, k_norm)) for the attention modules of a known class whose norms are known or absent."""
    found = []
    for module in attention_modules(model):
        norms = (_norm(module, "q_norm"), _norm(module, "k_norm"))
        if type(module).__name__ in DECODE_ATTENTIONS and all(n is not False for n in norms):
            found.append((module, norms))
    return found


@contextmanager
def fused_decode_attention(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Run one-token rows of the known attention modules with their queries and keys prepared in one launch
    inside the block (see the module doc)."""
    with forward_swaps() as swap:
        if enabled:
            for module, norms in fused_modules(model):
                swap(module, functools.partial(_forward, module, norms, module.forward))
        yield
