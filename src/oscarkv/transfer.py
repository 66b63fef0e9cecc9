"""Small host values onto the device without making the host wait for it.

`torch.tensor(values, device="cuda")` and `.to("cuda")` of a tensor in ordinary (pageable) host memory
wait until the device's stream is idle before they copy. Done once per forward (a step's lengths, the
new positions, a newly reserved page), that wait drains the queue of kernels the host had launched
ahead, so each chunk of a chunked prefill starts from an idle GPU. `to_device` copies through pinned
memory without blocking instead; PyTorch keeps the pinned buffer until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A (nested) list of numbers as a tensor of `dtype` on `device`; on CUDA without a synchronisation."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
