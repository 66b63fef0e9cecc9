"""Developer tool (GPU): the Gluon history kernel with each page also prefetched into the L2 cache one loop step
before its cp.async copies are issued (two steps before it is read), against the shipped kernel, one decode layer
per shape, alternating CUDA-graph rounds, with each variant's error against the torch reference.

    PYTHONPATH=src:scripts python scripts/probe_l2_pages.py [1x131072,1x100000,8x32768,32x32768] [--rounds 3] [--once]

Why: at the clock the kernel runs at, its largest single stall is the wait for the current page's copies, issued one
step earlier (docs/data/history-stalls-h200-s71.txt); but every way of putting more copies in flight (3-6 slots,
pairs of pages, the TMA, registers) was slower. An L2 prefetch asks for the bytes without a slot, a commit group or a
register: each lane issues one `prefetch.global.L2` of a 128-byte line of the page after next (lanes 0-15 its key
codes, 16-31 its value codes) and lanes 0-3 one of its scale and zero rows, so that the copies issued a step later
find the page in L2. The page ids are loaded one more step ahead for it (one block-table load a step, as shipped).
The variant is the shipped source changed by text, loaded as a module of its own; its outputs are the shipped
kernel's bit for bit (a prefetch changes no value).
Found: correct and 5-18% slower (1x128K 35.5 against 32.2 us); the L2's tag lookups rise from 62% to 73% of their
peak (docs/data/l2-pages-h200-s72.txt).
"""

from __future__ import annotations

import inspect

PREFETCH_HELPER_AT = "@gluon.jit\ndef _program_terms("
PREFETCH_HELPER = '''@gluon.jit
def _prefetch_lines(ptrs, ok):
    """prefetch.global.L2 of each pointer's line where ok (one per lane)."""
    gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; }", "=r,l,r",
                              [ptrs, ok.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _prefetch_page(page, num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, live, HKV: gl.constexpr,
                   P: gl.constexpr):
    """Ask the L2 for one history page (the lines `_stage_page` copies): lanes 0-15 the key codes' 16 lines of 128
    bytes, 16-31 the value codes', lanes 0-3 the key scales, key zeros, value scales and value zeros."""
    lane = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    ok = (page >= 0) & (page < num_pages) & live
    row0 = (gl.where(ok, page, 0).to(gl.int64) * HKV + h) * P
    line = (lane % 16) * 64  # int16 words a 128-byte line
    _prefetch_lines(gl.where(lane < 16, kc16 + row0 * WORDS + line, vc16 + row0 * WORDS + line), ok & (lane < 32))
    rows = gl.where(lane == 0, ks_ptr + row0, gl.where(lane == 1, kz_ptr + row0,
                                                      gl.where(lane == 2, vs_ptr + row0, vz_ptr + row0)))
    _prefetch_lines(rows, ok & (lane < 4))


@gluon.jit
def _program_terms('''
FIRST_IDS = "    ahead = gl.load(bt_row + gl.minimum(lo + STAGES - 1, last))\n"
FIRST_IDS_L2 = FIRST_IDS + "    ahead2 = gl.load(bt_row + gl.minimum(lo + STAGES, last))\n"
NEXT_ID = "        ahead = gl.load(bt_row + gl.minimum(index + STAGES, last))\n"
NEXT_ID_L2 = """        _prefetch_page(ahead2, num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, index + STAGES < hi, HKV, P)
        ahead = ahead2
        ahead2 = gl.load(bt_row + gl.minimum(index + STAGES + 1, last))
"""


def l2_kernel():
    """The shipped kernel with the page after next prefetched into L2 each step (see the module doc)."""
    from oscarkv.kernels import gluon_history_kernel
    from probe_history_timeline import apply_edits, load_history_kernel

    source = apply_edits(inspect.getsource(gluon_history_kernel), [
        (PREFETCH_HELPER_AT, PREFETCH_HELPER), (FIRST_IDS, FIRST_IDS_L2), (NEXT_ID, NEXT_ID_L2)])
    return load_history_kernel("l2_pages_history_kernel", source)


def main() -> None:
    from oscarkv.kernels import gluon_history
    from probe_score_chains import variant_main

    def variants():
        variant = l2_kernel()
        return {"page after next into L2": (variant, gluon_history.STAGES),
                "the same, 128 registers": (variant, gluon_history.STAGES, 0, 128)}

    variant_main(__doc__, variants)


if __name__ == "__main__":
    main()
