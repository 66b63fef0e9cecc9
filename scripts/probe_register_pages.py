"""Developer tool (GPU): the Gluon history kernel with its pages loaded straight into registers one page ahead
(plain global loads, no shared memory, no cp.async), the loads pinned at the top of the loop, against the shipped
kernel, one decode layer per shape, alternating CUDA-graph rounds, with each variant's error against the torch
reference.

    PYTHONPATH=src:scripts python scripts/probe_register_pages.py [1x131072,1x100000] [--rounds 3]

Why: at the clock the kernel runs at, the largest single stall of the shipped kernel is the wait for the current
page's cp.async copies (docs/data/history-stalls-h200-s71.txt), yet more slots of cp.async staging were slower, and
so were pairs of pages and the TMA; while a read-only kernel of plain vector loads with the same plan read faster
than the kernel's own copies. The fifty-first session's kernel loaded the next page into registers, but the
compiler issued those loads half-way through the page before, so they hid half a page of latency. Here the next
page's 29 loads are issued at the top of each loop step, each page id two pages ahead, and an empty side-effecting
inline-asm statement that takes their results keeps the compiler from moving them later (`_pin`); the page's arithmetic
is the shipped kernel's, unchanged. The variant holds a page more in registers (about 36 a thread), so it takes
more than 128 and fewer programs fit a multiprocessor: it is for batch-1 plans (8 programs a multiprocessor).
The variant is the shipped source changed by text (`register_kernel`), loaded as a module of its own. The pins hold
the loads at the top of the step in the PTX, but ptxas still issues them after the step's score dots (in the SASS),
as in the fifty-first session; with two pages ahead (`ahead=2`, 224 registers) each load is issued a page and a half
before its use.
Found: correct and much slower at every shape (1x128K 43.2 us one page ahead, 49.5 two pages ahead, against 32.4;
docs/data/register-pages-h200-s71.txt).
"""

from __future__ import annotations

import argparse
import inspect

from probe_history_claims import PROLOGUE as STAGED_PROLOGUE
from probe_page_pairs import STEP as STAGED_STEP

# The shipped kernel's text that the variant replaces: its staging before the loop and at the top of each step.
PROLOGUE = "    slots = _page_slots(STAGES)\n" + STAGED_PROLOGUE
FIRST_PAGE = """    last = gl.maximum(hi - 1, 0)
    ok_next, kw_next, vw_next, ks_next, kz_next, vs_next, vz_next = _load_page(
        gl.load(bt_row + gl.minimum(lo, last)), num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, lo < hi,
        HKV, P)
"""
REGISTER_PROLOGUE = FIRST_PAGE + """    ahead = gl.load(bt_row + gl.minimum(lo + 1, last))
"""
STEP = STAGED_STEP + """        kwords, vwords, ks_raw, kz_raw, vs_raw, vz_raw = _staged_page(slots, i % STAGES)
        page_ok = (oks & 1) != 0
        oks = oks >> 1
"""
REGISTER_STEP = """        kwords, vwords, ks_raw, kz_raw, vs_raw, vz_raw = kw_next, vw_next, ks_next, kz_next, vs_next, vz_next
        page_ok = ok_next
        ok_next, kw_next, vw_next, ks_next, kz_next, vs_next, vz_next = _load_page(
            ahead, num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, index + 1 < hi, HKV, P)
        _pin_page(kw_next, vw_next, ks_next, kz_next, vs_next, vz_next)
        ahead = gl.load(bt_row + gl.minimum(index + 2, last))
"""
# Two pages ahead: the loads of page index + 2 are issued while page index is read, wherever the compiler puts
# them in the step (ptxas puts a step's loads after its score dots, so one page ahead hides only half a page).
REGISTER_PROLOGUE_2 = FIRST_PAGE + """    ok_far, kw_far, vw_far, ks_far, kz_far, vs_far, vz_far = _load_page(
        gl.load(bt_row + gl.minimum(lo + 1, last)), num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
        lo + 1 < hi, HKV, P)
    ahead = gl.load(bt_row + gl.minimum(lo + 2, last))
"""
REGISTER_STEP_2 = """        kwords, vwords, ks_raw, kz_raw, vs_raw, vz_raw = kw_next, vw_next, ks_next, kz_next, vs_next, vz_next
        page_ok = ok_next
        ok_next, kw_next, vw_next, ks_next, kz_next, vs_next, vz_next = (
            ok_far, kw_far, vw_far, ks_far, kz_far, vs_far, vz_far)
        ok_far, kw_far, vw_far, ks_far, kz_far, vs_far, vz_far = _load_page(
            ahead, num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, index + 2 < hi, HKV, P)
        _pin_page(kw_far, vw_far, ks_far, kz_far, vs_far, vz_far)
        ahead = gl.load(bt_row + gl.minimum(index + 3, last))
"""
WAIT_ALL = "    async_copy.wait_group(0)\n"
HELPERS_AFTER = "@gluon.jit\ndef _program_terms("
HELPERS = '''# The values' zero points as loaded here: VALUE_ROW_LOAD with its register bases in token order (16 consecutive
# tokens a thread, two 16-byte loads), relabelled into VALUE_ROW_LOAD by a reordering of each thread's registers.
VZ_LOAD: gl.constexpr = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[1], [2], [4], [8]], lane_bases=[[16], [32], [0], [0], [0]], warp_bases=[], block_bases=[],
    shape=[64]))


@gluon.jit
def _load_page(page, num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, live, HKV: gl.constexpr,
               P: gl.constexpr):
    """One history page loaded into registers in the layouts that `_staged_page` returns, and whether its id is
    valid (an id out of range reads page 0, masked by the caller); nothing is read where not `live`."""
    key_at = (gl.arange(0, 64, layout=gl.SliceLayout(1, KEY_LOAD))[:, None] * WORDS
              + gl.arange(0, WORDS, layout=gl.SliceLayout(0, KEY_LOAD))[None, :])
    value_at = (gl.arange(0, 64, layout=gl.SliceLayout(1, VALUE_LOAD))[:, None] * WORDS
                + gl.arange(0, WORDS, layout=gl.SliceLayout(0, VALUE_LOAD))[None, :])
    row_at = gl.arange(0, 64, layout=ROW_LOAD)
    value_row_at = gl.arange(0, 64, layout=VZ_LOAD)
    page_ok = (page >= 0) & (page < num_pages)
    row0 = (gl.where(page_ok, page, 0).to(gl.int64) * HKV + h) * P
    return (page_ok,
            gl.load(kc16 + row0 * WORDS + key_at, mask=(key_at >= 0) & live, other=0),
            gl.load(vc16 + row0 * WORDS + value_at, mask=(value_at >= 0) & live, other=0),
            gl.load(ks_ptr + row0 + row_at, mask=(row_at >= 0) & live, other=0.0),
            gl.load(kz_ptr + row0 + row_at, mask=(row_at >= 0) & live, other=0.0),
            gl.load(vs_ptr + row0 + row_at, mask=(row_at >= 0) & live, other=0.0),
            gl.convert_layout(gl.load(vz_ptr + row0 + value_row_at, mask=(value_row_at >= 0) & live, other=0.0),
                              VALUE_ROW_LOAD))


@gluon.jit
def _pin(x):
    """x, held at this point of the program: an empty side-effecting statement that takes x (no instruction, so no
    wait for it), which LLVM cannot move and before which x's load must stay."""
    gl.inline_asm_elementwise("// pin $1", "=r,h", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _pin_page(kw, vw, ks, kz, vs, vz):
    """`_pin` for each part of a page."""
    _pin(kw)
    _pin(vw)
    _pin(ks)
    _pin(kz)
    _pin(vs)
    _pin(vz)


'''


def register_source(ahead: int = 1) -> str:
    """The shipped kernel's module source with its pages loaded into registers `ahead` (1 or 2) pages ahead (see the
    module docstring)."""
    from oscarkv.kernels import gluon_history_kernel
    from probe_history_timeline import apply_edits

    prologue, step = (REGISTER_PROLOGUE, REGISTER_STEP) if ahead == 1 else (REGISTER_PROLOGUE_2, REGISTER_STEP_2)
    return apply_edits(inspect.getsource(gluon_history_kernel), [
        (PROLOGUE, prologue), (STEP, step), (WAIT_ALL, ""), (HELPERS_AFTER, HELPERS + HELPERS_AFTER)])


def register_kernel(ahead: int = 1):
    """The register-page history kernel, loaded as a module of its own (Gluon compiles from a source file)."""
    from probe_history_timeline import load_history_kernel

    return load_history_kernel(f"register_{ahead}_history_kernel", register_source(ahead))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="?", default="1x131072,1x100000,1x32768")
    parser.add_argument("--cap", type=int, default=255, help="the variant's register cap")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from oscarkv.kernels import gluon_history, gluon_history_kernel
    from probe_score_chains import compare_shapes

    kernels = {"shipped @2": (gluon_history_kernel.history_kernel, gluon_history.STAGES),
               "registers, 1 page ahead": (register_kernel(1), 2, 0, args.cap),
               "registers, 2 pages ahead": (register_kernel(2), 2, 0, args.cap)}
    compare_shapes(args.shapes, lambda case, spec: kernels, args.rounds)


if __name__ == "__main__":
    main()
