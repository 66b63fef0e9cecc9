"""A variant of the Gluon history kernel (`oscarkv.kernels.gluon_history_kernel`) for `probe_token_tiles.py`: each
one-warp program reads a fixed slice of T tokens (T = 64 / QUARTERS) of every page of its split, instead of whole
pages, so that QUARTERS programs share each page range and each program's chain of work per page is shorter.

Program (sequence x KV head, split): page split split // QUARTERS, token slice split % QUARTERS. Its partial output
and log-sum-exp go to split index WS + split, as the shipped kernel's, so the window launch and the combine merge
them unchanged (NUM_SPLITS = WS + QUARTERS x page splits). Same arithmetic as the shipped kernel (the raw-code dots
on the eight INT2 slices of the int16 words, the zero terms, the online softmax in base 2); only the tiles are
[T tokens, 16 words] and the layouts are left to the compiler where the shipped kernel relabels by hand. No key
shifts, uniform levels, D = 128, pages of 64 tokens (the scope of `gluon_history.takes` without key shifts).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from oscarkv.kernels.gluon_history_kernel import _async_load, _high_bytes, _slice_units, _warp_barrier

WORDS: gl.constexpr = gl.constexpr(16)


@gluon.jit
def _query_slice(q_ptr, q_row, head_ok, s: gl.constexpr, D: gl.constexpr, B: gl.constexpr):
    """Slice s of the queries as the B operand [16 words, 8 heads] (word k holds channel 2k + parity + offset),
    divided by the slice's multiplier, and the slice's sum of q per head (as `gluon_history_kernel._query_operand`)."""
    offset = (s % 4) * (D // 4)
    parity = s // 4
    mult = 4 ** (s % 4)
    k = gl.arange(0, WORDS, layout=gl.SliceLayout(1, B))
    q = gl.load(q_ptr + q_row[None, :] * D + (2 * k + parity + offset)[:, None], mask=head_ok[None, :], other=0.0)
    q = (q.to(gl.float32) * (1.0 / mult)).to(gl.float16)
    return q, gl.sum(q.to(gl.float32), 0) * mult


@gluon.jit
def _weights_operand(w, B: gl.constexpr, T: gl.constexpr):
    """float16 weights [T tokens, 8 heads] in the accumulator layout as the value dot's B operand (k = token): a
    movmatrix transpose of each 8x8 block, relabelled (as `gluon_history_kernel._weights_operand`)."""
    t = gl.inline_asm_elementwise("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r", [w],
                                  dtype=gl.float16, is_pure=True, pack=2)
    t = gl.reshape(gl.permute(gl.reshape(t, [T // 8, 8, 8]), [0, 2, 1]), [T, 8])
    return gl.convert_layout(t, B)


@gluon.jit
def _store_slice(acc, z, l_safe, v_unit, part_o_ptr, part_row, row_ok, s: gl.constexpr, D: gl.constexpr,
                 MMA: gl.constexpr):
    """Slice s of the normalised partial output from acc [16 words, 8 heads]."""
    offset = (s % 4) * (D // 4)
    parity = s // 4
    mult = 4 ** (s % 4)
    m = gl.arange(0, WORDS, layout=gl.SliceLayout(1, MMA))
    o = (acc * (v_unit / mult) - z[None, :]) / l_safe[None, :]
    gl.store(part_o_ptr + part_row[None, :] * D + (2 * m + parity + offset)[:, None], o, mask=row_ok[None, :])


@gluon.jit
def _stage_page(page, num_pages, h, quarter, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, slots, stage, live,
                HKV: gl.constexpr, P: gl.constexpr, T: gl.constexpr, COPY: gl.constexpr, ROW: gl.constexpr):
    """Start copying the program's T tokens of one page (codes, scales, zeros) into slot `stage`, one commit group;
    returns whether the page id is valid."""
    kbuf, vbuf, ksbuf, kzbuf, vsbuf, vzbuf = slots
    rows = gl.arange(0, T, layout=gl.SliceLayout(1, COPY))
    words = gl.arange(0, WORDS, layout=gl.SliceLayout(0, COPY))
    at = gl.arange(0, T, layout=ROW)
    page_ok = (page >= 0) & (page < num_pages)
    row0 = (gl.where(page_ok, page, 0).to(gl.int64) * HKV + h) * P + quarter * T
    codes = (row0 + rows)[:, None] * WORDS + words[None, :]
    _async_load(kbuf.index(stage), kc16 + codes, mask=live)
    _async_load(vbuf.index(stage), vc16 + codes, mask=live)
    _async_load(ksbuf.index(stage), ks_ptr + row0 + at, mask=live)
    _async_load(kzbuf.index(stage), kz_ptr + row0 + at, mask=live)
    _async_load(vsbuf.index(stage), vs_ptr + row0 + at, mask=live)
    _async_load(vzbuf.index(stage), vz_ptr + row0 + at, mask=live)
    async_copy.commit_group()
    return page_ok


@gluon.jit
def history_kernel(
        q_ptr, k_new_ptr, v_new_ptr, out_ptr, part_o_ptr, part_lse_ptr,
        slots_ptr, cu_ptr, len_ptr, bt_ptr, bt_stride, num_pages,
        kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
        sink_k_ptr, sink_v_ptr, ring_k_ptr, ring_v_ptr,
        qk_scale, window, shift_ptr, num_blocks, k_kappa, k_unit, v_kappa, v_unit,
        HQ: gl.constexpr, HKV: gl.constexpr, S: gl.constexpr, R: gl.constexpr, NUM_SPLITS: gl.constexpr,
        WS: gl.constexpr, OVERLAP: gl.constexpr = 0, KEY_SHIFTS: gl.constexpr = 0,
        SHIFT_BLOCK: gl.constexpr = 1, STAGES: gl.constexpr = 2, TERM_ROWS: gl.constexpr = 8,
        QUARTERS: gl.constexpr = 4):
    """History splits WS..NUM_SPLITS-1 of a decode step, T = 64 / QUARTERS tokens of each page per program; grid
    (sequences x KV heads, NUM_SPLITS - WS), one warp. Arguments as `gluon_history_kernel.history_kernel` (key
    shifts are not supported: KEY_SHIFTS must be 0)."""
    D: gl.constexpr = 128
    P: gl.constexpr = 64
    T: gl.constexpr = P // QUARTERS
    G: gl.constexpr = HQ // HKV
    PAGE_SPLITS: gl.constexpr = (NUM_SPLITS - WS) // QUARTERS
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
    HEADS: gl.constexpr = gl.SliceLayout(0, MMA)
    COPY: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [1, 1], [1, 0])
    ROW: gl.constexpr = gl.BlockedLayout([T // 8], [32], [1], [0])
    SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    ROW_SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    gl.static_assert(KEY_SHIFTS == 0)

    if OVERLAP >= 1:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    pid = gl.program_id(0)
    split = gl.program_id(1)
    page_split = split // QUARTERS
    quarter = split % QUARTERS
    b = pid // HKV
    h = pid % HKV
    slot = gl.load(slots_ptr + b)
    old = gl.load(len_ptr + b)
    start = gl.load(cu_ptr + b)
    count = gl.load(cu_ptr + b + 1) - start
    end_new = S + P * (gl.maximum(old + count - S - R, 0) // P)  # `triton_write._history_end`
    hist_limit = gl.where(count > 0, gl.minimum(old, end_new), S)
    history_pages = (gl.maximum(hist_limit - S, 0) + P - 1) // P
    share = (history_pages + PAGE_SPLITS - 1) // PAGE_SPLITS
    lo = page_split * share
    hi = gl.where(page_split < PAGE_SPLITS, gl.minimum(lo + share, history_pages), 0)

    nb = gl.arange(0, 8, layout=gl.SliceLayout(0, B))
    q_row_b = start.to(gl.int64) * HQ + h * G + nb
    ok_b = (nb < G) & (count > 0)
    qs0, g0 = _query_slice(q_ptr, q_row_b, ok_b, 0, D, B)
    qs1, g1 = _query_slice(q_ptr, q_row_b, ok_b, 1, D, B)
    qs2, g2 = _query_slice(q_ptr, q_row_b, ok_b, 2, D, B)
    qs3, g3 = _query_slice(q_ptr, q_row_b, ok_b, 3, D, B)
    qs4, g4 = _query_slice(q_ptr, q_row_b, ok_b, 4, D, B)
    qs5, g5 = _query_slice(q_ptr, q_row_b, ok_b, 5, D, B)
    qs6, g6 = _query_slice(q_ptr, q_row_b, ok_b, 6, D, B)
    qs7, g7 = _query_slice(q_ptr, q_row_b, ok_b, 7, D, B)
    q_sum = gl.convert_layout((g0 + g1 + g2 + g3 + g4 + g5 + g6 + g7) / k_unit, HEADS)
    units = k_unit * qk_scale
    n = gl.arange(0, 8, layout=HEADS)
    row_ok = (n < G) & (count > 0)
    q_row = start.to(gl.int64) * HQ + h * G + n
    kc16 = kc_ptr.to(gl.pointer_type(gl.int16))
    vc16 = vc_ptr.to(gl.pointer_type(gl.int16))

    m_run = gl.full([8], float("-inf"), gl.float32, HEADS)
    l_acc = gl.zeros([8], gl.float32, HEADS)
    z_acc = gl.zeros([WORDS, 8], gl.float32, MMA)
    acc0 = gl.zeros([WORDS, 8], gl.float32, MMA)
    acc1 = gl.zeros([WORDS, 8], gl.float32, MMA)
    acc2 = gl.zeros([WORDS, 8], gl.float32, MMA)
    acc3 = gl.zeros([WORDS, 8], gl.float32, MMA)
    acc4 = gl.zeros([WORDS, 8], gl.float32, MMA)
    acc5 = gl.zeros([WORDS, 8], gl.float32, MMA)
    acc6 = gl.zeros([WORDS, 8], gl.float32, MMA)
    acc7 = gl.zeros([WORDS, 8], gl.float32, MMA)
    bt_row = bt_ptr + slot.to(gl.int64) * bt_stride
    slots = (gl.allocate_shared_memory(gl.int16, [STAGES, T, WORDS], SMEM),
             gl.allocate_shared_memory(gl.int16, [STAGES, T, WORDS], SMEM),
             gl.allocate_shared_memory(gl.float16, [STAGES, T], ROW_SMEM),
             gl.allocate_shared_memory(gl.float16, [STAGES, T], ROW_SMEM),
             gl.allocate_shared_memory(gl.float16, [STAGES, T], ROW_SMEM),
             gl.allocate_shared_memory(gl.float16, [STAGES, T], ROW_SMEM))
    kbuf, vbuf, ksbuf, kzbuf, vsbuf, vzbuf = slots
    last = gl.maximum(hi - 1, 0)
    oks = 0
    for j in gl.static_range(STAGES - 1):
        ok = _stage_page(gl.load(bt_row + gl.minimum(lo + j, last)), num_pages, h, quarter, kc16, vc16, ks_ptr,
                         kz_ptr, vs_ptr, vz_ptr, slots, j, lo + j < hi, HKV, P, T, COPY, ROW)
        oks = oks | (ok.to(gl.int32) << j)
    ahead = gl.load(bt_row + gl.minimum(lo + STAGES - 1, last))
    for index in range(lo, hi):
        i = index - lo
        async_copy.wait_group(STAGES - 2)
        _warp_barrier()
        ok = _stage_page(ahead, num_pages, h, quarter, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, slots,
                         (i + STAGES - 1) % STAGES, index + STAGES - 1 < hi, HKV, P, T, COPY, ROW)
        oks = oks | (ok.to(gl.int32) << (STAGES - 1))
        ahead = gl.load(bt_row + gl.minimum(index + STAGES, last))
        at = i % STAGES
        page_ok = (oks & 1) != 0
        oks = oks >> 1
        ka = kbuf.index(at).load(A)
        va = vbuf.index(at).permute([1, 0]).load(A)
        k_scale = ksbuf.index(at).load(ROWS).to(gl.float32)
        k_zero = kzbuf.index(at).load(ROWS).to(gl.float32)
        v_scale = vsbuf.index(at).load(ROWS).to(gl.float32)
        v_zero = vzbuf.index(at).load(gl.SliceLayout(0, A))

        kh = _high_bytes(ka)
        d = gl.zeros([T, 8], gl.float32, MMA)
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
        m_new = gl.maximum(m_run, m_page)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(scores * units - m_safe[None, :])
        if gl.max((m_new > m_run).to(gl.int32), 0) > 0:
            alpha = gl.exp2(m_run - m_safe)
            l_acc = l_acc * alpha
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
        weight = (p * v_scale[:, None]).to(gl.float16)
        l_acc = l_acc + gl.sum(p, 0)
        wb = _weights_operand(weight, B, T)
        zero_rows = gl.broadcast(gl.expand_dims(v_zero, 0), va)[0]
        z_acc = mma_v2(zero_rows, wb, z_acc)
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

    l = l_acc
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
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)
