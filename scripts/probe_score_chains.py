"""Developer tool (GPU): variants of the Gluon decode history kernel against the shipped kernel (its score dots in
two or four independent chains, speculative exponents; with --bounds, --footprint or --reads the bounds below), one
decode attention layer per shape, in alternating rounds (CUDA graphs, best of the rounds), with each variant's error
against the torch reference.

--bounds: half the codes' unpacking, or none (wrong outputs), each with 2, 3 and 4 staged pages. --footprint: one
shared-memory slot more allocated than the pipeline uses. --reads: the kernel's own block-table loads, copies, waits
and shared-memory reads with no arithmetic (wrong outputs), with 2, 3, 4 and 6 slots. Findings: docs/kernels-log.md,
"What holds the history kernel: its copies, not its arithmetic".

    PYTHONPATH=src:scripts python scripts/probe_score_chains.py [1x131072,1x100000,32x32768] [--rounds 3]
        [--bounds | --footprint | --reads] [--splits N]

Why: a page's scores are eight tensor-core dots (one per INT2 slice of the key words) accumulated into one tile, so
each m16 tile of the scores is a chain of eight dependent mma instructions, on the critical path of every page
between the page's arrival and its softmax. A one-warp program alone on its scheduler takes up to about 1.2 µs a
page at 1x128K (66 history splits, docs/data/batch1-splits-h200-s69.txt), roughly a third of an instruction a cycle,
so a chain's latency, not a pipe, might set its pace: these variants shorten the chain. The variants (copies of
`gluon_history_kernel.history_kernel` changed by text, loaded as modules of their own) accumulate slices s and s + 4
(two chains) or s, s + 2, s + 4, s + 6 (four) into separate tiles and add them once a page: the same products, summed
in another order (float32), 16 or 48 adds more a page, 16 or 48 more registers a thread.

"speculative": the second wait on each page's chain is the running maximum: the page's exponentials, their float16
weights and the weights' transpose into the value dot's operand all wait for the maximum over the page's 64 rows
(shuffles across lanes). The variant computes them with the running maximum from before the page, in parallel with
that reduction, and computes them again, with the new maximum, only inside the branch that rescales the accumulators
when some head's maximum grew. Where no maximum grows the two are the same numbers, so the outputs are the shipped
kernel's bit for bit in that case, and the same arithmetic otherwise. "speculative + 2 chains" has both changes.
"""

from __future__ import annotations

import argparse
import inspect

import torch

SHIPPED = "".join(f"        d = mma_v2(_slice_units(ka, kh, {s}), qs{s}, d)\n" for s in range(8))
ZERO = "        d = gl.zeros([64, 8], gl.float32, MMA)\n"


def chained_source(chains: int) -> str:
    """The score dots of one page as `chains` interleaved chains (slices s with s % chains equal share one), summed."""
    names = ["d", "e", "f", "g"][:chains]
    text = "".join(f"        {n} = gl.zeros([64, 8], gl.float32, MMA)\n" for n in names)
    for s in range(8):
        n = names[s % chains]
        text += f"        {n} = mma_v2(_slice_units(ka, kh, {s}), qs{s}, {n})\n"
    if chains == 2:
        text += "        d = d + e\n"
    elif chains == 4:
        text += "        d = (d + e) + (f + g)\n"
    return text


EXPONENTS = """        m_new = gl.maximum(m_run, m_page)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        if KEY_SHIFTS != 0:  # exp2(scores·units + shift - m): the term joins the max subtracted, no work per element
            p = gl.exp2(scores * units - (m_safe - shift)[None, :])
        else:
            p = gl.exp2(scores * units - m_safe[None, :])
"""
SPECULATIVE_EXPONENTS = """        m_new = gl.maximum(m_run, m_page)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        m_old = gl.where(m_run == float("-inf"), 0.0, m_run)
        if KEY_SHIFTS != 0:
            p = gl.exp2(scores * units - (m_old - shift)[None, :])
        else:
            p = gl.exp2(scores * units - m_old[None, :])
        weight = (p * v_scale[:, None]).to(gl.float16)
        wb = _weights_operand(weight, B)
"""
RESCALE_END = """            acc7 = acc7 * alpha[None, :]
        m_run = m_new
        weight = (p * v_scale[:, None]).to(gl.float16)  # the value scales folded into the probabilities
        l_part = l_part + _fold_rows(p)
        wb = _weights_operand(weight, B)
"""
SPECULATIVE_RESCALE_END = """            acc7 = acc7 * alpha[None, :]
            if KEY_SHIFTS != 0:
                p = gl.exp2(scores * units - (m_safe - shift)[None, :])
            else:
                p = gl.exp2(scores * units - m_safe[None, :])
            weight = (p * v_scale[:, None]).to(gl.float16)
            wb = _weights_operand(weight, B)
        m_run = m_new
        l_part = l_part + _fold_rows(p)
"""


# The bound of the sixtieth session's ablation (docs/data/history-ablation-variant.patch): slices 4-7 of the keys and
# the values reuse the float16 operands of slices 0-3, so half the unpacking goes (wrong outputs: a bound only).
HALF_UNPACKING = [
    ("".join(f"        d = mma_v2(_slice_units(ka, kh, {s}), qs{s}, d)\n" for s in range(4, 8)),
     "".join(f"        d = mma_v2(_slice_units(ka, kh, {s - 4}), qs{s}, d)\n" for s in range(4, 8))),
    ("".join(f"        acc{s} = mma_v2(_slice_units(va, vh, {s}), wb, acc{s})\n" for s in range(4, 8)),
     "".join(f"        acc{s} = mma_v2(_slice_units(va, vh, {s - 4}), wb, acc{s})\n" for s in range(4, 8))),
]


# A stronger bound: no unpacking at all, every slice's operand the raw code words read as float16 (wrong outputs,
# NaN among them; only the time means anything).
NO_UNPACKING = [("    return _masked_units(w if s < 4 else high, 3 << (2 * (s % 4)))\n",
                 "    return w.to(gl.float16, bitcast=True)\n")]


def reads_only(source: str) -> str:
    """`source` with each page's work replaced by sums of its staged words and parameters (kept by the partial
    log-sum-exps they are added to): the kernel's own copies and staging with no arithmetic (wrong outputs)."""
    start = "        kwords, vwords, ks_raw, kz_raw, vs_raw, vz_raw = _staged_page(slots, i % STAGES)\n"
    end = "    async_copy.wait_group(0)\n"
    head, rest = source.split(start)
    _, tail = rest.split(end)
    body = (start + "        oks = oks >> 1\n"
            "        junk = junk + gl.sum(gl.sum(kwords.to(gl.int32), 1), 0)\n"
            "        junk = junk + gl.sum(gl.sum(vwords.to(gl.int32), 1), 0)\n"
            "        junk = junk + (gl.sum(ks_raw.to(gl.float32), 0) + gl.sum(kz_raw.to(gl.float32), 0)\n"
            "                       + gl.sum(vs_raw.to(gl.float32), 0)\n"
            "                       + gl.sum(vz_raw.to(gl.float32), 0)).to(gl.int32)\n")
    loop = "    for index in range(lo, hi):\n"
    assert head.count(loop) == 1
    head = head.replace(loop, "    junk = gl.program_id(0) * 0\n" + loop)
    store = "gl.where(l > 0, m_run + gl.log2(l_safe), float(\"-inf\"))"
    assert tail.count(store) == 1
    tail = tail.replace(store, f"{store} + junk.to(gl.float32)")
    return head + body + end + tail


# One shared-memory slot more than the pipeline uses (its footprint without its deeper staging).
SPARE_SLOT = [("    slots = _page_slots(STAGES)\n", "    slots = _page_slots(STAGES + 1)\n")]


def variant_kernel(chains: int, speculative: bool = False, half_unpacking: bool = False, no_unpacking: bool = False,
                   spare_slot: bool = False, reads: bool = False):
    """The shipped kernel's source with `chains` score chains and the other edits asked for (see above: speculative
    exponents, half or no unpacking, a spare slot, reads only), loaded as a module of its own (Gluon compiles from
    source)."""
    from oscarkv.kernels import gluon_history_kernel

    source = inspect.getsource(gluon_history_kernel)
    edits = [(ZERO + SHIPPED, chained_source(chains))]
    if speculative:
        edits += [(EXPONENTS, SPECULATIVE_EXPONENTS), (RESCALE_END, SPECULATIVE_RESCALE_END)]
    if half_unpacking:
        edits += HALF_UNPACKING
    if no_unpacking:
        edits += NO_UNPACKING
    if spare_slot:
        edits += SPARE_SLOT
    from probe_history_timeline import apply_edits, load_history_kernel

    source = apply_edits(source, edits)
    if reads:
        source = reads_only(source)

    return load_history_kernel(f"score_chains_{chains}{'_speculative' if speculative else ''}"
                               f"{'_half' if half_unpacking else ''}{'_raw' if no_unpacking else ''}"
                               f"{'_spare' if spare_slot else ''}{'_reads' if reads else ''}_history_kernel",
                               source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="?", default="1x131072,1x100000,1x32768,8x32768,32x32768")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--splits", type=int, default=0,
                        help="splits in all (history and window programs) instead of the plan's")
    parser.add_argument("--reads", action="store_true",
                        help="instead: the shipped kernel and its copies and staging alone (no arithmetic; wrong "
                             "outputs), with 2, 3, 4 and 6 staged pages")
    parser.add_argument("--footprint", action="store_true",
                        help="instead: the shipped kernel with 2 and 3 staged pages, each with one shared-memory "
                             "slot more allocated than it uses")
    parser.add_argument("--bounds", action="store_true",
                        help="instead: the shipped kernel and two ablations (half the unpacking, none: wrong "
                             "outputs, bounds), each with 2, 3 and 4 staged pages")
    args = parser.parse_args()

    from oscarkv.kernels import gluon_history, gluon_history_kernel

    shipped = gluon_history_kernel.history_kernel
    if args.bounds:
        bounds = (("shipped", shipped), ("half unpacking", variant_kernel(1, half_unpacking=True)),
                  ("no unpacking", variant_kernel(1, no_unpacking=True)))
        kernels = {f"{name} @{stages}": (kernel, stages) for name, kernel in bounds for stages in (2, 3, 4)}
    elif args.reads:
        reads = variant_kernel(1, reads=True)
        kernels = {"shipped @2": (shipped, 2), **{f"reads only @{stages}": (reads, stages) for stages in (2, 3, 4, 6)}}
    elif args.footprint:
        kernels = {"shipped @2": (shipped, 2), "a spare slot @2": (variant_kernel(1, spare_slot=True), 2),
                   "shipped @3": (shipped, 3), "a spare slot @3": (variant_kernel(1, spare_slot=True), 3)}
    else:
        kernels = {name: (kernel, gluon_history.STAGES) for name, kernel in (
            ("shipped", shipped), ("2 chains", variant_kernel(2)), ("4 chains", variant_kernel(4)),
            ("speculative", variant_kernel(1, speculative=True)),
            ("speculative + 2 chains", variant_kernel(2, speculative=True)))}
    compare_shapes(args.shapes, lambda case, spec: kernels, args.rounds, args.splits)


class WithKeywords:
    """A history kernel launched with some keyword arguments fixed (a variant of `compare_variants` is a kernel taken
    with `[grid]`)."""

    def __init__(self, kernel, **keywords):
        self.kernel, self.keywords = kernel, keywords

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel[grid](*args, **self.keywords, **kwargs)


def compare_shapes(shapes: str, variants_of, rounds: int, splits: int = 0) -> None:
    """`compare_variants` for each shape of `shapes` ("BxCONTEXT,..."), after a line with the GPU and its copy
    bandwidth."""
    from oscarkv.benchmarks.attention import copy_bandwidth_gbs

    copy = copy_bandwidth_gbs(torch.device("cuda"))
    print(torch.cuda.get_device_name(), f"copy bandwidth {copy:.0f} GB/s", flush=True)
    for spec in shapes.split(","):
        compare_variants(spec, variants_of, rounds, copy, splits)


def compare_variants(spec: str, variants_of, rounds: int, copy: float, splits: int = 0) -> None:
    """One decode layer of shape spec ("BxCONTEXT") through `ops.attend_step` with each history kernel of
    variants_of(case, spec) ({name: (kernel, staged pages[, splits[, register cap]])}, the first the baseline), in
    alternating CUDA-graph rounds; prints each one's best time, share of the copy bandwidth `copy`, error against the
    torch reference and speed-up over the first. splits: splits in all (0: the plan's), for the variants that do not
    name their own; a variant's register cap replaces `gluon_history.REGISTER_CAP` while it runs."""
    from oscarkv.benchmarks.attention import decode_bytes, decode_case
    from oscarkv.kernels import gluon_history, gluon_history_kernel, reference
    from oscarkv.kernels.ops import attend_step, choose_splits

    from probe_history_timeline import alternating_times, step_errors

    shipped, default_stages, default_cap = (gluon_history_kernel.history_kernel, gluon_history.STAGES,
                                            gluon_history.REGISTER_CAP)
    batch, context = (int(x) for x in spec.split("x"))
    case = decode_case(batch, context)
    device = case.q.device
    assert gluon_history.takes(case.layer, case.step, 32, 0, device)
    splits = splits or choose_splits(case.layer, batch, 1, 32, context, device, gluon=True)
    ref = reference.attention_reference(case.layer, case.step, case.q, case.k_new, case.v_new, 128 ** -0.5).float()
    steps, own_splits = {}, {}
    for name, variant in variants_of(case, spec).items():
        kernel, stages, n, cap = (*variant, 0, 0)[:4]
        n = own_splits[name] = n or splits
        out = torch.zeros_like(case.q)
        workspace = (torch.empty(batch, 32, n, 128, device=device), torch.empty(batch, 32, n, device=device))

        def fn(kernel=kernel, stages=stages, n=n, cap=cap or default_cap, out=out, workspace=workspace):
            gluon_history_kernel.history_kernel, gluon_history.STAGES = kernel, stages
            gluon_history.REGISTER_CAP = cap
            try:
                attend_step(case.layer, case.step, case.q, case.k_new, case.v_new, 128 ** -0.5, num_splits=n,
                            out=out, workspace=workspace, validate=False, history="gluon")
            finally:
                gluon_history_kernel.history_kernel, gluon_history.STAGES = shipped, default_stages
                gluon_history.REGISTER_CAP = default_cap

        steps[name] = (fn, out)
    errors, times = step_errors(steps, ref), alternating_times(steps, rounds)
    nbytes = decode_bytes(case, context)
    base = min(times[next(iter(times))])
    for name in steps:
        us = min(times[name])
        print(f"{spec:>10} splits {own_splits[name]:3d}  {name:<28} {us:6.1f} us ({nbytes / us / 1e3 / copy:5.1%}, "
              f"err {errors[name]:.1e}, {base / us:.3f}x; rounds {' '.join(f'{t:.1f}' for t in times[name])})",
              flush=True)
    torch.cuda.empty_cache()


def variant_main(doc: str, variants) -> None:
    """The command line of a probe of history-kernel variants: the shipped kernel against variants() ({name: (kernel,
    staged pages[, splits[, register cap]])}, as `compare_variants` takes them) over the shapes, or with --once each
    distinct kernel's decode step once, eagerly, for a profiler."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("shapes", nargs="?", default="1x131072,1x100000,8x32768,32x32768")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--once", action="store_true",
                        help="instead: the shipped and each variant kernel's decode step once, eagerly (for a "
                             "profiler such as Nsight Compute), at the first shape")
    args = parser.parse_args()

    from oscarkv.kernels import gluon_history, gluon_history_kernel

    shipped = gluon_history_kernel.history_kernel
    kernels = {"shipped": (shipped, gluon_history.STAGES), **variants()}
    if args.once:
        distinct = list(dict.fromkeys(variant[0] for variant in kernels.values()))
        run_once(args.shapes.split(",")[0], distinct)
        return
    compare_shapes(args.shapes, lambda case, spec: kernels, args.rounds)


def run_once(spec: str, kernels: list) -> None:
    """One decode layer of shape spec through `ops.attend_step` once with each history kernel, eagerly."""
    from oscarkv.benchmarks.attention import decode_case
    from oscarkv.kernels import gluon_history_kernel
    from oscarkv.kernels.ops import attend_step, choose_splits

    shipped = gluon_history_kernel.history_kernel
    batch, context = (int(x) for x in spec.split("x"))
    case = decode_case(batch, context)
    splits = choose_splits(case.layer, batch, 1, 32, context, case.q.device, gluon=True)
    out = torch.zeros_like(case.q)
    for kernel in kernels:
        gluon_history_kernel.history_kernel = kernel
        try:
            attend_step(case.layer, case.step, case.q, case.k_new, case.v_new, 128 ** -0.5, num_splits=splits,
                        out=out, validate=False, history="gluon")
            torch.cuda.synchronize()
        finally:
            gluon_history_kernel.history_kernel = shipped


if __name__ == "__main__":
    main()
