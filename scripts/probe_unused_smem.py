"""Developer tool (GPU): the Gluon history kernel with shared memory that it never touches (EXTRA more page slots of
key and value codes, allocated and unused), against the shipped kernel, one decode layer per shape, alternating
CUDA-graph rounds, with each variant's error against the torch reference.

    PYTHONPATH=src:scripts python scripts/probe_unused_smem.py [1x131072,1x100000,32x32768] [--rounds 3]

Why: every variant that stages more pages a program (cp.async or TMA, 3 or 4 slots, with or without a ramp that
keeps the first page first) has been slower, by about as much per slot, and more staged pages also mean more shared
memory a program (9.2 KB a program at 2 slots, 13.8 at 3, 18.4 at 4), so another shared-memory carve-out and a
smaller L1. These variants keep the shipped copies and arithmetic and only reserve the shared memory of 3 and 4
slots, to separate the footprint from the depth.
Found: the footprint costs little at batch 1 (1x128K 32.5 us with the shared memory of 3 or 4 slots against 32.2,
while really staging 3 slots takes 33.9); at 32x32K 199.1 and 204.4 against 198.6, 3 real slots 219.5
(docs/data/unused-smem-h200-s73.txt). So the depth itself is what costs.
"""

from __future__ import annotations

import inspect


def unused_kernel(extra: int):
    """The shipped kernel whose key and value slots are allocated `extra` slots larger than it uses."""
    from oscarkv.kernels import gluon_history_kernel
    from probe_history_timeline import apply_edits, load_history_kernel

    source = apply_edits(inspect.getsource(gluon_history_kernel), [
        ("gl.allocate_shared_memory(gl.int16, [STAGES, 64, WORDS], KEY_SMEM)",
         f"gl.allocate_shared_memory(gl.int16, [STAGES + {extra}, 64, WORDS], KEY_SMEM)"),
        ("gl.allocate_shared_memory(gl.int16, [STAGES, 64, WORDS], VALUE_SMEM)",
         f"gl.allocate_shared_memory(gl.int16, [STAGES + {extra}, 64, WORDS], VALUE_SMEM)"),
    ])
    return load_history_kernel(f"unused_smem_{extra}_history_kernel", source)


def main() -> None:
    from oscarkv.kernels import gluon_history
    from probe_score_chains import variant_main

    def variants():
        return {f"+{extra} unused slots ({(2 + extra) * 4.6:.1f} KB)": (unused_kernel(extra), gluon_history.STAGES)
                for extra in (1, 2)} | {"shipped at 3 slots": (unused_kernel(0), 3)}

    variant_main(__doc__, variants)


if __name__ == "__main__":
    main()
