"""Developer probe (GPU): host time of one extend step's SDPA call, by how it is called.

A prompt chunk over stored tokens attends with a lower-right causal bias (`extend.causal_gqa_attention`). torch
dispatches that bias in Python (input checks, `SDPAParams`, the backend test) before the flash kernel. This probe
times the host side of each way to call it, with tiny shapes so the GPU never holds the host back, and checks
that they give the same output:

    PYTHONPATH=src python scripts/probe_sdpa_host.py
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from oscarkv.kernels.ops import rotate_queries


def host_us(call, repeats: int = 400) -> float:
    """Median host time of call() in µs, the GPU kept ahead of by nothing heavier than the calls themselves."""
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
        if len(times) % 50 == 0:
            torch.cuda.synchronize()  # keep the launch queue short
    times.sort()
    return times[len(times) // 2] * 1e6


def main() -> None:
    for n, stored, hq, hkv, d in ((64, 192, 32, 8, 128), (2048, 6144, 32, 8, 128)):
        q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.float16)
        k = torch.randn(1, hkv, stored + n, d, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        scale = d ** -0.5
        ways = {
            "causal_lower_right bias (shipped)": lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=causal_lower_right(n, stored + n), scale=scale, enable_gqa=True),
            "aten flash op, is_causal (lower right)": lambda: torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, is_causal=True, return_debug_mask=False, scale=scale)[0],
            "is_causal=True, upper left (a wrong answer; the plain path's cost)": lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True),
            "torch.empty_like(q) (a floor: one allocation)": lambda: torch.empty_like(q),
        }
        want = ways["causal_lower_right bias (shipped)"]()
        print(f"{n} new tokens over {stored} stored, Hq={hq}, Hkv={hkv}, D={d}, float16:")
        for name, call in ways.items():
            out = call()
            same = "" if out.shape != want.shape else f", max difference {(out.float() - want.float()).abs().max().item():.2e}"
            print(f"  {host_us(call):8.1f} us host  {name}{same}")
        query = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16)
        rotation = torch.linalg.qr(torch.randn(d, d, device="cuda"))[0].contiguous()
        print(f"  {host_us(lambda: rotate_queries(query, rotation)):8.1f} us host  rotate_queries (one Triton launch)")


if __name__ == "__main__":
    main()
