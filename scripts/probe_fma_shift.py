"""Developer tool (GPU): the Gluon history kernel with the high bytes of its code words shifted down on the FMA pipe
(a multiply-high, IMAD.HI) instead of the ALU pipe (SHF), against the shipped kernel, one decode layer per shape,
alternating CUDA-graph rounds, with each variant's error against the torch reference.

    PYTHONPATH=src:scripts python scripts/probe_fma_shift.py [1x131072,1x100000,8x32768,32x32768] [--rounds 3] [--once]

Why: `scripts/probe_mix_ipc.py` (docs/data/mix-ipc-h200-s72.txt) found that on the H200 the ALU instructions and
the mma.sync of the page loop share one issue limit of about two cycles each (ANDs alone issue at 0.50 a cycle,
ANDs with independent mma also at 0.50), while the FMA pipe is 11% busy in the history kernel. The page's 32
shifts `w >> 8` (`_high_bytes`, 16 a code tile) are the one part of the unpacking that a multiply can do:
mul.hi.u32(w, 2^24) is w >> 8 for any 32-bit w. The multiplier is a runtime value (2^24 unless a sequence has a
negative token count, which never happens), so that ptxas cannot turn the multiply back into a shift.
The variant is the shipped source changed by text, loaded as a module of its own; its outputs are the shipped
kernel's bit for bit (the same words reach the same ANDs).
Found: correct and 1.6-3.8% slower at every shape (docs/data/fma-shift-h200-s72.txt).
"""

from __future__ import annotations

import inspect

HIGH_BYTES = '''@gluon.jit
def _high_bytes(w):
'''
FMA_HIGH_BYTES = '''@gluon.jit
def _high_bytes_fma(w, multiplier):
    """w >> 8 per pair of int16 words as the high half of w * multiplier (multiplier 2^24: IMAD.HI, FMA pipe)."""
    m = gl.full(w.shape, 0, gl.int32, w.type.layout) + multiplier
    return gl.inline_asm_elementwise("mul.hi.u32 $0, $1, $2;", "=r,r,r,r", [w, m], dtype=gl.int16, is_pure=True,
                                     pack=2)


@gluon.jit
def _high_bytes(w):
'''
COUNT = "    count = gl.load(cu_ptr + b + 1) - start\n"
COUNT_AND_MULTIPLIER = COUNT + "    shift_multiplier = gl.where(count >= 0, 16777216, 16777217)\n"
KEY_HIGH = "        kh = _high_bytes(ka)\n"
VALUE_HIGH = "        vh = _high_bytes(va)\n"


def fma_shift_kernel():
    """The shipped kernel with `_high_bytes_fma` in place of `_high_bytes` in the page loop."""
    from oscarkv.kernels import gluon_history_kernel
    from probe_history_timeline import apply_edits, load_history_kernel

    source = apply_edits(inspect.getsource(gluon_history_kernel), [
        (HIGH_BYTES, FMA_HIGH_BYTES), (COUNT, COUNT_AND_MULTIPLIER),
        (KEY_HIGH, "        kh = _high_bytes_fma(ka, shift_multiplier)\n"),
        (VALUE_HIGH, "        vh = _high_bytes_fma(va, shift_multiplier)\n")])
    return load_history_kernel("fma_shift_history_kernel", source)


def main() -> None:
    from oscarkv.kernels import gluon_history
    from probe_score_chains import variant_main

    variant_main(__doc__, lambda: {"shifts on the FMA pipe": (fma_shift_kernel(), gluon_history.STAGES)})


if __name__ == "__main__":
    main()
