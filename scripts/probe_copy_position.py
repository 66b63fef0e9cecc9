"""Developer tool (GPU): the Gluon history kernel with the next page's copies issued later in the loop step (after
the page's softmax, or at its end) instead of at its top, against the shipped kernel, one decode layer per shape,
alternating CUDA-graph rounds, with each variant's error against the torch reference.

    PYTHONPATH=src:scripts python scripts/probe_copy_position.py [1x131072,1x100000,32x32768] [--rounds 3]

Why: a page copied earlier than the shipped kernel copies it (a third or fourth slot, by cp.async or the TMA, with
or without a ramp) has made the kernel slower, and so has not the shared memory of those slots alone
(`probe_unused_smem.py`): the depth itself costs. These variants go the other way, each page's copies in flight for
less of the step before the one that reads it (the slot they refill was last read a step earlier, so it is free
from the step's top).
Found: later is slower too (1x128K 34.5-35.4 us against 32.2 uncapped, 34.6-41.2 capped at 128; 32x32K 210.5 at
best against 207.2; docs/data/copy-position-h200-s73.txt): the shipped place, one page ahead from the step's top,
is the fastest measured.
"""

from __future__ import annotations

import inspect

ISSUE = """        ok = _stage_page(ahead, num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, slots,
                         (i + STAGES - 1) % STAGES, index + STAGES - 1 < hi, HKV, P)
        oks = oks | (ok.to(gl.int32) << (STAGES - 1))
        ahead = gl.load(bt_row + gl.minimum(index + STAGES, last))
"""
# The same after the page's validity bit has been shifted out (bit STAGES - 2 is then page index + STAGES - 1).
LATE_ISSUE = ISSUE.replace("<< (STAGES - 1)", "<< (STAGES - 2)")
PLACES = {"after the softmax": "        m_run = m_new\n",
          "at the step's end": "        acc7 = mma_v2(_slice_units(va, vh, 7), wb, acc7)\n"}


def late_kernel(place: str):
    """The shipped kernel with the copies of each step issued after the line PLACES[place]."""
    from oscarkv.kernels import gluon_history_kernel
    from probe_history_timeline import apply_edits, load_history_kernel

    marker = PLACES[place]
    source = apply_edits(inspect.getsource(gluon_history_kernel), [(ISSUE, ""), (marker, marker + LATE_ISSUE)])
    return load_history_kernel("copy_" + place.replace(" ", "_").replace("'", "") + "_history_kernel", source)


def main() -> None:
    from oscarkv.kernels import gluon_history
    from probe_score_chains import variant_main

    def variants():
        found = {}
        for place in PLACES:  # 138 and 140 registers uncapped (sm_90, Triton 3.6), against the shipped 128
            kernel = late_kernel(place)
            found[f"copies {place}"] = (kernel, gluon_history.STAGES)
            found[f"copies {place}, 128 regs"] = (kernel, gluon_history.STAGES, 0, 128)
        return found

    variant_main(__doc__, variants)


if __name__ == "__main__":
    main()
