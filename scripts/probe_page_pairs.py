"""Developer tool (GPU): the Gluon history kernel with its pages copied two at a time (one cp.async commit group,
one wait and one warp barrier per pair of pages instead of per page), against the shipped kernel, one decode layer
per shape, alternating CUDA-graph rounds, with each variant's error against the torch reference.

    PYTHONPATH=src:scripts python scripts/probe_page_pairs.py [1x131072,1x100000] [--slots 4,6] [--rounds 3]

Why: the kernel's copies alone (no arithmetic) take 91-100% of its time at batch 1
(docs/data/history-reads-h200-s69.txt; revised in the seventy-first session: that variant still ran 63% of the
kernel's instructions, docs/data/history-stalls-h200-s71.txt), and more staged pages made them slower, while a
read-only kernel with the same plan that asks for two pages a loop step reads at 86% of the copy bandwidth against
70% with one (25.0 -> 20.5 us at 1x128K). Here each page's arithmetic is the shipped kernel's, unchanged; only the
staging changes: SLOTS page slots (even), pages staged in pairs, SLOTS / 2 - 1 pairs in flight while a pair is read
(4 slots: the next pair; 6: the next two). Shared memory: 4.6 KB a slot, so 4 slots take 18.4 KB a program (8
programs a multiprocessor at batch 1 fit; 16 at 32 x 32K do not).
The variant is the shipped source changed by text (`pair_kernel`), loaded as a module of its own.
Found: correct and slower at every shape (1x128K 37.6 / 39.7 us against 32.0; docs/data/page-pairs-h200-s70.txt).
"""

from __future__ import annotations

import argparse
import inspect

PROLOGUE = """    for j in gl.static_range(STAGES - 1):
        ok = _stage_page(gl.load(bt_row + gl.minimum(lo + j, last)), num_pages, h, kc16, vc16, ks_ptr, kz_ptr,
                         vs_ptr, vz_ptr, slots, j, lo + j < hi, HKV, P)
        oks = oks | (ok.to(gl.int32) << j)
    ahead = gl.load(bt_row + gl.minimum(lo + STAGES - 1, last))
"""
PAIRED_PROLOGUE = """    for j in gl.static_range(STAGES - 2):  # pairs 0 .. STAGES / 2 - 2, one commit group a pair
        ok = _stage_page(gl.load(bt_row + gl.minimum(lo + j, last)), num_pages, h, kc16, vc16, ks_ptr, kz_ptr,
                         vs_ptr, vz_ptr, slots, j, lo + j < hi, HKV, P)
        oks = oks | (ok.to(gl.int32) << j)
        if j % 2 == 1:
            async_copy.commit_group()
    ahead = gl.load(bt_row + gl.minimum(lo + STAGES - 2, last))  # the ids of the next pair to stage
    ahead1 = gl.load(bt_row + gl.minimum(lo + STAGES - 1, last))
"""
STEP = """        async_copy.wait_group(STAGES - 2)  # this thread's copies of page index have landed
        _warp_barrier()  # everyone's have, and everyone is done with the slot refilled below
        ok = _stage_page(ahead, num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, slots,
                         (i + STAGES - 1) % STAGES, index + STAGES - 1 < hi, HKV, P)
        oks = oks | (ok.to(gl.int32) << (STAGES - 1))
        ahead = gl.load(bt_row + gl.minimum(index + STAGES, last))
"""
PAIRED_STEP = """        if i % 2 == 0:  # pages index, index + 1 (one group) have landed; stage the pair STAGES - 2 on
            async_copy.wait_group(STAGES // 2 - 2)
            _warp_barrier()
            ok = _stage_page(ahead, num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, slots,
                             (i + STAGES - 2) % STAGES, index + STAGES - 2 < hi, HKV, P)
            ok1 = _stage_page(ahead1, num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, slots,
                              (i + STAGES - 1) % STAGES, index + STAGES - 1 < hi, HKV, P)
            async_copy.commit_group()
            oks = oks | (ok.to(gl.int32) << (STAGES - 2)) | (ok1.to(gl.int32) << (STAGES - 1))
            ahead = gl.load(bt_row + gl.minimum(index + STAGES, last))
            ahead1 = gl.load(bt_row + gl.minimum(index + STAGES + 1, last))
"""
COMMIT = """    _async_load(vzbuf.index(stage), vz_ptr + row0 + row_at, mask=live)
    async_copy.commit_group()
"""


def pair_kernel():
    """The shipped history kernel with pages staged in pairs (STAGES even, at least 4), loaded as a module."""
    from oscarkv.kernels import gluon_history_kernel
    from probe_history_timeline import apply_edits, load_history_kernel

    source = apply_edits(inspect.getsource(gluon_history_kernel), [
        (COMMIT, COMMIT.replace("    async_copy.commit_group()\n", "")),  # the callers commit
        (PROLOGUE, PAIRED_PROLOGUE), (STEP, PAIRED_STEP)])
    return load_history_kernel("pair_history_kernel", source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="?", default="1x131072,1x100000,1x32768,8x32768")
    parser.add_argument("--slots", default="4,6", help="page slots of the paired variant (even, at least 4)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from oscarkv.kernels import gluon_history, gluon_history_kernel
    from probe_score_chains import compare_shapes

    paired = pair_kernel()
    kernels = {"shipped @2": (gluon_history_kernel.history_kernel, gluon_history.STAGES),
               **{f"pairs @{s}": (paired, s) for s in (int(x) for x in args.slots.split(","))}}
    compare_shapes(args.shapes, lambda case, spec: kernels, args.rounds)


if __name__ == "__main__":
    main()
