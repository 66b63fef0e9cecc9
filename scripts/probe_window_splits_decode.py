"""Developer tool (GPU): whole static decode steps (CUDA graphs) at a mid-size batch with 2 window splits per
sequence and KV head (`ops.MID_BATCH_WINDOW_SPLITS`, the rule) against 1 (the rule before the twenty-fourth
session), alternating in one process, three times each (docs/data/window-splits-batch-h100.txt).
Random-weight model, INT2 cache filled with random keys and values as in `bench decode`; ms per step.

    PYTHONPATH=src python scripts/probe_window_splits_decode.py [--model random:qwen3-4b] [--batch 32] [--context 32768]
"""
import argparse

import torch

from oscarkv.benchmarks.attention import copy_bandwidth_gbs
from oscarkv.benchmarks.decode import decode_run, weight_bytes
from oscarkv.kernels import ops
from oscarkv.models import load_model

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default="random:qwen3-4b")
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--context", type=int, default=32768)
parser.add_argument("--steps", type=int, default=32)
args = parser.parse_args()
model, _ = load_model(args.model, device="cuda", dtype=torch.bfloat16)
bandwidth = copy_bandwidth_gbs(torch.device("cuda"))
weights = weight_bytes(model)
rule = ops.MID_BATCH_WINDOW_SPLITS
times = {2: [], 1: []}
for _ in range(3):
    for windows in times:
        ops.MID_BATCH_WINDOW_SPLITS = windows
        run = decode_run(model, "int2", args.batch, args.context, args.steps, weights, bandwidth)
        times[windows].append(run.step_ms)
ops.MID_BATCH_WINDOW_SPLITS = rule
print(f"{args.model} on {torch.cuda.get_device_name()}, INT2 batch {args.batch} x {args.context}: ms per step")
for windows, ms in times.items():
    print(f"  {windows} window split(s): " + ", ".join(f"{t:.3f}" for t in ms) + f"  (min {min(ms):.3f})")
