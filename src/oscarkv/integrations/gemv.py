"""Decode steps: the model's linear layers as Triton matrix-vector and few-rows products.

`gemv_linears(model)` swaps, for the duration of a `with` block, forwards that send 1 to
`MAX_ROWS` (32) input rows (a decode step's batch) to the kernels of `kernels/triton_gemv.py`
(one row: the matrix-vector kernels; more: the few-rows kernels), and anything else to what
ran before. On exit the model's own forwards are back.
- **Every `nn.Linear`**: one product, `oscarkv::gemv`. It is a torch custom op, so the MLP
  forwards that `compiled_small_ops` compiles (where the MLP is not one of the gated ones
  below) call it as one opaque kernel.
- **The q, k and v projections of an attention module** (plain `nn.Linear`s of the same input
  size; where some have a bias and others not, as when an `oscar` artifact's value mean becomes a
  v_proj bias on a model without one, the others add zeros): the first of them called with a row computes all
  three in one launch and keeps the other two outputs for their calls with the same input
  tensor (`SharedInputProjections`; with several rows, each output is a contiguous [M, N] block of
  one buffer, as the projection's own output would be, so a decode step's values need no copy
  before the cache write). Called with any other input, a projection computes alone.
- **A gated SiLU MLP** (`GATED_SILU_MLPS`: down(silu(gate(x)) * up(x)) without biases): one
  launch for silu(gate·x) * up·x, then the down projection. Other rows go to the forward that
  was in place when the block began (the compiled one inside `compiled_small_ops`).

On Hopper the launches overlap their predecessors (programmatic dependent launch; see
`triton_gemv`). The static decode path uses all this on CUDA when `CacheConfig.decode_gemv` is
on (the default). The products sum in a different order from cuBLAS, so a logit can move by a
BF16 ulp, as with the compiled small operations (docs/decode-log.md); decode_gemv=False keeps cuBLAS.
"""

from __future__ import annotations

import functools
import types
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.hardware import overlaps_launches
from .swaps import forward_swaps

# MLP classes whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)) (transformers 5)
GATED_SILU_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
SILU_CLASSES = frozenset({"SiLU", "SiLUActivation"})


@torch.library.custom_op("oscarkv::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [K] or [M, K] times weight [N, K]ᵀ (+ bias) -> [N] or [M, N], by the Triton kernels."""
    from ..kernels.triton_gemv import launch_gemv

    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    launch_gemv(x, weight, bias, out, overlap=overlaps_launches(x))
    return out


@gemv.register_fake
def _gemv_shape(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def input_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K > 0) as the kernels take it: [K] for one row, else [M, K], contiguous."""
    rows = x.numel() // x.shape[-1]
    return x.reshape(-1).contiguous() if rows == 1 else x.reshape(rows, x.shape[-1]).contiguous()


def takes_gemv(linear: nn.Linear, x: torch.Tensor) -> bool:
    """Whether `x` is 1 to MAX_ROWS rows (a decode step's batch) that the kernels handle: same half-precision
    dtype as the weight, a weight with unit stride along K, on CUDA (or under the Triton interpreter)."""
    from ..kernels.ops import resolve_backend
    from ..kernels.triton_gemv import GEMV_DTYPES, MAX_ROWS

    weight = linear.weight
    return (x.dim() >= 1 and x.shape[-1] == weight.shape[1] > 0 and 1 <= x.numel() // x.shape[-1] <= MAX_ROWS
            and x.dtype == weight.dtype and x.dtype in GEMV_DTYPES
            and weight.stride(1) == 1 and (linear.bias is None or linear.bias.dtype == x.dtype)
            and resolve_backend("auto", x.device) == "triton")


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if takes_gemv(self, x):
        y = torch.ops.oscarkv.gemv(input_rows(x), self.weight, self.bias)
        return y.view(*x.shape[:-1], self.weight.shape[0])
    return F.linear(x, self.weight, self.bias)


class SharedInputProjections:
    """Linear layers that a module calls one after another on the same input (q, k, v): at one row,
    the first call computes them all in one launch and the others take their outputs."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.linears = linears
        self.source: torch.Tensor | None = None
        self.pending: dict[int, torch.Tensor] = {}
        # The launch takes a bias for every product or for none: zeros stand in for the missing ones (made here,
        # before any CUDA graph is captured).
        biased = any(m.bias is not None for m in linears)
        self.zero_biases = {i: torch.zeros(m.out_features, dtype=m.weight.dtype, device=m.weight.device)
                            for i, m in enumerate(linears) if biased and m.bias is None}

    @staticmethod
    def fits(linears: list[nn.Linear]) -> bool:
        """Plain linears of one input size, dtype and device (biases on any of them)."""
        first = linears[0]
        return all(type(m) is nn.Linear and "forward" not in vars(m) for m in linears) and all(
            m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
            and m.weight.device == first.weight.device for m in linears)

    def biases(self) -> list[torch.Tensor | None] | None:
        """One bias per product for the launch (zeros where a projection has none), all None, or None where a bias
        appeared after the group was made (the projections then compute alone)."""
        biases = [m.bias if m.bias is not None else self.zero_biases.get(i) for i, m in enumerate(self.linears)]
        return biases if all(b is None for b in biases) or all(b is not None for b in biases) else None

    def forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if x is self.source and index in self.pending:
            return self.pending.pop(index)
        biases = self.biases()
        if biases is None or not all(takes_gemv(m, x) for m in self.linears):
            return _forward(self.linears[index], x)
        from ..kernels.triton_gemv import launch_gemv

        sizes = [m.out_features for m in self.linears]
        rows = input_rows(x)
        count = rows.numel() // rows.shape[-1]
        joined = x.new_empty(count * sum(sizes))  # each product contiguous after the one before (`launch_gemv`)
        launch_gemv(rows, [m.weight for m in self.linears], biases, joined, overlap=overlaps_launches(x))
        outputs = [y.view(*x.shape[:-1], n) for y, n in zip(joined.split([count * n for n in sizes]), sizes)]
        self.source = x
        self.pending = {i: y for i, y in enumerate(outputs) if i != index}
        return outputs[index]

    def clear(self) -> None:
        self.source, self.pending = None, {}


def is_gated_silu_mlp(module: nn.Module) -> bool:
    """A known gated MLP class with plain bias-free linears, gate and up of one shape, and a SiLU activation."""
    linears = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return (type(module).__name__ in GATED_SILU_MLPS and type(getattr(module, "act_fn", None)).__name__ in SILU_CLASSES
            and all(type(m) is nn.Linear and m.bias is None for m in linears)
            and linears[0].weight.shape == linears[1].weight.shape)


def _gated_silu_forward(self: nn.Module, previous: Callable, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj, self.up_proj
    if not (takes_gemv(gate, x) and takes_gemv(up, x)):
        return previous(x)
    from ..kernels.triton_gemv import launch_gemv_silu_mul

    rows = input_rows(x)
    hidden = x.new_empty(*rows.shape[:-1], gate.out_features)
    launch_gemv_silu_mul(rows, gate.weight, up.weight, hidden, overlap=overlaps_launches(x))
    return self.down_proj(hidden.view(*x.shape[:-1], gate.out_features))


def attention_projections(module: nn.Module) -> list[nn.Linear] | None:
    """A module's q, k and v projections where they can share one launch, else None."""
    linears = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    if any(m is None for m in linears) or not SharedInputProjections.fits(linears):
        return None
    return linears


@contextmanager
def gemv_linears(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Run the model's linear products of 1 to MAX_ROWS rows (a decode step's batch) through the Triton kernels
    inside the block (see the module doc). Enter it inside `compiled_small_ops`, so that other inputs keep the
    compiled MLPs."""
    groups: list[SharedInputProjections] = []
    try:
        with forward_swaps() as swap:
            if enabled:
                for module in model.modules():
                    projections = attention_projections(module)
                    if projections is not None:
                        group = SharedInputProjections(projections)
                        groups.append(group)
                        for index, linear in enumerate(projections):
                            swap(linear, functools.partial(group.forward, index))
                    if is_gated_silu_mlp(module):
                        swap(module, functools.partial(_gated_silu_forward, module, module.forward))
                for module in model.modules():
                    if type(module) is nn.Linear and "forward" not in vars(module):
                        swap(module, types.MethodType(_forward, module))
            yield
    finally:
        for group in groups:
            group.clear()
