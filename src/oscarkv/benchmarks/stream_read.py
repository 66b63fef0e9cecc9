"""The fastest plain read of N bytes that we can launch: a ceiling for any kernel that must read them.

`bench attention` reports how far the INT2 decode kernel is from the copy bandwidth of a 2 GiB copy. At the
sizes of one decode layer (tens of MB) a launch, the ramp of the first loads and the tail of the last programs
weigh more than in a 2 GiB copy, and a step's bytes may stay in the L2 between back-to-back timings. This module
measures how fast a kernel that does nothing but read those bytes is, so that every row of the benchmark states
about the best any kernel could do at that shape:

- the plain read's share of the copy bandwidth bounds the "% of copy bandwidth" a decode kernel can reach;
- the BF16 baseline's time over the plain read's time bounds the speed-up over BF16 a decode kernel can reach.

The read is a grid-stride loop of wide, coalesced loads over one contiguous buffer, XOR-folded so that the
compiler keeps every load, one word written per program. Several launch plans are timed and the fastest is
kept: the figure is an optimistic bound (a real kernel also reads scattered pages and does work).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

# (words per program and iteration, warps, programs per multiprocessor): the plans timed, the fastest kept.
READ_PLANS = ((1024, 4, 8), (2048, 4, 4), (2048, 8, 4), (4096, 8, 2), (4096, 8, 4), (8192, 8, 2))


@triton.jit
def _xor_read_kernel(src_ptr, out_ptr, n_words, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    stride = tl.num_programs(0) * BLOCK
    offsets = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, n_words, stride):
        idx = start + offsets
        acc ^= tl.load(src_ptr + idx, mask=idx < n_words, other=0)
    tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))


def xor_read(words: torch.Tensor, out: torch.Tensor, block: int, warps: int) -> torch.Tensor:
    """Read every int32 of `words` once; out[p] = the XOR of the words program p read (len(out) programs).
    The XOR of all of out is the XOR of all of words."""
    _xor_read_kernel[(out.numel(),)](words, out, words.numel(), BLOCK=block, num_warps=warps)
    return out


def _programs(device: torch.device, per_multiprocessor: int) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count * per_multiprocessor
    return 4  # the CPU interpreter (tests): a few programs, so the grid stride is exercised


def same_bytes_read_us(nbytes: int, device: torch.device, timer: Callable[[Callable[[], object]], float],
                       plans=READ_PLANS) -> float:
    """The fastest time, over `plans`, of a kernel that reads `nbytes` (rounded up to whole int32 words) and
    writes one word per program, each plan timed with `timer(fn) -> microseconds` as the kernels are."""
    words = torch.randint(-2**31, 2**31 - 1, (max(1, -(-nbytes // 4)),), dtype=torch.int32, device=device)
    best = float("inf")
    for block, warps, per_multiprocessor in plans:
        out = torch.empty(_programs(device, per_multiprocessor), dtype=torch.int32, device=device)
        best = min(best, timer(lambda: xor_read(words, out, block, warps)))
    return best
