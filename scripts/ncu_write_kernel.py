"""Developer tool (GPU): three prompt writes as in `oscarkv bench attention`'s write row (a 32K-token prompt, 8 KV
heads, D 128, group 128, INT2, bfloat16 keys rotated by R_K's pieces, clip 0.96 / 0.92), for Nsight Compute
(docs/data/ncu-write-h100.txt).

    ncu --kernel-name regex:_write_kernel --launch-skip 2 --launch-count 1 --set full \\
        python scripts/ncu_write_kernel.py [TOKENS]

Each write is one launch whose programs hold the keys or the values (`launch_write`, STREAM 3; an empty cache needs
no flush launch); the command profiles the third. (docs/data/ncu-write-h100.txt was taken when a write was a flush
launch and two write launches, with --launch-skip 4 --launch-count 2.)"""
import sys

import torch

from oscarkv.benchmarks.attention import write_case
from oscarkv.kernels.ops import write_step

case = write_case(int(sys.argv[1]) if len(sys.argv) > 1 else 32768)
for _ in range(3):
    write_step(case.layer, case.step, case.k, case.v, case.rotation, case.mean, 0.96, 0.92, validate=False,
               pieces=case.pieces)
torch.cuda.synchronize()
