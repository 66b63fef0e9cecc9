"""Programmatic dependent launch for the Triton kernels: a launch that starts before the one
before it ends, and waits for it where it must (Hopper and later; Triton >= 3.3).

A kernel launched with `programmatic(True)` may start while the kernel before it is still
running. It must call `gdc_wait()` before it reads anything that kernel writes; the kernel
before it may call `gdc_launch_dependents()` to let it start early (without that call it starts
when the kernel before it ends, with the launch itself overlapped). Where Triton lacks these,
the stand-ins below are never traced: the launchers only pass the options where
`hardware.programmatic_launch_supported` is true.
"""

import triton

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - old Triton
    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass


def programmatic(overlap: bool) -> dict:
    """Launch options of a launch that may start before the one before it ends."""
    return dict(launch_pdl=True) if overlap else {}
