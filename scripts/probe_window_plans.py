"""Developer tool (GPU): one layer's decode step (`ops.attend_step`) over window plans, the history splits of the
shipped plan, the window programs merging the splits (`triton_attention.merges_in_windows`, allowed here up to 8
window splits); the shipped plan first (marked *), then the others, alternating, best of three CUDA-graph timings,
µs and the max abs error against the reference. Qwen3 shapes (32 query / 8 KV heads, D 128).

    PYTHONPATH=src python scripts/probe_window_plans.py 32x32768,64x8192 1/1/16,1/2/32,2/4/64

A plan is splits/warps/keys per block (`ops.WindowPlan`). `layer_case` and `best_of_rounds` also serve
scripts/probe_window_launch.py."""
import sys

import torch

from oscarkv.benchmarks.attention import _time_us, decode_case
from oscarkv.kernels import gluon_history, reference, triton_attention
from oscarkv.kernels.ops import WindowPlan, attend_step, choose_splits, window_plan


def layer_case(spec: str):
    """(case, shipped split count, shipped window plan, reference output, output buffer) of a BATCHxCONTEXT step."""
    batch, context = (int(x) for x in spec.split("x"))
    case = decode_case(batch, context)
    gluon = gluon_history.takes(case.layer, case.step, 32, 0, case.q.device)
    splits = choose_splits(case.layer, batch, 1, 32, context, case.q.device, gluon=gluon)
    shipped = window_plan(case.layer, batch, 1, 32, splits, context, case.q.device, gluon=gluon)
    ref = reference.attention_reference(case.layer, case.step, case.q, case.k_new, case.v_new, 128 ** -0.5).float()
    return case, splits, shipped, ref, torch.zeros_like(case.q)


def step(case, out, splits: int, **options):
    """The layer's decode step with `splits` splits into `out` (workspace allocated here), attend_step's options."""
    batch = case.q.shape[0]
    work = (torch.empty(batch, 32, splits, 128, dtype=torch.float32, device=case.q.device),
            torch.empty(batch, 32, splits, dtype=torch.float32, device=case.q.device))
    return lambda: attend_step(case.layer, case.step, case.q, case.k_new, case.v_new, 128 ** -0.5, num_splits=splits,
                               out=out, workspace=work, validate=False, **options)


def best_of_rounds(fns: list, out: torch.Tensor, ref: torch.Tensor, rounds: int = 3) -> list[tuple[float, float]]:
    """(best µs, max abs error against ref) of each function, the functions alternating over the rounds."""
    times = [[] for _ in fns]
    errors = [0.0] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            out.zero_()
            fn()
            torch.cuda.synchronize()
            errors[i] = (out.float() - ref).abs().max().item()
            times[i].append(_time_us(fn))
    return [(min(t), e) for t, e in zip(times, errors)]


def main() -> None:
    triton_attention.MAX_MERGE_WINDOW_SPLITS = 8
    plans = [WindowPlan(*(int(x) for x in p.split("/"))) for p in sys.argv[2].split(",")]
    for spec in sys.argv[1].split(","):
        case, splits, shipped, ref, out = layer_case(spec)
        history = splits - shipped.splits
        tried = [shipped] + [p for p in plans if p != shipped]
        results = best_of_rounds([step(case, out, history + p.splits, window_splits=p) for p in tried], out, ref)
        print(f"{spec:>10} history {history:3d}: " + "  ".join(
            f"{p.splits}/{p.warps}/{p.block_n or 64}{'*' if j == 0 else ''} {us:6.1f} ({err:.0e})"
            for j, (p, (us, err)) in enumerate(zip(tried, results))), flush=True)
        case = out = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
