"""The decode history launch in Gluon, for the common layout: half the tensor-core dots of the Triton kernel.

What it computes is what the history splits of `triton_attention._paged_attention_kernel` (REGIONS=1) compute,
written to the same partial outputs and log-sum-exps, so the window launch and `_combine_kernel` run unchanged:
one program per (sequence, KV head, history split), one warp, an online softmax over the split's INT2 pages.

Why Gluon. In the Triton kernel the query heads of a KV head (4 for Qwen3) are the rows of every m16n8k16 tile,
16 rows of which 12 are padding: 132 dots per page of 64 tokens (D = 128). Here the heads are the tile's 8 columns
and both dots run transposed:

    scoresᵀ [64 tokens, 8 heads] = Σ_s codes_s [64, 16 words] · q_sᵀ [16, 8]          32 dots per page
    outᵀ_s  [16 words, 8 heads] += codes_sᵀ [16, 64 tokens] · weightsᵀ [64, 8]        32 dots per page

(s: the eight slices of a row's int16 words, `triton_attention._slice_layout`; codes enter the dots as float16
units with the same bits, as there). That needs control over which thread holds which element, which Triton does
not give (it moved the weights through shared memory, docs/data/head-columns-variant.patch) and Gluon does:

- The order of tokens and of words inside a page is free (the dots sum over them), so every tile is read with
  plain vector loads and relabelled into the mma fragments by reshapes and permutes that move no data
  (`_key_tile`, `_value_tile`, `_page_rows`; each ends in a `convert_layout(..., assert_trivial=True)`, so the
  compiler refuses any layout that would move data).
- Pages are staged through shared memory: cp.async copies the next page into a second slot while the warp reads
  the current one (STAGES slots), in layouts whose reads are free of bank conflicts (KEY_SMEM, VALUE_SMEM). Loaded
  into registers one page ahead instead (the fifty-first session's kernel), the loads took 38 more registers and
  the compiler issued them half-way through the page before, so the warp waited for them: Nsight Compute put a
  quarter of the stalls on long scoreboards, one instruction after the block-table load holding a fifth.
- The score accumulator becomes the value dot's B operand by one `movmatrix` transpose per 8x8 block
  (`_weights_operand`).

- The values' zero-point term Σ weight·zero is one more dot per 16 tokens (`_value_zero_operand`: an A operand
  whose rows all hold the zeros), not a per-thread fold (fifty-fifth session).
- Key shifts: the page's score term t enters as exp2(s·u − (m − t)), with t also added to the page's maximum, so
  it costs two adds a page and no work per score; the launch is capped at 128 registers with shifts (fifty-sixth
  session: it took 136 before, 15 programs a multiprocessor, and a 32x8K layer 98 µs instead of 66.5). Each
  program computes the terms of its own split's blocks before its loop, into shared memory, where a split spans at
  most TERM_ROWS blocks (`terms_in_programs`); else they come from a launch of their own before this one
  (fifty-eighth session: one layer 1x128K 37.3 -> 34.6 µs, 1x32K 17.2 -> 15.7 with shifts).

Measured on the H200 (docs/kernels-log.md, fifty-first, fifty-second and fifty-fifth sessions): 723 SASS instructions
per page in the loop against 1097, 68 dots against 132, 128 registers (Triton 3.6, sm_90); one layer's decode step
1.13-1.27x faster than with the Triton kernel at the benchmark shapes. Staging deeper (3, 4 or 6 slots) was slower.

Shared memory and the window programs. A multiprocessor runs kernels of one shared-memory carve-out at a time;
the register-prefetch kernel used none, the driver then picked a carve-out with no room for the window programs
(`triton_attention`, REGIONS=2), and they ran after the history programs, 6-8 µs later per step; it reserved 16 KB
it did not use. With 9 KB of staged pages per program the carve-out has room, and reserving more was as fast or
slower (docs/data/decode-h200-s52.txt).

Scope (`takes`): decode (one new token per sequence), INT2 uniform levels for keys and values, D = 128 in one
group, pages of 64 tokens, at most 8 query heads per KV head, no sliding window (key shifts are in), page tensors
at 16-byte aligned addresses (as the cache allocates them), CUDA compute capability 8.0 or later, and Triton 3.6
or later (Gluon's API moves between releases: 3.6 and 3.9 are tested). Anything else takes the Triton kernel. Gluon
kernels do not run in the CPU interpreter: the CPU suite compiles this one for sm_90 (`compile_check`), and the
GPU suite tests it against the torch reference (tests/test_kernels.py).
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

HistoryKernel = Literal["auto", "triton", "gluon"]  # a decode history launch's kernel (`launch_attention`)
HISTORY_KERNELS = ("auto", "triton", "gluon")

PAGE = 64  # tokens per page the kernel is written for
HEAD_DIM = 128
MAX_GROUP = 8  # query heads per KV head: the 8 columns of the m16n8k16 tile
# Registers a thread (maxnreg): the cap of `ops.HISTORY_REGISTERS_BESIDE_WINDOWS`. The kernel takes 128 uncapped, the
# most at which 16 programs fit a multiprocessor; one more is a cliff: on the H200 a variant of the kernel at 129
# registers took 97.5 µs for one 32x8K layer, the same capped at 128 (no spills) 70.3 µs. A cap of 128 on this kernel
# (which then takes 124) was slower than none: 1x128K 33.1-33.2 against 32.0-32.1 µs (fifty-fifth session,
# docs/kernels-log.md). So check the count (`scripts/probe_gluon_history.py sass`) after changing the kernel.
REGISTER_CAP = 168
# With key shifts (key_centering "rope", the default of a centered artifact) the kernel takes 132 uncapped; capped at
# 128 it does not spill (749 instructions a page against 743).
SHIFTS_REGISTER_CAP = 128
STAGES = 2  # shared-memory slots of staged pages: STAGES - 1 pages in flight while one is read (see above)
# Key shifts: a program computes the score terms of at most TERM_ROWS blocks of its split into shared memory
# (`terms_in_programs`; 32 bytes a block), else they take a launch of their own before the history launch.
TERM_ROWS = 8
# The split plan of Gluon steps (`ops._gluon_history_splits`): 128 registers and 9.2 KB of shared memory a program, so
# 16 one-warp programs fill a multiprocessor's registers (the Triton kernel's 9); splits of at least MIN_SPLIT_PAGES.
PROGRAMS_PER_MULTIPROCESSOR = 16
MIN_SPLIT_PAGES = 64


MIN_TRITON = (3, 6)


@functools.cache
def available() -> bool:
    """Whether this Triton is recent enough (MIN_TRITON) and has the Gluon features the kernel uses."""
    try:
        import triton

        if tuple(int(part) for part in triton.__version__.split(".")[:2]) < MIN_TRITON:
            return False
        from . import gluon_history_kernel  # noqa: F401
    except (ImportError, AttributeError, ValueError):
        return False
    return True


def takes(layer, batch, query_heads: int, window: int, device: torch.device) -> bool:
    """Whether a decode step's history launch can run the Gluon kernel (see the module docstring)."""
    return takes_steps(layer, batch.max_new, query_heads, window, device)


def takes_steps(layer, max_new: int, query_heads: int, window: int, device: torch.device) -> bool:
    """`takes` for the steps of `max_new` new tokens per sequence (what the split plan knows of a step)."""
    lay = layer.layout
    return (device.type == "cuda" and max_new == 1 and window == 0
            and lay.head_dim == HEAD_DIM and lay.groups == 1 and lay.key_bits == 2 and lay.value_bits == 2
            and lay.key_inner is None and lay.value_inner is None and lay.page_size == PAGE
            and query_heads % lay.kv_heads == 0 and query_heads // lay.kv_heads <= MAX_GROUP
            and all(t.data_ptr() % 16 == 0 for t in (layer.k_codes, layer.k_scale, layer.k_zero, layer.v_codes,
                                                      layer.v_scale, layer.v_zero))  # 16-byte copies (cp.async)
            and torch.cuda.get_device_capability(device.index or 0) >= (8, 0) and available())


def register_cap(key_shifts: int) -> int:
    """The launch's register cap (maxnreg): SHIFTS_REGISTER_CAP with key shifts (KEY_SHIFTS 1 or 2), else
    REGISTER_CAP."""
    return SHIFTS_REGISTER_CAP if key_shifts else REGISTER_CAP


def terms_in_programs(layer, batch, page_splits: int) -> bool:
    """Whether each history program can compute the key shifts' score terms of its own blocks (the kernel's
    KEY_SHIFTS 2, no launch of their own): every split of the longest history the block table holds spans at most
    TERM_ROWS blocks of key shifts. False without key shifts."""
    if layer.key_shifts is None:
        return False
    share = -(-batch.block_table.shape[1] // max(page_splits, 1))  # pages of a split, at most
    spanned = (max(share, 1) - 1) * layer.layout.page_size // max(layer.shift_block, 1) + 2
    return min(spanned, layer.key_shifts.shape[0]) <= TERM_ROWS


def launch_settings(query_heads: int, kv_heads: int, sink: int, recent: int, num_splits: int, window_splits: int,
                    overlap: int, key_shifts: int, shift_block: int) -> tuple[dict, dict]:
    """(constexprs, options) of the history kernel's launch, register cap included: what `launch` launches and
    `compile_check` compiles. overlap: its OVERLAP (0, 1 or 2); key_shifts: its KEY_SHIFTS (0 none, 1 the score terms
    in the arguments, 2 the layer's key shifts in them, `terms_in_programs`); shift_block: the layer's key-shift
    block."""
    from .hardware import register_cap_supported

    cap = dict(maxnreg=register_cap(key_shifts)) if register_cap_supported() else {}
    return (dict(HQ=query_heads, HKV=kv_heads, S=sink, R=recent, NUM_SPLITS=num_splits, WS=window_splits,
                 OVERLAP=overlap, KEY_SHIFTS=key_shifts, SHIFT_BLOCK=shift_block, STAGES=STAGES, TERM_ROWS=TERM_ROWS),
            dict(num_warps=1, **cap))


def launch(grid: tuple[int, int], args: tuple, settings: tuple[dict, dict], options: dict) -> None:
    """The history splits WS..NUM_SPLITS-1 of a decode step; args: `launch_attention`'s argument tuple (the kernel's
    signature begins with the Triton kernel's); settings: `launch_settings`; options: further launch options."""
    from .gluon_history_kernel import history_kernel

    constexprs, own = settings
    history_kernel[grid](*args, **constexprs, **own, **options)
