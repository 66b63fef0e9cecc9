"""Developer tool (GPU): warps per program of the decode steps' Triton RMSNorm (`triton_norm.norm_warps`), timed as
whole CUDA-graph decode steps, the choices in turn in one process. Qwen3-4B shape by default (rows of 2560),
random weights, batch 1, INT2 (Hadamard).

    PYTHONPATH=src:scripts python scripts/probe_norm_warps.py [--contexts 100000] [--warps 4,1,2,8]
"""
import sys

sys.path.insert(0, "scripts")
from check_static_decode import ablation_arguments, sweep  # noqa: E402
from oscarkv.kernels import triton_norm  # noqa: E402

args = ablation_arguments(warps="4,1,2,8")
shipped = triton_norm.norm_warps


def using(warps: int):
    def use():
        triton_norm.norm_warps = lambda n: warps if n >= 1024 else shipped(n)
    return use


sweep(args, {f"{w} warps": using(int(w)) for w in args.warps.split(",")})
triton_norm.norm_warps = shipped
