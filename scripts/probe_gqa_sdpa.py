"""Developer tool (GPU): the extend steps' SDPA (`kernels.extend.gqa_attention`, a boolean mask over G·n folded
query rows) against SDPA with a lower-right causal bias and enable_gqa (no mask), float16, Qwen3 shapes.

    PYTHONPATH=src python scripts/probe_gqa_sdpa.py [--cases STORED:NEW,...]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from oscarkv.benchmarks.attention import _time_us
from oscarkv.kernels.extend import gqa_attention

HQ, HKV, D = 32, 8, 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="8192:128,8192:512,32768:512,32768:2048,16384:2048")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for case in args.cases.split(","):
        stored, new = (int(x) for x in case.split(":"))
        end = stored + new
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, HQ, new, D, device="cuda", generator=g).half()
        k = torch.randn(1, HKV, end, D, device="cuda", generator=g).half()
        v = torch.randn(1, HKV, end, D, device="cuda", generator=g).half()
        pos = stored + torch.arange(new, device="cuda")[None]
        scale = D ** -0.5
        bias = causal_lower_right(new, end)
        masked = gqa_attention(q, k, v, pos, scale)
        lower = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
        err = (masked.float() - lower.float()).abs().max().item()
        t_masked = _time_us(lambda: gqa_attention(q, k, v, pos, scale), graph=False)
        t_lower = _time_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale,
                                                                  enable_gqa=True), graph=False)
        print(f"{stored:6d} + {new:5d}: masked gqa_attention {t_masked:8.1f} us   lower-right causal + enable_gqa "
              f"{t_lower:8.1f} us   ratio {t_masked / t_lower:4.2f}   max diff {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
