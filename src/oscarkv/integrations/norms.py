"""Decode steps: a model's RMSNorms as oscarkv's Triton kernel (`kernels/triton_norm.py`).

`triton_norms(model)` swaps, for the duration of a `with` block, the forward of every RMSNorm of a
known class (`RMS_NORMS`: the same formula in Llama, Mistral, Qwen2 and Qwen3) for one that runs the
kernel on contiguous half-precision rows on CUDA, and anything else through the forward that was in
place when the block began (the compiled one inside `compiled_small_ops`). On exit the model's own
forwards are back.

What it adds over the compiled norm is the overlap: on Hopper the kernel lets the launch after it
start early, so the matrix-vector products that follow a norm at batch 1 (q/k/v, the MLP's gate and
up, the LM head) load their weights while it runs. The static decode path uses it with
`CacheConfig.compile_small_ops` (docs/decode.md). Like the compiled norm, it can round a BF16 value
differently from eager PyTorch (the order of the sum, the rsqrt approximation).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

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


def _forward(self: nn.Module, previous: Callable, x: torch.Tensor) -> torch.Tensor:
    if not takes_triton_norm(self, x):
        return previous(x)
    from ..kernels.triton_norm import launch_rms_norm
    from .gemv import _overlap

    out = torch.empty_like(x)
    launch_rms_norm(x, self.weight, self.variance_epsilon, out, overlap=_overlap(x))
    return out


@contextmanager
def triton_norms(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Run the model's known RMSNorms through the Triton kernel inside the block (see the module doc)."""
    swapped: list[tuple[nn.Module, Callable | None]] = []
    try:
        if enabled:
            for module in model.modules():
                if is_known_rms_norm(module):
                    swapped.append((module, vars(module).get("forward")))
                    module.forward = functools.partial(_forward, module, module.forward)
        yield
    finally:
        for module, previous in reversed(swapped):
            if previous is None:
                del module.forward
            else:
                module.forward = previous
