"""Developer tool (GPU): where one decode step's attention time goes, and what overlapping its launches saves.

    PYTHONPATH=src python scripts/probe_decode_launches.py [--shapes 1x8192,1x131072,32x32768]

For each (batch, context) of `oscarkv bench attention` (Qwen3 shapes, random cache), it records the
launches that `launch_attention` makes (history splits, window splits, combine) and times each alone
and in pairs, then times the whole step serial and overlapped by programmatic dependent launch, history
first and window first. Every time is a CUDA-graph replay (launch overhead of the host excluded), so
what is left between kernels is the GPU's own gap from one launch to the next. The overlapped outputs
must equal the serial ones bit for bit.
"""

from __future__ import annotations

import argparse

import torch

from oscarkv.benchmarks.attention import _time_us, decode_bytes, decode_case
from oscarkv.kernels import triton_attention
from oscarkv.kernels.hardware import programmatic_launch_supported
from oscarkv.kernels.ops import choose_splits, window_split_count
from oscarkv.kernels.triton_attention import launch_attention


class _Recorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **options)` is recorded, not launched."""

    def __init__(self, kernel, name: str, calls: list):
        self.kernel, self.name, self.calls = kernel, name, calls

    def __getitem__(self, grid):
        return lambda *args, **options: self.calls.append((self.name, self.kernel, grid, args, options))


def recorded_launches(launch) -> list:
    """The (name, kernel, grid, args, options) of each launch that `launch()` makes, in order."""
    calls: list = []
    saved = triton_attention._paged_attention_kernel, triton_attention._combine_kernel
    triton_attention._paged_attention_kernel = _Recorder(saved[0], "attention", calls)
    triton_attention._combine_kernel = _Recorder(saved[1], "combine", calls)
    try:
        launch()
    finally:
        triton_attention._paged_attention_kernel, triton_attention._combine_kernel = saved
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x8192,1x32768,1x131072,32x8192,32x32768")
    args = parser.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(device), "| programmatic dependent launch:",
          programmatic_launch_supported(device.index or 0))
    tiny = torch.zeros(16, device=device)
    print(f"graph floor: one tiny kernel {_time_us(lambda: tiny.add_(1)):.2f} us, three "
          f"{_time_us(lambda: (tiny.add_(1), tiny.add_(1), tiny.add_(1))):.2f} us")
    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        case = decode_case(batch, context)
        layer, step, q, k, v = case.layer, case.step, case.q, case.k_new, case.v_new
        splits = choose_splits(layer, batch, 1, 32, context, device)
        window_splits = window_split_count(layer, batch, 1, 32, splits, context, device)
        workspace = (torch.empty(batch, 32, splits, 128, device=device), torch.empty(batch, 32, splits, device=device))
        nbytes = decode_bytes(case, context)

        def launch(overlap: bool, window_first: bool, out: torch.Tensor) -> None:
            launch_attention(layer, step, q, k, v, out, 128 ** -0.5, 0, splits, workspace,
                             window_splits=window_splits, overlap=overlap, window_first=window_first)

        serial_out = torch.empty_like(q)
        calls = recorded_launches(lambda: launch(False, False, serial_out))
        parts = {}
        for name, kernel, grid, kargs, options in calls:
            label = {1: "history", 2: "windows"}.get(options.get("REGIONS"), name)
            parts[label] = (lambda kernel=kernel, grid=grid, kargs=kargs, options=options:
                            kernel[grid](*kargs, **options))
        print(f"{shape}: {splits} splits ({window_splits} for the windows), {nbytes / 1e6:.1f} MB to read")
        rows = list(parts.items())
        rows.append(("history + combine", lambda: (parts["history"](), parts["combine"]())))
        launch(False, False, serial_out)
        for name, overlap, window_first in (("serial", False, False), ("overlapped, history first", True, False),
                                            ("overlapped, window first", True, True)):
            out = torch.zeros_like(q)
            launch(overlap, window_first, out)
            assert torch.equal(out, serial_out), name
            rows.append((name, lambda o=overlap, w=window_first, out=out: launch(o, w, out)))
        for name, fn in rows:
            us = _time_us(fn)
            print(f"  {name:28s} {us:8.2f} us  {nbytes / us / 1e3:6.0f} GB/s")
        del case, workspace
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
