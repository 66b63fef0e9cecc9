"""Facts about the GPU that the launch heuristics use."""

from __future__ import annotations

import functools

import torch


@functools.cache
def multiprocessors(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device `device_index`."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def programmatic_launch_supported(device_index: int) -> bool:
    """Whether kernels on CUDA device `device_index` can use programmatic dependent launch (a
    launch that starts before the one before it ends, and waits for it where it must): Hopper or
    later, and a Triton that exposes it (`launch_pdl`, `gdc_wait`; Triton >= 3.3)."""
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__


@functools.cache
def register_cap_supported() -> bool:
    """Whether this Triton takes a register cap per launch (`maxnreg`)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "maxnreg" in CUDAOptions.__dataclass_fields__


def overlaps_launches(x: torch.Tensor) -> bool:
    """Whether kernels on x's device use programmatic dependent launch (CUDA, Hopper or later)."""
    return x.device.type == "cuda" and programmatic_launch_supported(x.device.index or 0)
