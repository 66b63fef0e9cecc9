"""Developer tool (GPU): whole-model decode steps (`oscarkv bench decode`) with the history splits of the batch
runs' decode plans forced, to weigh `ops._decode_plan` at large batches in a real step rather than one layer alone.

    PYTHONPATH=src python scripts/probe_history_splits_decode.py SPLITS [--small] -- [bench decode options]

SPLITS: history splits per (sequence, KV head) of every decode step of more than `ops.SMALL_BATCH_PROGRAMS` (sequence,
KV head) pairs (the INT2 batch runs; batch 1 keeps the shipped plan), or "shipped". The window programs follow the
shipped rules for that count. With --small, the steps of at most `ops.SMALL_BATCH_PROGRAMS` pairs (batch 1 of the
Qwen3 shapes) take SPLITS instead, with the window programs the shipped plan gives them, and the batch runs keep
the shipped plan (`scripts/probe_batch1_splits.py` times one such layer)."""
from __future__ import annotations

import sys

from oscarkv.kernels import ops


def forced_plan(shipped, splits: int, small: bool):
    """`ops._decode_plan` with `splits` history splits for the steps of more than `ops.SMALL_BATCH_PROGRAMS` (sequence,
    KV head) pairs (small: of at most that many, keeping their shipped window programs); `shipped` for the rest."""
    def plan(layer, programs, max_context, sms, gluon=False):
        history, windows = shipped(layer, programs, max_context, sms, gluon)
        if (programs <= ops.SMALL_BATCH_PROGRAMS) != small:
            return history, windows
        if small:
            return splits, windows
        one_warp = ops._one_warp_windows(layer, programs, splits, max_context, sms)
        return splits, (ops.WindowPlan(1, warps=1, block_n=ops.ONE_WARP_WINDOW_BLOCK) if one_warp else windows)
    return plan


def main() -> None:
    forced, rest = sys.argv[1], sys.argv[2:]
    small = rest[:1] == ["--small"]
    rest = rest[1:] if small else rest
    rest = rest[1:] if rest[:1] == ["--"] else rest
    if forced != "shipped":
        ops._decode_plan = forced_plan(ops._decode_plan, int(forced), small)
    from oscarkv.cli import main as cli

    sys.exit(cli(["bench", "decode", *rest]))


if __name__ == "__main__":
    main()
