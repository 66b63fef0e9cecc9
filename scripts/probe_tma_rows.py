"""Developer tool (GPU, Hopper, Triton >= 3.6): the Gluon history kernel with its pages staged by the TMA and read
back without shared-memory bank conflicts, against the shipped kernel (cp.async), in the decode step
(`probe_score_chains.compare_shapes`: errors against the torch reference and alternating CUDA-graph timings).

    PYTHONPATH=src:scripts python scripts/probe_tma_rows.py [SHAPES] [--stages 2,3,4] [--rounds 3] [--once]

Why. The seventieth session's TMA-staged kernel (`probe_tma_reads.tma_history_kernel`) was slower than the shipped
cp.async kernel (1x128K 35.0 against 32.1 us), while TMA copies alone read a batch-1 step faster than the kernel's
cp.async copies alone, and got faster with a third slot where cp.async got slower. That kernel read its slots, in
the TMA's row-major 32-byte-swizzled layout, into the shipped kernel's register layouts (KEY_LOAD, VALUE_LOAD), which
are laid out for the shipped kernel's own shared layouts (KEY_SMEM, VALUE_SMEM): one read of the key tile then takes
rows 8g + j of the eight lane groups g, 256 bytes apart, all in the same 32 bytes of banks (8 ways), and one read
of the value tile rows 16c + r, 512 bytes apart (4 ways).

Here the TMA copies row-major pages without a swizzle, and the order of tokens within each page of the code pools
is permuted (a copy of the layer's pools, made by this probe; scales and zeros keep token order): token 8g + j of a
page's keys is stored at row 8j + g and token 16c + r of its values at row 4r + c. A thread then reads its tokens
from rows that one read takes as 256 (keys) or 128 (values) contiguous bytes, and a relabelling of the loaded
tile that moves no data gives the shipped register layouts, so the page's arithmetic is the shipped kernel's. (The
cache's own page layout would have to change with the write path for this to ship; not done here.)
Found: correct; the reads without conflicts take back about 1.5 us of the seventieth session's 3 (1x128K 33.8-34.0 us
at 2 slots; 33.9 against its 35.4 on one machine), still slower than the shipped 32.0-32.3, and slower again with
each slot (3 slots 34.5-34.6, 4 slots 36.0), ramped or not (35.2 and 35.6); docs/data/tma-rows-h200-s73.txt.
"""

from __future__ import annotations

import argparse

import torch

from probe_score_chains import compare_shapes, run_once

# Stored row of token t within a page: keys 8g + j -> 8j + g, values 16c + r -> 4r + c.
KEY_ROW = [8 * (t % 8) + t // 8 for t in range(64)]
VALUE_ROW = [4 * (t % 16) + t // 16 for t in range(64)]

# The key / value words as stored (row-major, permuted token order; see the module doc): thread (g, c) reads stored
# rows 8j + g (keys, register bits j) and 4r + c (values, register bits r), the same words as KEY_LOAD / VALUE_LOAD.
STORED_LAYOUTS = '''
KEY_STORED: gl.constexpr = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [8, 0], [16, 0], [32, 0]], lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
    warp_bases=[], block_bases=[], shape=[64, 16]))
VALUE_STORED: gl.constexpr = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [4, 0], [8, 0], [16, 0], [32, 0]], lane_bases=[[1, 0], [2, 0], [0, 2], [0, 4], [0, 8]],
    warp_bases=[], block_bases=[], shape=[64, 16]))
'''
# `probe_tma_reads.TMA_HELPERS`' `_staged_page` reads the slots straight into KEY_LOAD / VALUE_LOAD; this one reads the
# stored rows conflict-free and relabels them by token (stored row 8j + g is key token 8g + j, 4r + c value token
# 16c + r).
STAGED_PAGE = [('''    """Slot `at` in registers, in the load layouts (as the shipped `_staged_page`)."""
''', '''    """Slot `at` in registers, in the load layouts: the stored rows read without bank conflicts, by token."""
'''), ('''    return (kbuf.index(at).load(KEY_LOAD), vbuf.index(at).load(VALUE_LOAD),
''', '''    k = kbuf.index(at).load(KEY_STORED)
    k = gl.reshape(gl.permute(gl.reshape(k, [8, 8, WORDS]), [1, 0, 2]), [64, WORDS])
    v = vbuf.index(at).load(VALUE_STORED)
    v = gl.reshape(gl.permute(gl.reshape(v, [16, 4, WORDS]), [1, 0, 2]), [64, WORDS])
    return (gl.convert_layout(k, KEY_LOAD, assert_trivial=True), gl.convert_layout(v, VALUE_LOAD, assert_trivial=True),
''')]


def tma_rows_kernel(ramp: bool = False):
    """The shipped history kernel with its pages staged by the TMA (`probe_tma_reads.tma_kernel_source`) and read by
    `STAGED_PAGE`, taking the descriptors of `descriptors` as keyword arguments kd .. vzd.
    ramp: the prologue copies only the split's first page, and each of the first STAGES - 2 loop steps copies the
    next page besides the page STAGES - 1 ahead (so the first page is not queued behind the others; at most 4
    slots)."""
    import inspect

    from probe_history_timeline import apply_edits, load_history_kernel
    from probe_tma_reads import TMA_HELPERS, _copy_page, tma_kernel_source

    helpers = STORED_LAYOUTS + apply_edits(TMA_HELPERS, STAGED_PAGE) + "\n" + inspect.getsource(_copy_page.fn)
    edits = [("    async_copy.wait_group(0)\n", "")]
    if ramp:
        edits += [
            ("vs_ptr, vz_ptr, slots, j, lo + j < hi, HKV, P)\n",
             "vs_ptr, vz_ptr, slots, j, (lo + j < hi) & (j < 1), HKV, P)\n"),
            ("    ahead = gl.load(bt_row + gl.minimum(lo + STAGES - 1, last))\n",
             "    ahead = gl.load(bt_row + gl.minimum(lo + STAGES - 1, last))\n"
             "    deferred1 = gl.load(bt_row + gl.minimum(lo + 1, last))\n"
             "    deferred2 = gl.load(bt_row + gl.minimum(lo + 2, last))\n"),
            ("        oks = oks | (ok.to(gl.int32) << (STAGES - 1))\n",
             "        oks = oks | (ok.to(gl.int32) << (STAGES - 1))\n"
             "        if i < STAGES - 2:\n"
             "            ok_next = _stage_page(gl.where(i == 0, deferred1, deferred2), num_pages, h, kc16,\n"
             "                                  vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, slots, (i + 1) % STAGES,\n"
             "                                  index + 1 < hi, HKV, P)\n"
             "            oks = oks | (ok_next.to(gl.int32) << 1)\n"),
        ]
    return load_history_kernel("tma_rows_ramp_kernel" if ramp else "tma_rows_kernel", tma_kernel_source(helpers, edits))


def permuted_pools(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the layer's key and value code pools [pages, HKV, 64, 32 bytes] with each page's tokens at the rows
    KEY_ROW / VALUE_ROW."""
    k = torch.empty_like(layer.k_codes)
    v = torch.empty_like(layer.v_codes)
    k[:, :, KEY_ROW] = layer.k_codes
    v[:, :, VALUE_ROW] = layer.v_codes
    return k, v


def descriptors(layer) -> tuple:
    """TMA descriptors of the permuted code pools (rows of 16 int16 words, 64-row boxes, no swizzle) and of the
    parameter rows (64 float16 per (page, KV head))."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    flat = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    p = layer.layout.page_size
    codes = [TensorDescriptor.from_tensor(t.view(torch.int16).reshape(-1, 16), [p, 16], flat)
             for t in permuted_pools(layer)]
    params = [TensorDescriptor.from_tensor(t.reshape(-1, p), [1, p], flat)
              for t in (layer.k_scale, layer.k_zero, layer.v_scale, layer.v_zero)]
    return (*codes, *params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="?", default="1x131072,1x100000,8x32768,32x32768")
    parser.add_argument("--stages", default="2,3,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--once", action="store_true", help="each kernel once, eagerly, at the first shape")
    args = parser.parse_args()

    from oscarkv.kernels import gluon_history, gluon_history_kernel
    from probe_tma_reads import with_descriptors

    kernel = tma_rows_kernel()
    ramped = tma_rows_kernel(ramp=True)
    stages = [int(s) for s in args.stages.split(",")]
    if args.once:
        from oscarkv.benchmarks.attention import decode_case

        spec = args.shapes.split(",")[0]
        layer = decode_case(*(int(x) for x in spec.split("x"))).layer  # the same random layer as run_once's
        run_once(spec, [gluon_history_kernel.history_kernel, with_descriptors(kernel, descriptors(layer))])
        return

    def variants(case, spec):
        descs = descriptors(case.layer)
        tma, tma_ramped = with_descriptors(kernel, descs), with_descriptors(ramped, descs)
        return {"shipped (cp.async), 2 slots": (gluon_history_kernel.history_kernel, gluon_history.STAGES),
                **{f"TMA, permuted rows, {s} slots": (tma, s) for s in stages},
                **{f"TMA, rows, ramped, {s} slots": (tma_ramped, s) for s in stages if 2 < s <= 4}}

    compare_shapes(args.shapes, variants, args.rounds)


if __name__ == "__main__":
    main()
