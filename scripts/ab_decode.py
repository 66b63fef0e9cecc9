"""Shared by the A/B probes (developer tools, GPU): whole-model decode steps with the plan or kernel before a change
and after it, alternating in one process, BF16 once beside them."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def model_ab(name: str, runs: Iterable[tuple[int, int]], use: Callable[[bool], None], steps: int = 32) -> None:
    """For each (batch, context) of `runs` on the random model `name`: BF16's graph-replayed step once, then INT2's
    with `use(True)` (before) and `use(False)` (after) alternating twice, the after state restored; prints one
    line per shape with the best of each, their ratio, INT2's speed against BF16, and every run."""
    from oscarkv.benchmarks.attention import copy_bandwidth_gbs
    from oscarkv.benchmarks.decode import decode_run, weight_bytes
    from oscarkv.models import load_model

    bandwidth = copy_bandwidth_gbs(torch.device("cuda"))
    model, _ = load_model(name, device="cuda", dtype=torch.bfloat16)
    weights = weight_bytes(model)
    for batch, context in runs:
        bf16 = decode_run(model, "bf16", batch, context, steps, weights, bandwidth).step_ms
        times = {"before": [], "after": []}
        for _ in range(2):
            for before in (True, False):
                use(before)
                times["before" if before else "after"].append(
                    decode_run(model, "int2", batch, context, steps, weights, bandwidth).step_ms)
        use(False)
        b, a = min(times["before"]), min(times["after"])
        print(f"MODEL {name} {batch}x{context}: bf16 {bf16:.4f} int2 before {b:.4f} after {a:.4f} ms (before/after "
              f"{b / a:.3f}; INT2/BF16 speed {bf16 / b:.2f}x -> {bf16 / a:.2f}x) runs {times}", flush=True)
    del model
    torch.cuda.empty_cache()
