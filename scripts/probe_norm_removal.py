"""Developer tool (GPU): whole-model decode steps with the decoder layers' RMSNorm launches removed (a wrong answer:
the products read the un-normalized sums), to bound what fusing the norms into the products could save. Runs
`bench decode` with the arguments after `--` as shipped, without the norm launches, and as shipped again:

    PYTHONPATH=src python scripts/probe_norm_removal.py -- --model random:qwen3-4b --contexts 100000 --batch 2 \
        --batch-contexts 1024 --no-largest --prefill 0 --steps 128

Sixtieth session, H200: INT2 3.36 -> 3.23 ms a step, BF16 6.50 -> 6.35 (docs/data/history-pipes-h200-s60.txt)."""
from __future__ import annotations

import sys


def main() -> None:
    from oscarkv.cli import main as cli
    from oscarkv.integrations import norms

    args = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
    shipped = norms._rms_norm

    def no_norm(norm, x, residual=None):
        return x if residual is None else (x, x)

    try:
        for removed in (False, True, False):
            norms._rms_norm = no_norm if removed else shipped
            print(f"== norms removed: {removed}", flush=True)
            cli(["bench", "decode", *args])
    finally:
        norms._rms_norm = shipped


if __name__ == "__main__":
    main()
