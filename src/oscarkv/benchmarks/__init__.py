"""GPU benchmarks: `attention` (one layer's kernels against SDPA) and `decode` (whole-model decode steps)."""

from __future__ import annotations

from ..errors import OscarError


def require_cuda(command: str, hint: str = "") -> None:
    """Refuse a GPU benchmark on a machine without a visible CUDA GPU, in one line, before any work or progress
    bar starts. hint: a sentence added to the message."""
    import torch

    if not torch.cuda.is_available():
        raise OscarError(f"`oscarkv {command}` measures a CUDA GPU and none is visible on this machine; run it on a "
                         f"machine with an NVIDIA GPU.{' ' + hint if hint else ''}")
