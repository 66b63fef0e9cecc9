"""Decode steps and prompts: a model's RMSNorms as oscarkv's Triton kernel (`kernels/triton_norm.py`).

`triton_norms(model)` swaps, for the duration of a `with` block, the forward of every RMSNorm of a
known class (`RMS_NORMS`: the same formula in Llama, Mistral, Qwen2 and Qwen3) for one that runs the
kernel on contiguous half-precision rows on CUDA, and anything else through the forward that was in
place when the block began (the compiled one inside `compiled_small_ops`). On exit the model's own
forwards are back.

What it adds over the compiled norm is the overlap: on Hopper the kernel lets the launch after it
start early, so the matrix-vector products that follow a norm at batch 1 (q/k/v, the MLP's gate and
up, the LM head) load their weights while it runs.

It also folds the residual adds into the norms, for decoder layers of a known class
(`DECODER_LAYERS`: Llama, Mistral, Qwen2, Qwen3, whose forward is norm → attention → add → norm →
MLP → add): their forward is swapped for one that computes the add after attention together with
the post-attention norm, and the add after the MLP together with the next norm (the next layer's
input norm, or the model's final norm). That next norm's result is kept for its module
(`NormAhead`) and taken by its forward when it is called with the very sum tensor it was computed
from; called with anything else, it computes as usual. Rows the kernel does not take run the
layer's own forward.

The static decode path uses all this with `CacheConfig.compile_small_ops` (docs/decode-log.md). Like
the compiled norm, it can round a BF16 value differently from eager PyTorch (the order of the sum,
the rsqrt approximation); the adds round as eager's do.

Prompts (`static_decode.forward_slots`: the engine's prompt chunks, `generate_static`'s prefill, `bench decode
--prefill`) take the same swaps under the same option, where a forward reads at least
`static_decode.PROMPT_NORM_TOKENS` tokens, and nothing else of the decode steps' own operations (the compiled ones
would compile again for each new prompt length). An eager RMSNorm is about seven launches, each reading and writing
the whole activation in float32; here it is one launch, with the residual add in it. Shorter forwards stay eager: a
Triton launch costs the host more than an eager norm's launches, and on a slow host that outweighed what the GPU
saved (docs/decode-log.md, "Prompts: the norms in one launch").
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from ..kernels.hardware import overlaps_launches
from .swaps import forward_swaps

# classes whose forward is weight * (x.float() * rsqrt(mean(x²) + variance_epsilon)).to(x.dtype)
RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def is_known_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__ in RMS_NORMS and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float))


def takes_triton_norm(module: nn.Module, x: torch.Tensor) -> bool:
    """Contiguous rows of the weight's half-precision dtype, on CUDA (or under the Triton interpreter)."""
    from ..kernels.ops import resolve_backend
    from ..kernels.triton_norm import NORM_DTYPES

    return (x.dtype == module.weight.dtype and x.dtype in NORM_DTYPES and x.is_contiguous()
            and x.shape[-1] == module.weight.shape[0] and x.numel() > 0
            and resolve_backend("auto", x.device) == "triton")


# classes whose forward is: residual = h; h = input_layernorm(h); h = self_attn(hidden_states=h, **kwargs)[0];
# h = residual + h; residual = h; h = post_attention_layernorm(h); h = mlp(h); return residual + h
DECODER_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"})


class NormAhead:
    """Norm results computed ahead, one per norm module: (the input tensor, the result)."""

    def __init__(self) -> None:
        self.kept: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}

    def take(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        source, result = self.kept.get(norm, (None, None))
        if source is not x:
            return None
        del self.kept[norm]
        return result


def _rms_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None):
    """norm(x), or with a residual (residual + x, norm(residual + x)), by the kernel."""
    from ..kernels.triton_norm import launch_rms_norm

    out = torch.empty_like(x)
    if residual is None:
        launch_rms_norm(x, norm.weight, norm.variance_epsilon, out, overlap=overlaps_launches(x))
        return out
    summed = torch.empty_like(x)
    launch_rms_norm(x, norm.weight, norm.variance_epsilon, out, overlap=overlaps_launches(x), residual=residual, summed=summed)
    return summed, out


def _forward_with_ahead(self: nn.Module, ahead: NormAhead, previous: Callable, x: torch.Tensor) -> torch.Tensor:
    kept = ahead.take(self, x)
    if kept is not None:
        return kept
    if not takes_triton_norm(self, x):
        return previous(x)
    return _rms_norm(self, x)


def _fits(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> bool:
    return (takes_triton_norm(norm, x) and residual.shape == x.shape and residual.dtype == x.dtype
            and residual.is_contiguous())


def _layer_forward(layer: nn.Module, next_norm: nn.Module | None, ahead: NormAhead, previous: Callable,
                   *args, **kwargs) -> torch.Tensor:
    hidden = kwargs.pop("hidden_states", None) if not args else args[0]
    if len(args) > 1 or hidden is None or not takes_triton_norm(layer.post_attention_layernorm, hidden):
        return previous(*args, **kwargs) if args else previous(hidden_states=hidden, **kwargs)
    residual = hidden
    hidden, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden), **kwargs)
    if not _fits(layer.post_attention_layernorm, hidden, residual):
        hidden = residual + hidden
        residual, hidden = hidden, layer.post_attention_layernorm(hidden)
    else:
        residual, hidden = _rms_norm(layer.post_attention_layernorm, hidden, residual)
    hidden = layer.mlp(hidden)
    if next_norm is None or not _fits(next_norm, hidden, residual):
        return residual + hidden
    summed, normed = _rms_norm(next_norm, hidden, residual)
    ahead.kept[next_norm] = (summed, normed)
    return summed


def decoder_layers(model: nn.Module) -> list[tuple[nn.Module, nn.Module | None]]:
    """(layer, the norm its output goes to next) for the known decoder layers of each layer stack whose
    norms are known RMSNorms: the next layer's input norm, the stack's final norm, or None."""
    found = []
    for stack in model.modules():
        layers, final = getattr(stack, "layers", None), getattr(stack, "norm", None)
        if not isinstance(layers, nn.ModuleList) or not all(
                type(m).__name__ in DECODER_LAYERS and is_known_rms_norm(m.input_layernorm)
                and is_known_rms_norm(m.post_attention_layernorm) for m in layers):
            continue
        nexts = [m.input_layernorm for m in list(layers)[1:]] + [final if final is not None and
                                                                 is_known_rms_norm(final) else None]
        found += list(zip(layers, nexts))
    return found


@contextmanager
def triton_norms(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Run the model's known RMSNorms through the Triton kernel, with the residual adds of known decoder layers
    folded in, inside the block (see the module doc)."""
    ahead = NormAhead()
    try:
        with forward_swaps() as swap:
            if enabled:
                for layer, next_norm in decoder_layers(model):
                    swap(layer, functools.partial(_layer_forward, layer, next_norm, ahead, layer.forward))
                for module in model.modules():
                    if is_known_rms_norm(module):
                        swap(module, functools.partial(_forward_with_ahead, module, ahead, module.forward))
            yield
    finally:
        ahead.kept.clear()
