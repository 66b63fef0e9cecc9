"""Developer probe (GPU): what one Triton launch costs the host, against its parts.

Prompt chunks run eagerly, and on some hosts the INT2 cache's Triton launches make a chunked prompt slower than the
GPU's work (docs/decode-log.md, "Chunked prompts"). This times, on a step so small that the GPU is never the bound:
  wrapper  `ops.rotate_queries` (shape checks, output allocation, the launch)
  launch   `_rotate_queries_kernel[grid](...)` alone
  binder   Triton's argument binding and specialization alone (no launch)
  direct   the compiled kernel's own launcher, with the arguments Triton bound once (the floor of any launch)

    PYTHONPATH=src python scripts/probe_launch_host.py [--calls 300]
"""
from __future__ import annotations

import argparse
import time

import torch


def per_call_us(fn, calls: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


def jit_parts(kernel, grid, args, kwargs):
    """(binder call, direct launch) closures of a JITFunction launch."""
    from triton.runtime.driver import driver

    device = driver.active.get_current_device()
    compiled = kernel[grid](*args, **kwargs)
    binder = kernel.device_caches[device][4]
    bound, _, _ = binder(*args, **kwargs)
    values = list(bound.values())
    g = tuple(grid) + (1,) * (3 - len(grid))

    def bind():
        binder(*args, **kwargs)

    def direct():
        stream = driver.active.get_current_stream(device)
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *values)

    return bind, direct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    from oscarkv.kernels import ops, triton_rotate

    query = torch.randn(1, 32, 16, 128, device="cuda", dtype=torch.bfloat16)
    rotation = torch.linalg.qr(torch.randn(8, 128, 128, device="cuda"))[0].contiguous()
    out = torch.empty(16, 32, 128, device="cuda", dtype=torch.bfloat16)
    rows, hq, d = 16, 32, 128
    block, warps, pieces = triton_rotate.launch_blocks(rows, hq, d, query.dtype)
    grid = (triton_rotate.triton.cdiv(rows, block), hq, d // min(d, 32))
    kargs = (query, rotation, out, rows, 16, query.stride(0), query.stride(1), query.stride(2))
    kw = dict(HQ=hq, GROUP=4, PER_HEAD=True, D=d, BLOCK=block, BLOCK_N=min(d, 32), BLOCK_K=32, PIECES=pieces,
              COMPILED=True, num_warps=warps)
    kernel = triton_rotate._rotate_queries_kernel
    results = {
        "wrapper": per_call_us(lambda: ops.rotate_queries(query, rotation), args.calls),
        "launch": per_call_us(lambda: kernel[grid](*kargs, **kw), args.calls),
    }
    try:
        bind, direct = jit_parts(kernel, grid, kargs, kw)
        results["binder"] = per_call_us(bind, args.calls)
        results["direct"] = per_call_us(direct, args.calls)
    except Exception as error:  # noqa: BLE001 - a probe: report which part of Triton's API differs
        print(f"direct launch unavailable: {type(error).__name__}: {error}")
    print("rotate_queries, host us per call (16 rows, 32 heads, D 128):")
    for name, us in results.items():
        print(f"  {name:8s} {us:8.1f}")


if __name__ == "__main__":
    main()
