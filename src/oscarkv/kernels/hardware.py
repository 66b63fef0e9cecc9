"""Facts about the GPU that the launch heuristics use."""

from __future__ import annotations

import functools

import torch


@functools.cache
def multiprocessors(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device `device_index`."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
