"""Developer tool (GPU): the Gluon history kernel with each page's value codes read from shared memory by ldmatrix
with transpose (LDSM.16.MT88.4) straight into the value dot's A operand, against the shipped kernel, one decode layer
per shape, alternating CUDA-graph rounds, with each variant's error against the torch reference.

    PYTHONPATH=src:scripts python scripts/probe_value_ldmatrix.py [1x131072,1x100000,8x32768,32x32768] [--rounds 3] [--once]

Why: the value dot's A operand pairs the same code word of two tokens in each register, while a staged page holds a
token's words side by side. The shipped kernel reads the value words with 16 32-bit shared loads a page and pairs
them with 16 byte permutes (PRMT) on the ALU pipe, which `scripts/probe_mix_ipc.py` found to be the loop's limiting
issue resource (docs/kernels-log.md, "What the page loop's instruction mix allows"). ldmatrix with .trans does that
pairing in the shared-memory path: 4 instructions a page, no permutes. Gluon emits it for a load of the slot's view
[16 words, 64 score rows] into the A layout, where the slot is a swizzled layout (Gluon does not use ldmatrix for the
shipped slot's linear layout). So the copies put the page's tokens into the slot in score-row order (slot row k holds
token 8(k % 8) + k // 8, the order of the score dot's rows), the 16-byte pieces swizzled so that the 8 rows of one
8x8 matrix fall in 8 bank groups, and the value dot's row m' becomes word m' (the partial output's channels follow).
Compiled for sm_90 with Triton 3.6 the page loop has 4 LDSM instead of 16 LDS, 8 PRMT instead of 24, 699 instructions
instead of 723, and 130 registers (124 capped at 128, no spills: the cap that 16 programs a multiprocessor need).
Found: correct and 1-3% slower at every shape, read late or early, capped or not (docs/data/value-ldmatrix-h200-s72.txt).
The variant is the shipped source changed by text, loaded as a module of its own; the same words reach the same
ANDs, so its outputs are the shipped kernel's bit for bit.
"""

from __future__ import annotations

import inspect

SMEM = '''VALUE_SMEM: gl.constexpr = gl.constexpr(gl.SharedLinearLayout(offset_bases=[
    [0, 1], [0, 2], [0, 4], [0, 8], [16, 0], [32, 0], [1, 0], [2, 0], [4, 0], [8, 0]]))
'''
# Rows in score-row order (row k holds token 8(k % 8) + k // 8), 16-byte pieces swizzled by bit 2 of the row: the
# 8 rows of one ldmatrix matrix fill the 8 bank groups.
SMEM_LDSM = "VALUE_SMEM: gl.constexpr = gl.constexpr(gl.SwizzledSharedLayout(8, 4, 2, [1, 0]))\n"
COPY = '''    value_copy = (gl.arange(0, 64, layout=gl.SliceLayout(1, VALUE_COPY))[:, None] * WORDS
                  + gl.arange(0, WORDS, layout=gl.SliceLayout(0, VALUE_COPY))[None, :])
'''
COPY_LDSM = '''    value_row = gl.arange(0, 64, layout=gl.SliceLayout(1, VALUE_COPY))  # slot row k takes token 8(k % 8) + k // 8
    value_copy = ((8 * (value_row % 8) + value_row // 8)[:, None] * WORDS
                  + gl.arange(0, WORDS, layout=gl.SliceLayout(0, VALUE_COPY))[None, :])
'''
STAGED = "    return (kbuf.index(at).load(KEY_LOAD), vbuf.index(at).load(VALUE_LOAD), ksbuf.index(at).load(ROW_LOAD),\n"
STAGED_LDSM = "    return (kbuf.index(at).load(KEY_LOAD), vbuf.index(at), ksbuf.index(at).load(ROW_LOAD),\n"
VALUE_TILE = "        va = gl.convert_layout(_value_tile(vwords), A, assert_trivial=True)\n"
VALUE_TILE_LDSM = "        va = vwords.permute([1, 0]).load(A)  # [16 words, 64 score rows]: ldmatrix.trans\n"
# The value dot's row m' is now word m' (the shipped relabelling had word 2(m' % 8) + m' // 8).
# Or read at the top of the step, where the shipped kernel reads the value words (`early`).
STEP_READ = "        kwords, vwords, ks_raw, kz_raw, vs_raw, vz_raw = _staged_page(slots, i % STAGES)\n"
STEP_READ_EARLY = STEP_READ + "        va = vwords.permute([1, 0]).load(A)  # [16 words, 64 score rows]: ldmatrix.trans\n"
CHANNEL = "    channel = 2 * (2 * (m % 8) + m // 8) + parity + offset\n"
CHANNEL_LDSM = "    channel = 2 * m + parity + offset\n"


def ldmatrix_kernel(early: bool = False):
    """The shipped kernel with the value words read by ldmatrix.trans (see the module doc); early: at the top of the
    loop step instead of just before the value dots."""
    from oscarkv.kernels import gluon_history_kernel
    from probe_history_timeline import apply_edits, load_history_kernel

    edits = [(SMEM, SMEM_LDSM), (COPY, COPY_LDSM), (STAGED, STAGED_LDSM), (CHANNEL, CHANNEL_LDSM)]
    edits += [(VALUE_TILE, ""), (STEP_READ, STEP_READ_EARLY)] if early else [(VALUE_TILE, VALUE_TILE_LDSM)]
    source = apply_edits(inspect.getsource(gluon_history_kernel), edits)
    return load_history_kernel(f"value_ldmatrix{'_early' if early else ''}_history_kernel", source)


def main() -> None:
    from oscarkv.kernels import gluon_history
    from probe_score_chains import variant_main

    def variants():
        late, early = ldmatrix_kernel(), ldmatrix_kernel(early=True)
        return {"values by ldmatrix.trans": (late, gluon_history.STAGES),
                "the same, 128 registers": (late, gluon_history.STAGES, 0, 128),
                "ldmatrix at the step's top": (early, gluon_history.STAGES),
                "the same, 128 registers ": (early, gluon_history.STAGES, 0, 128)}

    variant_main(__doc__, variants)


if __name__ == "__main__":
    main()
