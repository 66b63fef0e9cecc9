"""Developer tool (GPU): one module constant of oscarkv at several values, timed as whole CUDA-graph decode steps,
the values in turn in one process. Qwen3-4B shape by default, random weights, INT2 (Hadamard).

    PYTHONPATH=src:scripts python scripts/probe_constant.py --constant kernels.ops.MAX_HISTORY_SPLITS \
        --values 128,132 [--contexts 100000] [--batch 1]

The constant must be read when a step is planned (not copied at import), as `choose_splits` reads its module's
constants; the first value should be the shipped one.
"""
import importlib
import sys

sys.path.insert(0, "scripts")
from check_static_decode import ablation_arguments, sweep  # noqa: E402

args = ablation_arguments(constant="kernels.ops.MAX_HISTORY_SPLITS", values="128,132")
module_name, name = args.constant.rsplit(".", 1)
module = importlib.import_module(f"oscarkv.{module_name}")
shipped = getattr(module, name)


def using(value: int):
    def use():
        setattr(module, name, value)
    return use


sweep(args, {f"{name}={v}": using(int(v)) for v in args.values.split(",")}, reps=3)
setattr(module, name, shipped)
