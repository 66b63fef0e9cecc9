"""Developer tool (GPU): the Gluon history kernel with two independent page streams in each warp, against the
shipped kernel, one decode layer per shape, alternating CUDA-graph rounds, with each variant's error against the
torch reference.

    PYTHONPATH=src:scripts python scripts/probe_dual_streams.py [1x131072,1x100000] [--splits 66,132] [--rounds 3]

Why: Nsight Compute's warp-state samples of the shipped kernel at 1x128K (docs/data/history-stalls-h200-s71.txt)
put 30% of a warp's cycles on issuing, 26% on waiting for the fixed latency of the instruction before, 10% on the
other warp of its scheduler being picked, 9% on a busy math pipe, 8% on shared-memory results and 7% on global
memory: the warps wait on their own chains more than on the memory. More warps per scheduler did not help (more
splits: more program starts and ends, more partial results to merge, and a scheduler's older warp finishing its
split 3-7 us before the younger one). Here each warp runs two online softmaxes over the two halves of its split, one
page of each per loop step, in one block of straight-line code, so the compiler can interleave two independent
chains in one warp; the streams are merged in registers at the end. Each step stages the next page of both streams
(4 slots, 18.4 KB of shared memory a program); the rescale of the accumulators is one branch for both streams.
Timed at the plan's split count (two warps a scheduler at batch 1) and at half of it (one warp a scheduler, the
same pages per stream as the shipped kernel's split). No key shifts (the random models' hadamard layers).
The variant is the shipped source changed by text (`dual_kernel`), loaded as a module of its own.
Found: correct and slower at every shape (1x128K 38.8 us with 66 history splits, 37.0 with 132, against 32.1;
docs/data/dual-streams-h200-s71.txt, docs/kernels-log.md "Where the warps wait, and two page streams a warp").
"""

from __future__ import annotations

import argparse
import inspect

LOOP_START = "    slots = _page_slots(STAGES)\n"
LOOP_END = "    async_copy.wait_group(0)\n"


def _slices(line: str) -> str:
    """`line` (with {s}) for the eight INT2 slices."""
    return "".join(line.format(s=s) for s in range(8))


DUAL_LOOP = ("""    gl.static_assert(KEY_SHIFTS == 0, "the dual-stream probe has no key shifts")
    # Stream a: pages lo .. mid - 1; stream b: mid .. hi - 1 (one fewer where the split is odd: its last step reads a
    # page again, masked). Slots 0, 1: stream a; 2, 3: stream b. One step: both streams' next pages staged.
    slots = _page_slots(4)
    steps = (hi - lo + 1) // 2
    mid = lo + steps
    last_a = gl.maximum(mid - 1, 0)
    last_b = gl.maximum(hi - 1, 0)
    ok_a = _stage_page(gl.load(bt_row + gl.minimum(lo, last_a)), num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr,
                       vz_ptr, slots, 0, steps > 0, HKV, P)
    ok_b = _stage_page(gl.load(bt_row + gl.minimum(mid, last_b)), num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr,
                       vz_ptr, slots, 2, steps > 0, HKV, P)
    ahead_a = gl.load(bt_row + gl.minimum(lo + 1, last_a))
    ahead_b = gl.load(bt_row + gl.minimum(mid + 1, last_b))
    mb_run = gl.full([8], float("-inf"), gl.float32, HEADS)
    lb_part = _fold_rows(gl.zeros([64, 8], gl.float32, MMA))
    zb_acc = gl.zeros([WORDS, 8], gl.float32, MMA)
""" + _slices("    bcc{s} = gl.zeros([WORDS, 8], gl.float32, MMA)\n") + """\
    for t in range(0, steps):
        async_copy.wait_group(0)  # this thread's copies of both streams' pages t have landed
        _warp_barrier()  # everyone's have, and everyone is done with the slots refilled below
        next_a = _stage_page(ahead_a, num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, slots, (t + 1) % 2,
                             t + 1 < steps, HKV, P)
        next_b = _stage_page(ahead_b, num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, slots,
                             2 + (t + 1) % 2, t + 1 < steps, HKV, P)
        ahead_a = gl.load(bt_row + gl.minimum(lo + t + 2, last_a))
        ahead_b = gl.load(bt_row + gl.minimum(mid + t + 2, last_b))
        kw_a, vw_a, ks_a, kz_a, vs_a, vz_a = _staged_page(slots, t % 2)
        kw_b, vw_b, ks_b, kz_b, vs_b, vz_b = _staged_page(slots, 2 + t % 2)
        page_ok_a = ok_a
        page_ok_b = ok_b & (mid + t < hi)
        ok_a = next_a
        ok_b = next_b
        ka = gl.convert_layout(_key_tile(kw_a), A, assert_trivial=True)
        kb = gl.convert_layout(_key_tile(kw_b), A, assert_trivial=True)
        kha = _high_bytes(ka)
        khb = _high_bytes(kb)
        da = gl.zeros([64, 8], gl.float32, MMA)
        db = gl.zeros([64, 8], gl.float32, MMA)
""" + _slices("        da = mma_v2(_slice_units(ka, kha, {s}), qs{s}, da)\n"
              "        db = mma_v2(_slice_units(kb, khb, {s}), qs{s}, db)\n") + """\
        sa = (gl.convert_layout(_page_rows(ks_a), ROWS, assert_trivial=True).to(gl.float32)[:, None]
              * (da - gl.convert_layout(_page_rows(kz_a), ROWS, assert_trivial=True).to(gl.float32)[:, None]
                 * q_sum[None, :]) + gl.where(page_ok_a, 0.0, float("-inf")))
        sb = (gl.convert_layout(_page_rows(ks_b), ROWS, assert_trivial=True).to(gl.float32)[:, None]
              * (db - gl.convert_layout(_page_rows(kz_b), ROWS, assert_trivial=True).to(gl.float32)[:, None]
                 * q_sum[None, :]) + gl.where(page_ok_b, 0.0, float("-inf")))
        ma_new = gl.maximum(m_run, gl.max(sa, 0) * units)
        mb_new = gl.maximum(mb_run, gl.max(sb, 0) * units)
        ma_safe = gl.where(ma_new == float("-inf"), 0.0, ma_new)
        mb_safe = gl.where(mb_new == float("-inf"), 0.0, mb_new)
        pa = gl.exp2(sa * units - ma_safe[None, :])
        pb = gl.exp2(sb * units - mb_safe[None, :])
        if gl.max((ma_new > m_run).to(gl.int32), 0) + gl.max((mb_new > mb_run).to(gl.int32), 0) > 0:
            alpha_a = gl.exp2(m_run - ma_safe)  # exactly 1 on the heads whose maximum did not grow
            alpha_b = gl.exp2(mb_run - mb_safe)
            l_part = l_part * gl.convert_layout(alpha_a, gl.SliceLayout(0, l_part.type.layout))[None, :]
            lb_part = lb_part * gl.convert_layout(alpha_b, gl.SliceLayout(0, lb_part.type.layout))[None, :]
            z_acc = z_acc * alpha_a[None, :]
            zb_acc = zb_acc * alpha_b[None, :]
""" + _slices("            acc{s} = acc{s} * alpha_a[None, :]\n"
              "            bcc{s} = bcc{s} * alpha_b[None, :]\n") + """\
        m_run = ma_new
        mb_run = mb_new
        l_part = l_part + _fold_rows(pa)
        lb_part = lb_part + _fold_rows(pb)
        wa = _weights_operand((pa * gl.convert_layout(_page_rows(vs_a), ROWS, assert_trivial=True)
                               .to(gl.float32)[:, None]).to(gl.float16), B)
        wb = _weights_operand((pb * gl.convert_layout(_page_rows(vs_b), ROWS, assert_trivial=True)
                               .to(gl.float32)[:, None]).to(gl.float16), B)
        va = gl.convert_layout(_value_tile(vw_a), A, assert_trivial=True)
        vb = gl.convert_layout(_value_tile(vw_b), A, assert_trivial=True)
        z_acc = mma_v2(_value_zero_operand(vz_a, va, A), wa, z_acc)
        zb_acc = mma_v2(_value_zero_operand(vz_b, vb, A), wb, zb_acc)
        vha = _high_bytes(va)
        vhb = _high_bytes(vb)
""" + _slices("        acc{s} = mma_v2(_slice_units(va, vha, {s}), wa, acc{s})\n"
              "        bcc{s} = mma_v2(_slice_units(vb, vhb, {s}), wb, bcc{s})\n") + """\
    async_copy.wait_group(0)
    # the two streams merged by their maxima, as the combine merges splits
    m_all = gl.maximum(m_run, mb_run)
    m_all_safe = gl.where(m_all == float("-inf"), 0.0, m_all)
    alpha_a = gl.exp2(m_run - m_all_safe)
    alpha_b = gl.exp2(mb_run - m_all_safe)
    l_part = (l_part * gl.convert_layout(alpha_a, gl.SliceLayout(0, l_part.type.layout))[None, :]
              + lb_part * gl.convert_layout(alpha_b, gl.SliceLayout(0, lb_part.type.layout))[None, :])
    z_acc = z_acc * alpha_a[None, :] + zb_acc * alpha_b[None, :]
""" + _slices("    acc{s} = acc{s} * alpha_a[None, :] + bcc{s} * alpha_b[None, :]\n") + """\
    m_run = m_all
""")


def dual_source() -> str:
    """The shipped kernel's module source with its page loop replaced by the two-stream loop."""
    from oscarkv.kernels import gluon_history_kernel

    source = inspect.getsource(gluon_history_kernel)
    head, rest = source.split(LOOP_START)
    _, tail = rest.split(LOOP_END)
    return head + DUAL_LOOP + tail


def dual_kernel():
    """The two-stream history kernel, loaded as a module of its own (Gluon compiles from a source file)."""
    from probe_history_timeline import load_history_kernel

    return load_history_kernel("dual_history_kernel", dual_source())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="?", default="1x131072,1x100000,1x32768")
    parser.add_argument("--splits", default="half,plan",
                        help="history splits of the dual variant: 'plan' (the shipped plan's), 'half' (half of its "
                             "history splits) or numbers")
    parser.add_argument("--cap", type=int, default=255, help="the dual variant's register cap")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from oscarkv.kernels import gluon_history, gluon_history_kernel
    from oscarkv.kernels.ops import choose_splits, window_plan
    from probe_score_chains import compare_shapes

    dual = dual_kernel()

    def variants(case, spec):
        batch, context = (int(x) for x in spec.split("x"))
        device = case.q.device
        plan = choose_splits(case.layer, batch, 1, 32, context, device, gluon=True)
        windows = window_plan(case.layer, batch, 1, 32, plan, context, device, gluon=True).splits
        kernels = {f"shipped @2, {plan - windows} history splits": (gluon_history_kernel.history_kernel,
                                                                   gluon_history.STAGES)}
        for choice in args.splits.split(","):
            history = {"plan": plan - windows, "half": (plan - windows) // 2}.get(choice) or int(choice)
            taken = history + windows - window_plan(case.layer, batch, 1, 32, history + windows, context, device,
                                                    gluon=True).splits
            kernels[f"dual, {taken} history splits"] = (dual, 2, history + windows, args.cap)
        return kernels

    compare_shapes(args.shapes, variants, args.rounds)


if __name__ == "__main__":
    main()
