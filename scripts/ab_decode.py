"""Shared by the A/B probes (developer tools, GPU): one layer's decode step (`layer_ab`) or whole-model decode steps
(`model_ab`) with the plan or kernel before a change and after it, alternating in one process."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def layer_ab(case, query_heads: int, context: int, use: Callable[[bool], None], label: str) -> None:
    """One layer's decode step of `case` (`benchmarks.attention.decode_case`) as `ops.attend_step` plans it, with
    `use(True)` (before) and `use(False)` (after) alternating twice, the after state restored; prints the best time
    of each, their ratio, each one's plan (history + window splits, window plan) and its largest error against the
    torch reference."""
    from oscarkv.benchmarks.attention import _time_us
    from oscarkv.kernels import ops, reference

    device = case.q.device
    batch, d = case.q.shape[0], case.q.shape[2]
    scale = d ** -0.5
    expected = reference.attention_reference(case.layer, case.step, case.q, case.k_new, case.v_new, scale, 0)
    times, errors, plans = {"before": [], "after": []}, {}, {}
    for before in (True, False, True, False):
        use(before)
        key = "before" if before else "after"
        splits = ops.choose_splits(case.layer, batch, 1, query_heads, context, device)
        plans[key] = (splits, ops.window_plan(case.layer, batch, 1, query_heads, splits, context, device))
        out = torch.empty_like(case.q)
        workspace = (torch.empty(batch, query_heads, splits, d, dtype=torch.float32, device=device),
                     torch.empty(batch, query_heads, splits, dtype=torch.float32, device=device))

        def step(splits=splits, out=out, workspace=workspace):
            ops.attend_step(case.layer, case.step, case.q, case.k_new, case.v_new, scale, num_splits=splits,
                            max_context=context, out=out, workspace=workspace, validate=False)
        step()
        errors[key] = (out.float() - expected.float()).abs().max().item()
        times[key].append(_time_us(step))
    use(False)
    b, a = min(times["before"]), min(times["after"])
    print(f"LAYER {label} {batch}x{context}: before {b:6.1f} after {a:6.1f} us ({b / a:.2f}x); plans "
          f"{plans['before']} -> {plans['after']}; max err before {errors['before']:.2e} after "
          f"{errors['after']:.2e}", flush=True)


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
