"""Developer tool (GPU): three prompt writes as in `oscarkv bench attention`'s write row (a 32K-token prompt, 8 KV
heads, D 128, group 128, INT2, bfloat16 keys rotated by R_K's pieces, clip 0.96 / 0.92), for Nsight Compute
(docs/data/ncu-write-h100.txt).

    ncu --kernel-name regex:_write_kernel --launch-skip 4 --launch-count 2 --set full \
        python scripts/ncu_write_kernel.py [TOKENS]

Each write is a flush launch (nothing to move in an empty cache) and two write launches, the keys' and the values'
(`launch_write`); the command profiles the third write's."""
import sys

import torch

from oscarkv.benchmarks.attention import _layout
from oscarkv.cache.paged import PagedKVCache
from oscarkv.kernels.ops import rotation_pieces, write_step

tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
kv_heads, head_dim = 8, 128
device = torch.device("cuda")
layout = _layout(kv_heads, head_dim, 128)
cache = PagedKVCache([layout], layout.pages_needed(tokens), 1, tokens, device)
step = cache.step([cache.open_slot()], [tokens])
gen = torch.Generator().manual_seed(0)
k = torch.randn(tokens, kv_heads, head_dim, generator=gen).bfloat16().to(device)
v = torch.randn(tokens, kv_heads, head_dim, generator=gen).bfloat16().to(device)
rotation, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))
rotation = rotation.float().to(device)
mean = torch.randn(kv_heads, head_dim, generator=gen).to(device)
pieces = rotation_pieces(rotation, mean)
for _ in range(3):
    write_step(cache.layers[0], step, k, v, rotation, mean, 0.96, 0.92, validate=False, pieces=pieces)
torch.cuda.synchronize()
