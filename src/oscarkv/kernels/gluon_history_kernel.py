"""The Gluon kernel of `gluon_history` (imported only where Gluon exists; see there for what and why).

Notation of the layout comments: a warp's lane is 4g + c (g < 8, c < 4), the mma.sync m16n8k16 fragments being
  A [16 m, 16 k]: lane holds (m = g and g+8, k = 2c, 2c+1 and 2c+8, 2c+9)
  B [16 k, 8 n]:  lane holds (k = 2c, 2c+1 and 2c+8, 2c+9, n = g)
  C [16 m, 8 n]:  lane holds (m = g and g+8, n = 2c, 2c+1).
Within a page, score row m (A's m of the score dot, C's m of its result, B's k of the value dot) is token
8(m % 8) + m // 8, so that a thread's 8 rows are 8 consecutive tokens: one 16-byte load of each per-token vector.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

# Gluon's names moved between releases (3.6: async_copy_global_to_shared, thread_barrier; 3.9: async_load, barrier)
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_warp_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

WORDS: gl.constexpr = gl.constexpr(16)  # int16 words per row of INT2 codes at D = 128

# The load layouts that `_key_tile`, `_value_tile` and `_page_rows` relabel (register, lane bases: [row, word]).
KEY_LOAD: gl.constexpr = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], lane_bases=[[0, 4], [0, 8], [8, 0], [16, 0], [32, 0]],
    warp_bases=[], block_bases=[], shape=[64, 16]))
VALUE_LOAD: gl.constexpr = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [1, 0], [2, 0], [4, 0], [8, 0]], lane_bases=[[16, 0], [32, 0], [0, 2], [0, 4], [0, 8]],
    warp_bases=[], block_bases=[], shape=[64, 16]))
ROW_LOAD: gl.constexpr = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[1], [2], [4]], lane_bases=[[0], [0], [8], [16], [32]], warp_bases=[], block_bases=[],
    shape=[64]))
# A per-token vector [64] loaded so that `_page_rows` puts it in the registers of one row of the A operand [16, 64]:
# A's register bases k + 1, k + 8, k + 16, k + 32 and lane bases k + 2, k + 4 as tokens 8(k % 8) + k // 8.
VALUE_ROW_LOAD: gl.constexpr = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[8], [1], [2], [4]], lane_bases=[[16], [32], [0], [0], [0]], warp_bases=[], block_bases=[],
    shape=[64]))
# Shared-memory layouts of a staged page [row, word] (offset bit i holds the listed coordinate) whose reads in
# KEY_LOAD / VALUE_LOAD are free of bank conflicts (the lanes of one read cover all 32 banks), and the layouts of
# the copies into them (16-byte pieces).
KEY_SMEM: gl.constexpr = gl.constexpr(gl.SharedLinearLayout(offset_bases=[
    [0, 1], [0, 2], [0, 4], [0, 8], [8, 0], [16, 0], [1, 0], [2, 0], [4, 0], [32, 0]]))
VALUE_SMEM: gl.constexpr = gl.constexpr(gl.SharedLinearLayout(offset_bases=[
    [0, 1], [0, 2], [0, 4], [0, 8], [16, 0], [32, 0], [1, 0], [2, 0], [4, 0], [8, 0]]))
# Key shifts computed by each program (KEY_SHIFTS 2): the query rows [8 heads, D] spread over the lanes by channel.
QUERY_ROWS: gl.constexpr = gl.constexpr(gl.BlockedLayout([8, 4], [1, 32], [1, 1], [1, 0]))
KEY_COPY: gl.constexpr = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [32, 0]], lane_bases=[[0, 8], [8, 0], [16, 0], [2, 0], [4, 0]],
    warp_bases=[], block_bases=[], shape=[64, 16]))
VALUE_COPY: gl.constexpr = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [4, 0], [8, 0]], lane_bases=[[0, 8], [16, 0], [32, 0], [1, 0], [2, 0]],
    warp_bases=[], block_bases=[], shape=[64, 16]))


@gluon.jit
def _masked_units(w, MASK: gl.constexpr):
    """(w & MASK) of int16 words as float16 with the same bits, one 32-bit AND per pair."""
    mask = gl.full(w.shape, MASK, gl.int16, w.type.layout)
    return gl.inline_asm_elementwise("and.b32 $0, $1, $2;", "=r,r,r", [w, mask], dtype=gl.float16, is_pure=True,
                                     pack=2)


@gluon.jit
def _slice_units(w, high, s: gl.constexpr):
    """INT2 slice s of the word tile w as float16 units: field s % 4 of the low bytes (w) or, for s >= 4, of the
    high bytes (high = `_high_bytes(w)`), as `triton_attention._slice_codes` reads it."""
    return _masked_units(w if s < 4 else high, 3 << (2 * (s % 4)))


@gluon.jit
def _high_bytes(w):
    """w >> 8 per int16 word (only the low 8 bits of the result are used, `_masked_units`)."""
    return gl.inline_asm_elementwise("shr.b32 $0, $1, 8;", "=r,r", [w], dtype=gl.int16, is_pure=True, pack=2)


@gluon.jit
def _grid_dependency(asm: gl.constexpr):
    """One griddepcontrol instruction (programmatic dependent launch)."""
    gl.inline_asm_elementwise(asm + " // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _key_tile(w):
    """[64 rows, 16 words] as loaded (lane 4g+c: rows 8g..8g+7, words 4c..4c+3) relabelled as the A operand
    [64 m, 16 k] of the score dot: row 8g+j is m = 8j+g, word 4c+2e1+e0 is k = 8e1+2c+e0."""
    x = gl.reshape(w, [8, 2, 2, 2, 2, 2, 2, 2])  # (g, j2, j1, j0, c1, c0, e1, e0)
    x = gl.permute(x, [1, 2, 3, 0, 6, 4, 5, 7])  # (j2, j1, j0, g, e1, c1, c0, e0)
    return gl.reshape(x, [64, WORDS])


@gluon.jit
def _value_tile(w):
    """[64 rows, 16 words] as loaded (lane 4g+c: rows 16c..16c+15, words 2g, 2g+1) relabelled as the A operand
    [16 m', 64 k] of the transposed value dot: word 2g+h is m' = 8h+g, row 8a+b is k = 8b+a (score row k)."""
    x = gl.reshape(w, [8, 8, 8, 2])  # (a, b, g, h)
    x = gl.permute(x, [3, 2, 1, 0])  # (h, g, b, a)
    return gl.reshape(x, [WORDS, 64])


@gluon.jit
def _page_rows(x):
    """A per-token vector [64] as loaded (lane 4g+c: tokens 8g..8g+7) relabelled by score row m = 8j+g."""
    return gl.reshape(gl.permute(gl.reshape(x, [8, 8]), [1, 0]), [64])


@gluon.jit
def _value_zero_operand(v_zero, like, A: gl.constexpr):
    """The values' zero points [64 tokens] as loaded (VALUE_ROW_LOAD) as an A operand [16, 64] (the shape and layout
    of `like`) each of whose rows holds them by score row k: its dot with the weights is Σ_k weight·zero per head,
    in every row, in four tensor-core dots instead of 40 conversions, multiplies and adds per thread."""
    x = gl.convert_layout(_page_rows(v_zero), gl.SliceLayout(0, A), assert_trivial=True)
    return gl.broadcast(gl.expand_dims(x, 0), like)[0]


@gluon.jit
def _fold_rows(x):
    """[64 m, 8] accumulator tile summed over m // 8 inside each thread: [8 (m % 8), 8]."""
    return gl.sum(gl.reshape(x, [8, 8, 8]), 0)


@gluon.jit
def _weights_operand(w, B: gl.constexpr):
    """The float16 weights [64 m, 8 heads] in the accumulator layout as the value dot's B operand (k = m).
    movmatrix transposes each 8x8 block across the warp; the relabelling undoes that transpose in the labels,
    which leaves every register where the B fragment wants it."""
    t = gl.inline_asm_elementwise("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r", [w],
                                  dtype=gl.float16, is_pure=True, pack=2)
    t = gl.reshape(gl.permute(gl.reshape(t, [8, 8, 8]), [0, 2, 1]), [64, 8])
    return gl.convert_layout(t, B, assert_trivial=True)


@gluon.jit
def _slice_of(s: gl.constexpr, D: gl.constexpr):
    """(channel offset, parity, multiplier) of INT2 slice s (`triton_attention._slice_layout`, D >= 128)."""
    return (s % 4) * (D // 4), s // 4, 4 ** (s % 4)


@gluon.jit
def _query_operand(q_ptr, q_row, head_ok, s: gl.constexpr, D: gl.constexpr, B: gl.constexpr):
    """Slice s of the queries as the B operand [16 k, 8 heads] of the score dot (k = 8e1+2c+e0 is word
    4c+2e1+e0, see `_key_tile`), divided by the slice's multiplier, and the slice's Σq per head."""
    offset, parity, mult = _slice_of(s, D)
    k = gl.arange(0, WORDS, layout=gl.SliceLayout(1, B))
    word = 4 * ((k >> 1) & 3) + 2 * (k >> 3) + (k & 1)
    q = gl.load(q_ptr + q_row[None, :] * D + (2 * word + parity + offset)[:, None], mask=head_ok[None, :],
                other=0.0)
    q = (q.to(gl.float32) * (1.0 / mult)).to(gl.float16)
    return q, gl.sum(q.to(gl.float32), 0) * mult


@gluon.jit
def _store_slice(acc, z, l_safe, v_unit, part_o_ptr, part_row, row_ok, s: gl.constexpr, D: gl.constexpr,
                 MMA: gl.constexpr):
    """Slice s of the normalised partial output from acc [16 m', 8 heads] (m' = 8h+g holds word 2g+h)."""
    offset, parity, mult = _slice_of(s, D)
    m = gl.arange(0, WORDS, layout=gl.SliceLayout(1, MMA))
    channel = 2 * (2 * (m % 8) + m // 8) + parity + offset
    o = (acc * (v_unit / mult) - z[None, :]) / l_safe[None, :]
    gl.store(part_o_ptr + part_row[None, :] * D + channel[:, None], o, mask=row_ok[None, :])


@gluon.jit
def _page_slots(STAGES: gl.constexpr):
    """Shared memory for STAGES staged history pages: key words, value words, key scales, key zeros, value scales,
    value zeros (9 KB per two slots)."""
    ROW_SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    return (gl.allocate_shared_memory(gl.int16, [STAGES, 64, WORDS], KEY_SMEM),
            gl.allocate_shared_memory(gl.int16, [STAGES, 64, WORDS], VALUE_SMEM),
            gl.allocate_shared_memory(gl.float16, [STAGES, 64], ROW_SMEM),
            gl.allocate_shared_memory(gl.float16, [STAGES, 64], ROW_SMEM),
            gl.allocate_shared_memory(gl.float16, [STAGES, 64], ROW_SMEM),
            gl.allocate_shared_memory(gl.float16, [STAGES, 64], ROW_SMEM))


@gluon.jit
def _stage_page(page, num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, slots, stage, live,
                HKV: gl.constexpr, P: gl.constexpr):
    """Start copying one history page (codes, scales and zeros) into slot `stage` of `slots` (`_page_slots`), one
    commit group (empty where not `live`); returns whether its id is valid (an id out of range reads page 0, and the
    caller masks its scores)."""
    kbuf, vbuf, ksbuf, kzbuf, vsbuf, vzbuf = slots
    key_copy = (gl.arange(0, 64, layout=gl.SliceLayout(1, KEY_COPY))[:, None] * WORDS
                + gl.arange(0, WORDS, layout=gl.SliceLayout(0, KEY_COPY))[None, :])
    value_copy = (gl.arange(0, 64, layout=gl.SliceLayout(1, VALUE_COPY))[:, None] * WORDS
                  + gl.arange(0, WORDS, layout=gl.SliceLayout(0, VALUE_COPY))[None, :])
    row_at = gl.arange(0, 64, layout=ROW_LOAD)
    page_ok = (page >= 0) & (page < num_pages)
    row0 = (gl.where(page_ok, page, 0).to(gl.int64) * HKV + h) * P
    _async_load(kbuf.index(stage), kc16 + row0 * WORDS + key_copy, mask=live)
    _async_load(vbuf.index(stage), vc16 + row0 * WORDS + value_copy, mask=live)
    _async_load(ksbuf.index(stage), ks_ptr + row0 + row_at, mask=live)
    _async_load(kzbuf.index(stage), kz_ptr + row0 + row_at, mask=live)
    _async_load(vsbuf.index(stage), vs_ptr + row0 + row_at, mask=live)
    _async_load(vzbuf.index(stage), vz_ptr + row0 + row_at, mask=live)
    async_copy.commit_group()
    return page_ok


@gluon.jit
def _program_terms(q_ptr, q_row0, heads_ok, shift_ptr, first_block, last_block, h, qk_scale, HKV: gl.constexpr,
                   D: gl.constexpr, TERM_ROWS: gl.constexpr):
    """The score terms qk_scale · q·shift of blocks first_block..last_block (at most TERM_ROWS) for the program's
    query rows (q_row0 + head; `triton_attention._score_shift_kernel`'s arithmetic), in shared memory [TERM_ROWS, 8],
    row b - first_block; shift_ptr: the layer's key shifts [blocks, HKV, D] float32."""
    heads = gl.arange(0, 8, layout=gl.SliceLayout(1, QUERY_ROWS))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, QUERY_ROWS))
    ok = gl.convert_layout(heads_ok, gl.SliceLayout(1, QUERY_ROWS))
    q = gl.load(q_ptr + (q_row0 + heads)[:, None] * D + cols[None, :], mask=ok[:, None], other=0.0).to(gl.float32)
    rows = gl.allocate_shared_memory(gl.float32, [TERM_ROWS, 8], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for block in range(first_block, last_block + 1):
        shift = gl.load(shift_ptr + (block.to(gl.int64) * HKV + h) * D + cols)
        rows.index(block - first_block).store(gl.sum(q * shift[None, :], 1) * qk_scale)
    _warp_barrier()
    return rows


@gluon.jit
def _staged_page(slots, at):
    """Slot `at` of `slots` in registers, in the load layouts: key words, value words, key scales, key zeros, value
    scales (ROW_LOAD), value zeros (VALUE_ROW_LOAD)."""
    kbuf, vbuf, ksbuf, kzbuf, vsbuf, vzbuf = slots
    return (kbuf.index(at).load(KEY_LOAD), vbuf.index(at).load(VALUE_LOAD), ksbuf.index(at).load(ROW_LOAD),
            kzbuf.index(at).load(ROW_LOAD), vsbuf.index(at).load(ROW_LOAD), vzbuf.index(at).load(VALUE_ROW_LOAD))


@gluon.jit
def history_kernel(
        q_ptr, k_new_ptr, v_new_ptr, out_ptr, part_o_ptr, part_lse_ptr,
        slots_ptr, cu_ptr, len_ptr, bt_ptr, bt_stride, num_pages,
        kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
        sink_k_ptr, sink_v_ptr, ring_k_ptr, ring_v_ptr,
        qk_scale, window, shift_ptr, num_blocks, k_kappa, k_unit, v_kappa, v_unit,
        HQ: gl.constexpr, HKV: gl.constexpr, S: gl.constexpr, R: gl.constexpr, NUM_SPLITS: gl.constexpr,
        WS: gl.constexpr, OVERLAP: gl.constexpr = 0, KEY_SHIFTS: gl.constexpr = 0,
        SHIFT_BLOCK: gl.constexpr = 1, STAGES: gl.constexpr = 2, TERM_ROWS: gl.constexpr = 8):
    """History splits WS..NUM_SPLITS-1 of a decode step; grid (sequences x KV heads, NUM_SPLITS - WS), one warp.
    The arguments are those of `triton_attention._paged_attention_kernel` (the unused ones included, so that both
    take one argument tuple); OVERLAP and SHIFT_BLOCK as there. KEY_SHIFTS (key_centering "rope"): 0 none; 1
    shift_ptr holds the score terms q·shift of `triton_attention.score_shift_terms`, one per query row and block;
    2 shift_ptr holds the layer's key shifts, and each program computes the terms of its own blocks before its
    loop (`_program_terms`; a split must span at most TERM_ROWS blocks, `gluon_history.terms_in_programs`). The
    page's term is added to its scores through the maximum that the exponent subtracts. STAGES: shared-memory slots
    of staged pages (`gluon_history.STAGES`, at least 2)."""
    D: gl.constexpr = 128
    P: gl.constexpr = 64
    G: gl.constexpr = HQ // HKV
    PAGE_SPLITS: gl.constexpr = NUM_SPLITS - WS
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
    HEADS: gl.constexpr = gl.SliceLayout(0, MMA)

    if OVERLAP >= 1:
        _grid_dependency("griddepcontrol.launch_dependents;")
    pid = gl.program_id(0)
    split = gl.program_id(1)
    b = pid // HKV
    h = pid % HKV
    slot = gl.load(slots_ptr + b)
    old = gl.load(len_ptr + b)
    start = gl.load(cu_ptr + b)
    count = gl.load(cu_ptr + b + 1) - start
    end_new = S + P * (gl.maximum(old + count - S - R, 0) // P)  # `triton_write._history_end`
    hist_limit = gl.where(count > 0, gl.minimum(old, end_new), S)  # no new token: nothing to attend
    history_pages = (gl.maximum(hist_limit - S, 0) + P - 1) // P
    share = (history_pages + PAGE_SPLITS - 1) // PAGE_SPLITS
    lo = split * share
    hi = gl.minimum(lo + share, history_pages)

    nb = gl.arange(0, 8, layout=gl.SliceLayout(0, B))
    q_row_b = start.to(gl.int64) * HQ + h * G + nb
    ok_b = (nb < G) & (count > 0)
    qs0, g0 = _query_operand(q_ptr, q_row_b, ok_b, 0, D, B)
    qs1, g1 = _query_operand(q_ptr, q_row_b, ok_b, 1, D, B)
    qs2, g2 = _query_operand(q_ptr, q_row_b, ok_b, 2, D, B)
    qs3, g3 = _query_operand(q_ptr, q_row_b, ok_b, 3, D, B)
    qs4, g4 = _query_operand(q_ptr, q_row_b, ok_b, 4, D, B)
    qs5, g5 = _query_operand(q_ptr, q_row_b, ok_b, 5, D, B)
    qs6, g6 = _query_operand(q_ptr, q_row_b, ok_b, 6, D, B)
    qs7, g7 = _query_operand(q_ptr, q_row_b, ok_b, 7, D, B)
    # Σq/unit per head for the zero points, and the score units (`triton_attention._group_scores`)
    q_sum = gl.convert_layout((g0 + g1 + g2 + g3 + g4 + g5 + g6 + g7) / k_unit, HEADS)
    units = k_unit * qk_scale
    n = gl.arange(0, 8, layout=HEADS)
    row_ok = (n < G) & (count > 0)
    q_row = start.to(gl.int64) * HQ + h * G + n

    if KEY_SHIFTS == 1:  # the score terms of the heads' rows: [rows, blocks] (`triton_attention.score_shift_terms`)
        shift_row0 = (start.to(gl.int64) * HQ + h * G) * num_blocks
        shift_column = n * num_blocks
    kc16 = kc_ptr.to(gl.pointer_type(gl.int16))
    vc16 = vc_ptr.to(gl.pointer_type(gl.int16))

    m_run = gl.full([8], float("-inf"), gl.float32, HEADS)
    l_part = _fold_rows(gl.zeros([64, 8], gl.float32, MMA))  # Σp, folded per thread
    z_acc = gl.zeros([WORDS, 8], gl.float32, MMA)  # Σ weight·zero per head, the same in each of the 16 rows
    acc0 = gl.zeros([WORDS, 8], gl.float32, MMA)
    acc1 = gl.zeros([WORDS, 8], gl.float32, MMA)
    acc2 = gl.zeros([WORDS, 8], gl.float32, MMA)
    acc3 = gl.zeros([WORDS, 8], gl.float32, MMA)
    acc4 = gl.zeros([WORDS, 8], gl.float32, MMA)
    acc5 = gl.zeros([WORDS, 8], gl.float32, MMA)
    acc6 = gl.zeros([WORDS, 8], gl.float32, MMA)
    acc7 = gl.zeros([WORDS, 8], gl.float32, MMA)
    bt_row = bt_ptr + slot.to(gl.int64) * bt_stride
    # Software pipeline by hand (Gluon does not pipeline): page data copied into shared memory STAGES - 1 pages
    # ahead (cp.async, one commit group per page), page ids one page further.
    slots = _page_slots(STAGES)
    last = gl.maximum(hi - 1, 0)
    oks = 0  # bit j: whether the id of page index + j is valid
    for j in gl.static_range(STAGES - 1):
        ok = _stage_page(gl.load(bt_row + gl.minimum(lo + j, last)), num_pages, h, kc16, vc16, ks_ptr, kz_ptr,
                         vs_ptr, vz_ptr, slots, j, lo + j < hi, HKV, P)
        oks = oks | (ok.to(gl.int32) << j)
    ahead = gl.load(bt_row + gl.minimum(lo + STAGES - 1, last))
    if KEY_SHIFTS == 2:  # the terms of the split's blocks (row b - first_block), while the first pages are copied
        first_block = gl.minimum((S + lo * P) // SHIFT_BLOCK, num_blocks - 1)
        term_rows = _program_terms(q_ptr, start.to(gl.int64) * HQ + h * G, row_ok, shift_ptr, first_block,
                                   gl.minimum((S + (hi - 1) * P) // SHIFT_BLOCK, num_blocks - 1), h, qk_scale, HKV,
                                   D, TERM_ROWS)
    for index in range(lo, hi):
        i = index - lo
        async_copy.wait_group(STAGES - 2)  # this thread's copies of page index have landed
        _warp_barrier()  # everyone's have, and everyone is done with the slot refilled below
        ok = _stage_page(ahead, num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, slots,
                         (i + STAGES - 1) % STAGES, index + STAGES - 1 < hi, HKV, P)
        oks = oks | (ok.to(gl.int32) << (STAGES - 1))
        ahead = gl.load(bt_row + gl.minimum(index + STAGES, last))
        kwords, vwords, ks_raw, kz_raw, vs_raw, vz_raw = _staged_page(slots, i % STAGES)
        page_ok = (oks & 1) != 0
        oks = oks >> 1
        k_scale = gl.convert_layout(_page_rows(ks_raw), ROWS, assert_trivial=True).to(gl.float32)
        k_zero = gl.convert_layout(_page_rows(kz_raw), ROWS, assert_trivial=True).to(gl.float32)
        v_scale = gl.convert_layout(_page_rows(vs_raw), ROWS, assert_trivial=True).to(gl.float32)

        ka = gl.convert_layout(_key_tile(kwords), A, assert_trivial=True)
        kh = _high_bytes(ka)
        d = gl.zeros([64, 8], gl.float32, MMA)
        d = mma_v2(_slice_units(ka, kh, 0), qs0, d)
        d = mma_v2(_slice_units(ka, kh, 1), qs1, d)
        d = mma_v2(_slice_units(ka, kh, 2), qs2, d)
        d = mma_v2(_slice_units(ka, kh, 3), qs3, d)
        d = mma_v2(_slice_units(ka, kh, 4), qs4, d)
        d = mma_v2(_slice_units(ka, kh, 5), qs5, d)
        d = mma_v2(_slice_units(ka, kh, 6), qs6, d)
        d = mma_v2(_slice_units(ka, kh, 7), qs7, d)
        scores = k_scale[:, None] * (d - k_zero[:, None] * q_sum[None, :]) + gl.where(page_ok, 0.0, float("-inf"))
        m_page = gl.max(scores, 0) * units
        if KEY_SHIFTS != 0:  # `triton_attention._score_shift`: the term of the page's block (base-2 score units)
            block = gl.minimum((S + index * P) // SHIFT_BLOCK, num_blocks - 1)
            if KEY_SHIFTS == 1:
                shift = gl.load(shift_ptr + shift_row0 + shift_column + block, mask=row_ok, other=0.0)
            else:
                shift = term_rows.index(block - first_block).load(HEADS)
            m_page = m_page + shift
        m_new = gl.maximum(m_run, m_page)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        if KEY_SHIFTS != 0:  # exp2(scores·units + shift - m): the term joins the max subtracted, no work per element
            p = gl.exp2(scores * units - (m_safe - shift)[None, :])
        else:
            p = gl.exp2(scores * units - m_safe[None, :])
        if gl.max((m_new > m_run).to(gl.int32), 0) > 0:  # alpha is exactly 1 on the other heads
            alpha = gl.exp2(m_run - m_safe)
            alpha_part = gl.convert_layout(alpha, gl.SliceLayout(0, l_part.type.layout))
            l_part = l_part * alpha_part[None, :]
            z_acc = z_acc * alpha[None, :]
            acc0 = acc0 * alpha[None, :]
            acc1 = acc1 * alpha[None, :]
            acc2 = acc2 * alpha[None, :]
            acc3 = acc3 * alpha[None, :]
            acc4 = acc4 * alpha[None, :]
            acc5 = acc5 * alpha[None, :]
            acc6 = acc6 * alpha[None, :]
            acc7 = acc7 * alpha[None, :]
        m_run = m_new
        weight = (p * v_scale[:, None]).to(gl.float16)  # the value scales folded into the probabilities
        l_part = l_part + _fold_rows(p)
        wb = _weights_operand(weight, B)
        va = gl.convert_layout(_value_tile(vwords), A, assert_trivial=True)
        z_acc = mma_v2(_value_zero_operand(vz_raw, va, A), wb, z_acc)  # exact products, as in Triton
        vh = _high_bytes(va)
        acc0 = mma_v2(_slice_units(va, vh, 0), wb, acc0)
        acc1 = mma_v2(_slice_units(va, vh, 1), wb, acc1)
        acc2 = mma_v2(_slice_units(va, vh, 2), wb, acc2)
        acc3 = mma_v2(_slice_units(va, vh, 3), wb, acc3)
        acc4 = mma_v2(_slice_units(va, vh, 4), wb, acc4)
        acc5 = mma_v2(_slice_units(va, vh, 5), wb, acc5)
        acc6 = mma_v2(_slice_units(va, vh, 6), wb, acc6)
        acc7 = mma_v2(_slice_units(va, vh, 7), wb, acc7)
    async_copy.wait_group(0)

    l = gl.convert_layout(gl.sum(l_part, 0), HEADS)
    z = gl.max(z_acc, 0)
    l_safe = gl.where(l > 0, l, 1.0)
    part_row = q_row * NUM_SPLITS + WS + split
    gl.store(part_lse_ptr + part_row, gl.where(l > 0, m_run + gl.log2(l_safe), float("-inf")), mask=row_ok)
    _store_slice(acc0, z, l_safe, v_unit, part_o_ptr, part_row, row_ok, 0, D, MMA)
    _store_slice(acc1, z, l_safe, v_unit, part_o_ptr, part_row, row_ok, 1, D, MMA)
    _store_slice(acc2, z, l_safe, v_unit, part_o_ptr, part_row, row_ok, 2, D, MMA)
    _store_slice(acc3, z, l_safe, v_unit, part_o_ptr, part_row, row_ok, 3, D, MMA)
    _store_slice(acc4, z, l_safe, v_unit, part_o_ptr, part_row, row_ok, 4, D, MMA)
    _store_slice(acc5, z, l_safe, v_unit, part_o_ptr, part_row, row_ok, 5, D, MMA)
    _store_slice(acc6, z, l_safe, v_unit, part_o_ptr, part_row, row_ok, 6, D, MMA)
    _store_slice(acc7, z, l_safe, v_unit, part_o_ptr, part_row, row_ok, 7, D, MMA)
    if OVERLAP == 2:
        _grid_dependency("griddepcontrol.wait;")
