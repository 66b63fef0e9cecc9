"""Batch-1 decode steps: the model's linear layers as a Triton matrix-vector product.

`gemv_linears(model)` swaps, for the duration of a `with` block, the forward of every
`nn.Linear` in the model for one that sends a single input row (a batch-1 decode step) to
`oscarkv::gemv` (`kernels/triton_gemv.py`) and anything else to `F.linear` as before. On
exit the model's own forwards are back. `oscarkv::gemv` is a torch custom op, so the MLP
forwards that `compiled_small_ops` compiles call it as one opaque kernel.

The static decode path uses it on CUDA when `CacheConfig.decode_gemv` is on (the default).
The products sum in a different order from cuBLAS, so a logit can move by a BF16 ulp, as with
the compiled small operations (docs/decode.md); decode_gemv=False keeps cuBLAS.
"""

import types
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn


@torch.library.custom_op("oscarkv::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """weight [N, K] · x [K] (+ bias) -> [N], by the Triton kernel."""
    from ..kernels.triton_gemv import launch_gemv

    out = torch.empty(weight.shape[0], dtype=x.dtype, device=x.device)
    launch_gemv(x, weight, bias, out)
    return out


@gemv.register_fake
def _gemv_shape(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty(weight.shape[0])


def takes_gemv(linear: nn.Linear, x: torch.Tensor) -> bool:
    """Whether `x` is one row that the kernel handles: same half-precision dtype as the weight, a weight
    with unit stride along K, on CUDA (or under the Triton interpreter)."""
    from ..kernels.ops import resolve_backend
    from ..kernels.triton_gemv import GEMV_DTYPES

    weight = linear.weight
    return (x.numel() == x.shape[-1] == weight.shape[1] and x.dtype == weight.dtype and x.dtype in GEMV_DTYPES
            and weight.stride(1) == 1 and (linear.bias is None or linear.bias.dtype == x.dtype)
            and resolve_backend("auto", x.device) == "triton")


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if takes_gemv(self, x):
        y = torch.ops.oscarkv.gemv(x.reshape(-1).contiguous(), self.weight, self.bias)
        return y.view(*x.shape[:-1], self.weight.shape[0])
    return F.linear(x, self.weight, self.bias)


@contextmanager
def gemv_linears(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Run the model's single-row linear products through `oscarkv::gemv` inside the block."""
    swapped = []
    try:
        if enabled:
            for module in model.modules():
                if type(module) is nn.Linear and "forward" not in vars(module):
                    module.forward = types.MethodType(_forward, module)
                    swapped.append(module)
        yield
    finally:
        for module in swapped:
            del module.forward
