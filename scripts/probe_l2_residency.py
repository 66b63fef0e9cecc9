"""Developer tool (GPU): does the single-layer decode benchmark read its INT2 history from the L2?

`bench attention` replays one layer's decode step back to back in a CUDA graph (`triton.testing.do_bench_cudagraph`,
which does not flush the L2 between calls). At batch 1 up to 64K the layer's INT2 history (18.8 MB at 32K, 37.6 MB
at 64K) fits in the H100's 50 MB L2, so later replays may find it there, as no layer of a real model would (each
layer has its own cache; `bench decode` times whole models). This tool times, in one process, the same step (a) on
one cache, replayed back to back as the benchmark does, and (b) over COPIES distinct caches of the same shape in
turn (one graph: step on cache 0, 1, ..., COPIES - 1), per step, so that no cache is read again before the others
have passed through the L2.

    PYTHONPATH=src python scripts/probe_l2_residency.py [--shapes 1x32768,1x65536,1x131072] [--copies 4]
"""

from __future__ import annotations

import argparse

import torch

from oscarkv.benchmarks.attention import _time_us, copy_bandwidth_gbs, decode_bytes, decode_case
from oscarkv.kernels.ops import attend_step, choose_splits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x32768,1x65536,1x131072")
    parser.add_argument("--copies", type=int, default=4)
    args = parser.parse_args()
    device = torch.device("cuda")
    copy = copy_bandwidth_gbs(device)
    print(f"{torch.cuda.get_device_name(device)}, copy bandwidth {copy:.0f} GB/s, {args.copies} caches in turn")
    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        cases = [decode_case(batch, context, seed=seed) for seed in range(args.copies)]
        splits = choose_splits(cases[0].layer, batch, 1, 32, context, device)
        out = torch.empty_like(cases[0].q)
        workspace = (torch.empty(batch, 32, splits, 128, device=device), torch.empty(batch, 32, splits, device=device))

        def step(case):
            attend_step(case.layer, case.step, case.q, case.k_new, case.v_new, 128 ** -0.5, num_splits=splits,
                        out=out, workspace=workspace, validate=False)

        def one():
            step(cases[0])

        def in_turn():
            for case in cases:
                step(case)

        nbytes = decode_bytes(cases[0], context)
        same = min(_time_us(one) for _ in range(3))
        turn = min(_time_us(in_turn) for _ in range(3)) / len(cases)
        print(f"{shape:>9}: one cache {same:6.1f} us ({nbytes / same / 1e3 / copy:6.1%}), "
              f"{len(cases)} in turn {turn:6.1f} us ({nbytes / turn / 1e3 / copy:6.1%}); bytes {nbytes / 1e6:.1f} MB",
              flush=True)


if __name__ == "__main__":
    main()
