"""Developer tool (GPU): the Gluon decode history launch with pages handed out as programs ask for them, against the
shipped kernel's fixed splits.

    PYTHONPATH=src:scripts python scripts/probe_history_claims.py 32x32768,1x131072[:SPLITS] [--rounds 3] [--timeline]

The shipped programs of a (sequence, KV head) pair each read a fixed range of its pages, and at 32 x 32K they end
in four tiers, one per warp a scheduler holds (the oldest warp issues first; docs/kernels-log.md). In the variants built
here (copies of `gluon_history_kernel.history_kernel`, changed by text, loaded as modules of their own) each program
instead claims its pages one at a time from a counter of its pair, three pages ahead of the one it reads, so the
programs that run fastest read the most pages and every program of a pair ends within a few pages of the others:
- claimed: each claim a relaxed scalar atomic add (Gluon follows it at once by the shuffle that hands its result to
  every lane, so the warp waits for its round trip: 1.1-1.6x the shipped kernel's time on the H200; acquire-release
  atomics also put a memory barrier and an L1 invalidation beside each: 1.4-1.8x);
- deferred: each claim an atomic increment of lane 0 alone (inline PTX; an add there is aggregated over the warp by
  ptxas, with the same shuffle), whose result stays in that lane until the page id is needed, an iteration later;
- static: the same loop with the fixed split's pages and no atomics (what the loop's form costs).
Each program counts its end with an acquire-release add after its last claim, and the pair's last program to end
sets its counters back to zero. Partial results then depend on which program took which page, so outputs vary in
their last bits from run to run. Decode steps without key shifts only (no KEY_SHIFTS 2 path).

Prints, per shape, best of `rounds` alternating CUDA-graph timings of one decode step (`ops.attend_step`) with each
kernel, their max abs errors against the torch reference, whether the counters were zero after the runs and how far
two runs of deferred differ. --timeline instead prints, for static and deferred, when the history programs end, by
tier (one eager step after four; `probe_history_timeline`'s records).
"""

from __future__ import annotations

import argparse
import inspect

import torch

PROLOGUE = """    last = gl.maximum(hi - 1, 0)
    oks = 0  # bit j: whether the id of page index + j is valid
    for j in gl.static_range(STAGES - 1):
        ok = _stage_page(gl.load(bt_row + gl.minimum(lo + j, last)), num_pages, h, kc16, vc16, ks_ptr, kz_ptr,
                         vs_ptr, vz_ptr, slots, j, lo + j < hi, HKV, P)
        oks = oks | (ok.to(gl.int32) << j)
    ahead = gl.load(bt_row + gl.minimum(lo + STAGES - 1, last))
"""
CLAIMED_PROLOGUE = """    counter = claim_ptr + pid * 2  # [pages claimed, programs ended] of the pair
    last = gl.maximum(history_pages - 1, 0)
    cur = gl.atomic_add(counter, 1, sem="relaxed")
    nxt = gl.atomic_add(counter, 1, sem="relaxed")
    nn = gl.atomic_add(counter, 1, sem="relaxed")
    oks = _stage_page(gl.load(bt_row + gl.minimum(cur, last)), num_pages, h, kc16, vc16, ks_ptr, kz_ptr,
                      vs_ptr, vz_ptr, slots, 0, cur < history_pages, HKV, P).to(gl.int32)
    ahead = gl.load(bt_row + gl.minimum(nxt, last))
"""
LOOP_HEAD = """    for index in range(lo, hi):
        i = index - lo
        async_copy.wait_group(STAGES - 2)  # this thread's copies of page index have landed
        _warp_barrier()  # everyone's have, and everyone is done with the slot refilled below
        ok = _stage_page(ahead, num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, slots,
                         (i + STAGES - 1) % STAGES, index + STAGES - 1 < hi, HKV, P)
        oks = oks | (ok.to(gl.int32) << (STAGES - 1))
        ahead = gl.load(bt_row + gl.minimum(index + STAGES, last))
"""
CLAIMED_LOOP_HEAD = """    i = 0
    while cur < history_pages:
        index = cur
        async_copy.wait_group(0)
        _warp_barrier()
        more = nn < history_pages
        claimed = gl.atomic_add(counter, 1, mask=more, sem="relaxed")
        ok = _stage_page(ahead, num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, slots, (i + 1) % 2,
                         nxt < history_pages, HKV, P)
        oks = oks | (ok.to(gl.int32) << 1)
        ahead = gl.load(bt_row + gl.minimum(nn, last))
"""
LOOP_END = """        acc7 = mma_v2(_slice_units(va, vh, 7), wb, acc7)
    async_copy.wait_group(0)
"""
CLAIMED_LOOP_END = """        acc7 = mma_v2(_slice_units(va, vh, 7), wb, acc7)
        cur = nxt
        nxt = nn
        nn = gl.where(more, claimed, history_pages)
        i = i + 1
    async_copy.wait_group(0)
    ended = gl.atomic_add(counter + 1, 1)
    if ended == PAGE_SPLITS - 1:  # the pair's last program: every claim of the pair is made
        gl.atomic_xchg(counter, 0)
        gl.atomic_xchg(counter + 1, 0)
"""

# deferred: each claim is an atomic of lane 0 alone whose result stays in that lane until the page id is needed, an
# iteration later (a scalar atomic in Gluon is followed at once by the shuffle that hands its result to every lane,
# which waits for the atomic's round trip)
CLAIM_HELPER = """
@gluon.jit
def _claim(counter, go):
    \"\"\"counter += 1 by lane 0 where go, as [32] (one a lane; lane 0 holds the old value, the others 0).\"\"\"
    LANES: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout=LANES)
    pick = gl.where(go, lane, 1)
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.eq.s32 p, $2, 0; mov.u32 $0, 0; "
        "@p atom.global.relaxed.gpu.inc.u32 $0, [$1], 2147483647; }",
        "=r,l,r", [counter + 0 * lane, pick], dtype=gl.int32, is_pure=False, pack=1)

"""
DEFERRED_PROLOGUE = """    counter = claim_ptr + pid * 2  # [pages claimed, programs ended] of the pair
    last = gl.maximum(history_pages - 1, 0)
    cur = gl.atomic_add(counter, 1, sem="relaxed")
    nxt = gl.atomic_add(counter, 1, sem="relaxed")
    pending = _claim(counter, True)  # page 2
    pending_ok = True
    oks = _stage_page(gl.load(bt_row + gl.minimum(cur, last)), num_pages, h, kc16, vc16, ks_ptr, kz_ptr,
                      vs_ptr, vz_ptr, slots, 0, cur < history_pages, HKV, P).to(gl.int32)
    ahead = gl.load(bt_row + gl.minimum(nxt, last))
"""
DEFERRED_LOOP_HEAD = """    i = 0
    while cur < history_pages:
        index = cur
        async_copy.wait_group(0)
        _warp_barrier()
        nn = gl.where(pending_ok, gl.max(pending, 0), history_pages)  # page i + 2, claimed an iteration ago
        pending_ok = nn < history_pages
        pending = _claim(counter, pending_ok)  # page i + 3
        ok = _stage_page(ahead, num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, slots, (i + 1) % 2,
                         nxt < history_pages, HKV, P)
        oks = oks | (ok.to(gl.int32) << 1)
        ahead = gl.load(bt_row + gl.minimum(nn, last))
"""
DEFERRED_LOOP_END = """        acc7 = mma_v2(_slice_units(va, vh, 7), wb, acc7)
        cur = nxt
        nxt = nn
        i = i + 1
    async_copy.wait_group(0)
    ended = gl.atomic_add(counter + 1, 1)  # acquire-release: after this program's claims
    if ended == PAGE_SPLITS - 1:  # the pair's last program: every claim of the pair is made
        gl.atomic_xchg(counter, 0)
        gl.atomic_xchg(counter + 1, 0)
"""


def claimed_kernel(static: bool = False, deferred: bool = False, timer: bool = False):
    """The shipped kernel's source with claimed pages, loaded as a module of its own (Gluon compiles from source):
    scalar atomic claims ("claimed"), or deferred ones (`CLAIM_HELPER`); static: the same loop with the fixed split's
    pages in place of the claims (no atomics); timer: with `probe_history_timeline`'s records (pages: those read)."""
    from oscarkv.kernels import gluon_history_kernel

    source = inspect.getsource(gluon_history_kernel)
    head, _, body = source.partition("@gluon.jit\ndef history_kernel(")
    body = body.replace("):\n", ", claim_ptr=None):\n", 1)
    texts = ((DEFERRED_PROLOGUE, DEFERRED_LOOP_HEAD, DEFERRED_LOOP_END) if deferred
             else (CLAIMED_PROLOGUE, CLAIMED_LOOP_HEAD, CLAIMED_LOOP_END))
    for old, new in zip((PROLOGUE, LOOP_HEAD, LOOP_END), texts):
        assert body.count(old) == 1, old
        if static:
            new = (new.replace('gl.atomic_add(counter, 1, mask=more, sem="relaxed")', "gl.minimum(index + 3, hi)")
                   .replace("history_pages", "hi").replace("cur = gl.atomic_add(counter, 1, sem=\"relaxed\")",
                                                           "cur = lo").replace(
                       "nxt = gl.atomic_add(counter, 1, sem=\"relaxed\")", "nxt = gl.minimum(lo + 1, hi)").replace(
                       "nn = gl.atomic_add(counter, 1, sem=\"relaxed\")", "nn = gl.minimum(lo + 2, hi)"))
            new = new.split("    ended = ")[0]
        body = body.replace(old, new)
    from probe_history_timeline import TIMER, load_history_kernel, with_timer

    name = "static_history_kernel" if static else "deferred_history_kernel" if deferred else "claimed_history_kernel"
    if timer:
        name += "_timed"
        body = with_timer(body, "i")
    return load_history_kernel(name, head + (CLAIM_HELPER if deferred else "") + (TIMER if timer else "")
                               + "@gluon.jit\ndef history_kernel(" + body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="?", default="32x32768,32x8192,8x32768,1x131072,1x32768")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeline", action="store_true",
                        help="only when the programs of the static and deferred variants end, by tier")
    args = parser.parse_args()
    if args.timeline:
        return timeline_main(args.shapes)

    from oscarkv.benchmarks.attention import copy_bandwidth_gbs, decode_bytes, decode_case
    from oscarkv.kernels import gluon_history, gluon_history_kernel, reference
    from oscarkv.kernels.ops import attend_step, choose_splits

    from probe_history_timeline import alternating_times, step_errors

    claimed = claimed_kernel()
    static = claimed_kernel(static=True)
    deferred = claimed_kernel(deferred=True)
    shipped = gluon_history_kernel.history_kernel
    copy = copy_bandwidth_gbs(torch.device("cuda"))
    for spec in args.shapes.split(","):
        shape, _, forced = spec.partition(":")
        batch, context = (int(x) for x in shape.split("x"))
        case = decode_case(batch, context)
        device = case.q.device
        assert gluon_history.takes(case.layer, case.step, 32, 0, device)
        splits = int(forced) if forced else choose_splits(case.layer, batch, 1, 32, context, device, gluon=True)
        counters = torch.zeros(batch * 8 * 2, dtype=torch.int32, device=device)
        ref = reference.attention_reference(case.layer, case.step, case.q, case.k_new, case.v_new,
                                            128 ** -0.5).float()

        class Claimed:
            def __init__(self, kernel):
                self.kernel = kernel

            def __getitem__(self, grid):
                return lambda *a, **kw: self.kernel[grid](*a, claim_ptr=counters, **kw)

        steps = {}
        for name, kernel in (("shipped", shipped), ("static", Claimed(static)), ("claimed", Claimed(claimed)),
                             ("deferred", Claimed(deferred))):
            out = torch.zeros_like(case.q)
            workspace = (torch.empty(batch, 32, splits, 128, device=device),
                         torch.empty(batch, 32, splits, device=device))

            def fn(kernel=kernel, out=out, workspace=workspace):
                gluon_history_kernel.history_kernel = kernel
                try:
                    attend_step(case.layer, case.step, case.q, case.k_new, case.v_new, 128 ** -0.5,
                                num_splits=splits, out=out, workspace=workspace, validate=False, history="gluon")
                finally:
                    gluon_history_kernel.history_kernel = shipped

            steps[name] = (fn, out)
        errors = step_errors(steps, ref)
        first = steps["deferred"][1].clone()
        times = alternating_times(steps, args.rounds)
        torch.cuda.synchronize()
        spread = (steps["deferred"][1].float() - first.float()).abs().max().item()
        nbytes = decode_bytes(case, context)
        base = min(times["shipped"])
        line = f"{spec:>14} splits {splits:3d}:"
        for name in steps:
            us = min(times[name])
            line += (f"  {name} {us:6.1f} us ({nbytes / us / 1e3 / copy:5.1%}, err {errors[name]:.1e}, "
                     f"{base / us:.3f}x; rounds {' '.join(f'{t:.1f}' for t in times[name])})")
        print(line + f"  counters zero after: {bool((counters == 0).all())}; deferred run-to-run max diff "
              f"{spread:.1e}  [copy {copy:.0f} GB/s]", flush=True)
        case = steps = ref = None
        torch.cuda.empty_cache()


def timeline_main(shapes: str) -> None:
    """When each program of the static and deferred variants ends (one eager step after four), by tier: a program's
    rank among its multiprocessor's by linear index, // 4 (`probe_history_timeline`)."""
    from oscarkv.benchmarks.attention import decode_case
    from oscarkv.kernels import gluon_history_kernel
    from oscarkv.kernels.ops import attend_step, choose_splits

    from probe_history_timeline import tiers

    shipped = gluon_history_kernel.history_kernel
    kernels = {"static": claimed_kernel(static=True, timer=True), "deferred": claimed_kernel(deferred=True, timer=True)}
    for spec in shapes.split(","):
        shape, _, forced = spec.partition(":")
        batch, context = (int(x) for x in shape.split("x"))
        case = decode_case(batch, context)
        device = case.q.device
        splits = int(forced) if forced else choose_splits(case.layer, batch, 1, 32, context, device, gluon=True)
        counters = torch.zeros(batch * 8 * 2, dtype=torch.int32, device=device)
        records = torch.zeros(batch * 8 * splits, 4, dtype=torch.int64, device=device)
        out = torch.zeros_like(case.q)
        workspace = (torch.empty(batch, 32, splits, 128, device=device), torch.empty(batch, 32, splits, device=device))
        for name, kernel in kernels.items():
            class Timed:
                def __getitem__(self, grid, kernel=kernel):
                    return lambda *a, **kw: kernel[grid](*a, claim_ptr=counters, timer_ptr=records, **kw)

            gluon_history_kernel.history_kernel = Timed()
            try:
                for _ in range(5):
                    records.zero_()
                    attend_step(case.layer, case.step, case.q, case.k_new, case.v_new, 128 ** -0.5,
                                num_splits=splits, out=out, workspace=workspace, validate=False, history="gluon")
                torch.cuda.synchronize()
            finally:
                gluon_history_kernel.history_kernel = shipped
            used = records[:, 1] > 0
            linear = torch.nonzero(used).flatten().cpu()
            rec = records[used].cpu()
            t0 = rec[:, 0].min()
            end = (rec[:, 1] - t0).double() / 1e3
            tier = tiers(rec, linear)
            tiers = range(int(tier.max()) + 1)
            print(f"{spec} {name}: {len(rec)} programs, span {end.max().item():.1f} us, ends min / median "
                  f"{end.min().item():.1f} / {end.median().item():.1f}; pages per program "
                  f"{int(rec[:, 3].min())}-{int(rec[:, 3].max())}; by tier: mean end "
                  + " / ".join(f"{end[tier == t].mean().item():.1f}" for t in tiers) + " us, mean pages "
                  + " / ".join(f"{rec[tier == t, 3].double().mean().item():.1f}" for t in tiers), flush=True)
        case = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
