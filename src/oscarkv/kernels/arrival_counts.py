"""Arrival counts of launches whose last program to arrive finishes the work of several (split-K matrix products,
the decode attention's merge in its window programs): int32 zeros per device, stream and user, which each launch's
last programs set back to zero, so that one buffer serves every launch and CUDA-graph replay."""

from __future__ import annotations

import torch

MIN_COUNTS = 4096
_COUNTS: dict[tuple, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # kept alive: CUDA graphs captured before may still use them


def arrival_counts(device: torch.device, count: int, user: str) -> torch.Tensor:
    """At least `count` zeroed counters for `user`'s launches on the current stream of `device` (a buffer of its
    own per user, so that launches of different kernels never share a counter)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream, user)
    counts = _COUNTS.get(key)
    if counts is None or counts.numel() < count:
        if counts is not None:
            _OUTGROWN.append(counts)
        counts = _COUNTS[key] = torch.zeros(max(count, MIN_COUNTS), dtype=torch.int32, device=device)
    return counts
