"""Developer tool (GPU): warps per program of a decode step's merged flush-and-write launch
(`triton_write.DECODE_WRITE_WARPS`), timed as whole CUDA-graph decode steps (one step in 64 flushes a page), the
choices in turn in one process. Qwen3-4B shape by default, random weights, batch 1, INT2 (Hadamard).

    PYTHONPATH=src:scripts python scripts/probe_write_warps.py [--contexts 100000] [--warps 4,1,2,8]
"""
import sys

sys.path.insert(0, "scripts")
from check_static_decode import ablation_arguments, sweep  # noqa: E402
from oscarkv.kernels import triton_write  # noqa: E402

args = ablation_arguments(warps="4,1,2,8")
shipped = triton_write.DECODE_WRITE_WARPS


def using(warps: int):
    def use():
        triton_write.DECODE_WRITE_WARPS = warps
    return use


sweep(args, {f"{w} warps": using(int(w)) for w in args.warps.split(",")})
triton_write.DECODE_WRITE_WARPS = shipped
