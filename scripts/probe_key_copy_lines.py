"""Developer tool (GPU): the Gluon history kernel with each page's key codes copied in whole 128-byte lines, against
the shipped kernel, one decode layer per shape, alternating CUDA-graph rounds, with each variant's error against the
torch reference.

    PYTHONPATH=src:scripts python scripts/probe_key_copy_lines.py [1x131072,1x100000,8x32768,32x32768] [--rounds 3]

Why: under Nsight Compute the shipped history launch at 1x128K keeps the L2 busier than the DRAM (L2 69% of its
peak, its tag lookups 62%, DRAM 54%; docs/data/l2-pages-h200-s72.txt), and an L2 prefetch that added requests
made it slower. The shipped key copy (`KEY_COPY`) gives each cp.async instruction the even (or odd) rows of 16 tokens:
half of each 128-byte line (4 tokens of 32 bytes), so every line of key codes is asked for twice. The value copy
already covers whole lines. The variant's key copy gives the 32 lanes of one instruction 16 consecutive tokens (512
contiguous bytes: 4 whole lines), and its key slot layout XORs the token's bit 0 into the offset bit that chose the
16-byte bank group by the token's bit 4, so that the copies' shared-memory writes stay free of bank conflicts
(every group written by 4 lanes) while the reads in `KEY_LOAD` (token bit 0 fixed in each) stay as conflict-free as
shipped. The variant is the shipped source changed by text, loaded as a module of its own; its outputs are the
shipped kernel's bit for bit (the same words reach the same registers).
Found: correct, the same L2 requests (2.96 M at 1x128K), and no faster (docs/data/key-copy-lines-h200-s72.txt).
"""

from __future__ import annotations

import inspect

KEY_SMEM = """KEY_SMEM: gl.constexpr = gl.constexpr(gl.SharedLinearLayout(offset_bases=[
    [0, 1], [0, 2], [0, 4], [0, 8], [8, 0], [16, 0], [1, 0], [2, 0], [4, 0], [32, 0]]))
"""
# Offset bit 6 holds token bits 0 and 4: token bit 0 = offset bit 6, token bit 4 = offset bit 5 XOR offset bit 6.
KEY_SMEM_LINES = """KEY_SMEM: gl.constexpr = gl.constexpr(gl.SharedLinearLayout(offset_bases=[
    [0, 1], [0, 2], [0, 4], [0, 8], [8, 0], [16, 0], [17, 0], [2, 0], [4, 0], [32, 0]]))
"""
KEY_COPY = """    reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [32, 0]], lane_bases=[[0, 8], [8, 0], [16, 0], [2, 0], [4, 0]],
"""
KEY_COPY_LINES = """    reg_bases=[[0, 1], [0, 2], [0, 4], [16, 0], [32, 0]], lane_bases=[[0, 8], [1, 0], [2, 0], [4, 0], [8, 0]],
"""


def lines_kernel():
    """The shipped kernel with whole-line key copies (see the module doc)."""
    from oscarkv.kernels import gluon_history_kernel
    from probe_history_timeline import apply_edits, load_history_kernel

    source = apply_edits(inspect.getsource(gluon_history_kernel),
                         [(KEY_SMEM, KEY_SMEM_LINES), (KEY_COPY, KEY_COPY_LINES)])
    return load_history_kernel("key_copy_lines_history_kernel", source)


def main() -> None:
    from oscarkv.kernels import gluon_history
    from probe_score_chains import variant_main

    def variants():
        variant = lines_kernel()
        return {"key copies in whole lines": (variant, gluon_history.STAGES),
                "the same, 128 registers": (variant, gluon_history.STAGES, 0, 128)}

    variant_main(__doc__, variants)


if __name__ == "__main__":
    main()
