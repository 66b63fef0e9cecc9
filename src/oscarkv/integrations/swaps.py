"""Per-instance forwards swapped in for a `with` block and put back after it."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from torch import nn


@contextmanager
def forward_swaps() -> Iterator[Callable[[nn.Module, Callable], None]]:
    """Yields `swap(module, forward)`, which sets a module's per-instance forward for the block. On exit,
    in reverse order, every swapped module gets back the per-instance forward it had (or none)."""
    swapped: list[tuple[nn.Module, Callable | None]] = []

    def swap(module: nn.Module, forward: Callable) -> None:
        swapped.append((module, vars(module).get("forward")))
        module.forward = forward

    try:
        yield swap
    finally:
        for module, previous in reversed(swapped):
            if previous is None:
                del module.forward
            else:
                module.forward = previous
