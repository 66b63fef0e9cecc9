"""Developer tool (GPU): three serial launches of the decode attention kernel at one benchmark shape, for
Nsight Compute (docs/data/ncu-attention-h100.txt).

    ncu --kernel-name regex:_paged_attention --launch-skip 2 --launch-count 1 --metrics ... \
        python scripts/ncu_decode_attention.py 1x102400 [ROW_GROUPS [SPLIT_DIVISOR]]

The third paged launch is the second call's history launch. ROW_GROUPS (default 1) and SPLIT_DIVISOR (default
1: the history splits `choose_splits` takes) set the history launch's configuration."""
import sys

import torch

from oscarkv.benchmarks.attention import decode_case
from oscarkv.kernels.ops import choose_splits, window_split_count
from oscarkv.kernels.triton_attention import launch_attention

batch, context = (int(x) for x in sys.argv[1].split("x"))
rg = int(sys.argv[2]) if len(sys.argv) > 2 else None
div = int(sys.argv[3]) if len(sys.argv) > 3 else 1
case = decode_case(batch, context)
layer, step, q, k, v = case.layer, case.step, case.q, case.k_new, case.v_new
chosen = choose_splits(layer, batch, 1, 32, context, q.device)
ws = window_split_count(layer, batch, 1, 32, chosen, context, q.device)
chosen = (chosen - ws) // div + ws
out = torch.empty_like(q)
work = (torch.empty(batch, 32, chosen, 128, dtype=torch.float32, device=q.device), torch.empty(batch, 32, chosen, dtype=torch.float32, device=q.device))
for _ in range(3):
    launch_attention(layer, step, q, k, v, out, 128 ** -0.5, 0, chosen, work, window_splits=ws, overlap=False, **({} if rg is None else dict(row_groups=rg)))
torch.cuda.synchronize()
