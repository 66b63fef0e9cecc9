"""Developer tool (GPU): `oscarkv bench decode` with module constants of oscarkv set, to time a switch (such as
`kernels.triton_attention.MAX_MERGE_WINDOW_SPLITS`, 0: no merge in the window programs) as whole CUDA-graph decode
steps. Run it once per value, alternating, in one call: the bench fills its caches without a prefill, so a run takes
about a minute.

    PYTHONPATH=src python scripts/bench_with.py kernels.triton_attention.MAX_MERGE_WINDOW_SPLITS=0 -- \
        --model random:qwen3-4b --contexts 1000 --batch-contexts 32768 --no-largest --prefill 0 --steps 256 \
        --save out.json

Each NAME=VALUE sets oscarkv.NAME to VALUE read as a Python literal (1, 0.5, True, None, "text"); the constant must
be one its module reads when a step is planned or launched, not one copied at import."""
from __future__ import annotations

import ast
import importlib
import sys


def main() -> None:
    args = sys.argv[1:]
    split = args.index("--") if "--" in args else len(args)
    for setting in args[:split]:
        name, _, value = setting.partition("=")
        module_name, attribute = name.rsplit(".", 1)
        module = importlib.import_module(f"oscarkv.{module_name}")
        if not hasattr(module, attribute):
            sys.exit(f"oscarkv.{module_name} has no {attribute}")
        setattr(module, attribute, ast.literal_eval(value))
        print(f"oscarkv.{name} = {getattr(module, attribute)!r}", flush=True)
    from oscarkv.cli import main as cli

    sys.exit(cli(["bench", "decode", *args[split + 1:]]))


if __name__ == "__main__":
    main()
