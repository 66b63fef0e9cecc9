"""Fewer kernels per decode step: a model's norms, MLPs and rotary embedding compiled by torch.compile.

A decode step of a transformers model runs each small operation as its own kernel: an
RMSNorm is about seven (cast, square, mean, add, rsqrt, multiply, cast and scale), the
rotary embedding about ten, the MLP's activation two. Inside a CUDA graph they cost no host
time, but each still costs 1-3 µs of GPU time: at batch 1 on the Qwen3-4B shape, about
1,400 of them take about 3.5 ms of a 10 ms step, the same for the BF16 and the INT2 cache
(docs/decode-log.md). torch.compile (inductor) fuses each of these modules into one or two
kernels and leaves the matrix products to cuBLAS.

`compiled_small_ops(model)` swaps the compiled forwards in for the duration of a `with`
block, and puts the model's own back on exit:
- every normalization module (a class named `*RMSNorm`): its forward;
- every MLP module (a class named `*MLP` with gate/up/down projections): its forward;
- the `apply_rotary_pos_emb` function of the attention modules' modeling file (the
  attention forward looks it up there when it runs).
One compiled function serves all instances of a class; each new input shape compiles once,
in the eager steps before a CUDA graph is captured. The attention itself and the cache are
not compiled: they are oscarkv's own kernels.

The static decode path (`oscarkv.integrations.static_decode`) uses it around its decode
steps when `CacheConfig.compile_small_ops` is on (the default), on CUDA only. Compiled
kernels may round a few BF16 values differently from eager PyTorch (the order of a norm's
sum, exp and rsqrt approximations), so a logit can move by an ulp and a greedy run can part
from transformers' loop at a near-tie (docs/decode-log.md); compile_small_ops=False keeps eager
rounding exactly. The rotary function is swapped in its modeling file, for every model of
that file in the process, while the block runs.
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from ..models import attention_modules
from .swaps import forward_swaps

ROTARY_FUNCTION = "apply_rotary_pos_emb"
# (the model's class or function, torch.compile backend) -> its compiled version
_compiled: dict[tuple[object, str], Callable] = {}


def _compile(key: object, function: Callable, backend: str) -> Callable:
    if (key, backend) not in _compiled:
        import torch._inductor.config as inductor_config

        options = None
        if backend == "inductor" and hasattr(inductor_config, "emulate_precision_casts"):
            # round intermediate BF16 results where eager PyTorch does (e.g. q*cos and
            # rotate_half(q)*sin before their sum), so the kernels differ from eager only in the
            # order of a norm's sum and in exp/rsqrt approximations
            options = {"emulate_precision_casts": True}
        _compiled[key, backend] = torch.compile(function, backend=backend, options=options)
    return _compiled[key, backend]


def can_compile() -> bool:
    """Whether torch.compile runs in this Python (TorchDynamo does not support every version)."""
    return bool(torch._dynamo.is_dynamo_supported())


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "weight")


def _is_mlp(module: nn.Module) -> bool:
    return type(module).__name__.endswith("MLP") and all(
        hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj"))


def small_op_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose forwards `compiled_small_ops` compiles: the norms and the MLPs."""
    return [m for m in model.modules() if _is_norm(m) or _is_mlp(m)]


def rotary_namespaces(model: nn.Module) -> list[types.ModuleType]:
    """The modeling files whose attention forward calls a module-level `apply_rotary_pos_emb`."""
    found = {}
    for attention in attention_modules(model):
        namespace = sys.modules.get(type(attention).__module__)
        if namespace is not None and callable(getattr(namespace, ROTARY_FUNCTION, None)):
            found[namespace.__name__] = namespace
    return list(found.values())


@contextmanager
def compiled_small_ops(model: nn.Module, enabled: bool = True, backend: str = "inductor") -> Iterator[None]:
    """Run the model's norms, MLPs and rotary embedding compiled inside the block (see the module doc).

    enabled=False, or a Python that torch.compile does not support, runs the block unchanged.
    backend: torch.compile's backend ("eager" traces without generating kernels, for tests).
    """
    if not enabled or not can_compile():
        yield
        return
    swapped_functions = []
    try:
        with forward_swaps() as swap:
            for module in small_op_modules(model):
                if "forward" in vars(module):  # someone else's per-instance forward: leave it
                    continue
                cls = type(module)
                swap(module, types.MethodType(_compile(cls, cls.forward, backend), module))
            for namespace in rotary_namespaces(model):
                original = getattr(namespace, ROTARY_FUNCTION)
                setattr(namespace, ROTARY_FUNCTION, _compile(original, original, backend))
                swapped_functions.append((namespace, original))
            yield
    finally:
        for namespace, original in swapped_functions:
            setattr(namespace, ROTARY_FUNCTION, original)
