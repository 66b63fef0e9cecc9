"""Developer tool (GPU): when each program of the Gluon decode history launch starts and ends, and on which
multiprocessor, for one decode step at each shape.

    PYTHONPATH=src:scripts python scripts/probe_history_timeline.py 1x131072,32x32768[:SPLITS] [--save DIR] \
        [--key-shifts]

It builds a copy of `gluon_history_kernel.history_kernel` whose programs also read the GPU's global timer and their
multiprocessor id at their start and end (four int64 stores per program, nothing else changed), runs the shipped step
(`ops.attend_step`, the plan `bench attention` takes, or SPLITS splits in all) with it eagerly after a warm-up, and
prints:
- the launch's span (first start to last end) and, as fractions of it, when the programs start and end;
- the programs' durations (min / median / max) and pages per program;
- the mean number of resident programs per multiprocessor over the span (what Nsight Compute calls achieved
  occupancy), and the span's part after the first multiprocessor has run out of programs (the tail);
- by tier (a program's rank among its multiprocessor's by linear index, over its four warp schedulers, whose
  oldest warp issues first: the programs end in these tiers), the mean end and pages.
--save writes the raw records (linear block index split·pairs + pair, sm, start and end in ns from the first start,
pages) as CSV. (The fifty-sixth session's CSVs in docs/data have columns program, split: index i = program·S + split
for S all splits, window splits included, while the record index was pair·(history splits) + split.)
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
import tempfile
from pathlib import Path

import torch

TIMER = '''
@gluon.jit
def _clock_and_sm():
    t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
    sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    return t, sm

'''


def with_timer(body: str, pages: str) -> str:
    """The text of `history_kernel`'s body (after "def history_kernel(") with a timer_ptr argument, into which each
    program stores its start and end (the GPU's global timer), its multiprocessor and `pages` (an expression of the
    kernel: the pages it read), at its block's linear index."""
    assert "):\n" in body  # the end of the signature
    body = body.replace("):\n", ", timer_ptr=None):\n", 1)
    start_marker = "    pid = gl.program_id(0)\n    split = gl.program_id(1)\n"
    assert start_marker in body
    body = body.replace(start_marker, start_marker + "    t_start, sm = _clock_and_sm()\n", 1)
    end_marker = "    if OVERLAP == 2:\n        _grid_dependency(\"griddepcontrol.wait;\")\n"
    assert body.endswith(end_marker)
    record = ("    t_end, _ = _clock_and_sm()\n"
              "    rec = timer_ptr + (split * gl.num_programs(0) + pid) * 4\n"  # the block's linear index
              "    gl.store(rec, t_start)\n    gl.store(rec + 1, t_end)\n"
              f"    gl.store(rec + 2, sm.to(gl.int64))\n    gl.store(rec + 3, ({pages}).to(gl.int64))\n")
    return body[:-len(end_marker)] + record + end_marker


def tiers(rec: torch.Tensor, linear: torch.Tensor) -> torch.Tensor:
    """Each program's tier: its rank among its multiprocessor's programs by linear index (rec[:, 2]: the
    multiprocessor), // 4 (the warp schedulers, whose oldest warp issues first)."""
    rank = torch.zeros(len(rec), dtype=torch.int64)
    for sm in range(int(rec[:, 2].max()) + 1):
        members = torch.nonzero(rec[:, 2] == sm).flatten()
        rank[members[torch.argsort(linear[members])]] = torch.arange(len(members))
    return rank // 4


def apply_edits(source: str, edits) -> str:
    """`source` with each (old, new) text of `edits` replaced, in turn; each old text must stand exactly once."""
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    return source


def load_history_kernel(name: str, source: str):
    """The `history_kernel` of `source` (a variant of `gluon_history_kernel`'s text), loaded as a module `name` of
    its own from a file: Gluon compiles a kernel from its source file, so a variant cannot be built in memory."""
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.history_kernel


def step_errors(steps: dict, ref: torch.Tensor) -> dict:
    """For steps {name: (fn, out)} of one layer: each output's max abs error against `ref` after one run."""
    errors = {}
    for name, (fn, out) in steps.items():
        fn()
        torch.cuda.synchronize()
        errors[name] = (out.float() - ref).abs().max().item()
    return errors


def alternating_times(steps: dict, rounds: int) -> dict:
    """Each step's CUDA-graph times over `rounds` rounds that take the steps {name: (fn, out)} in turn."""
    from oscarkv.benchmarks.attention import _time_us

    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, (fn, _) in steps.items():
            times[name].append(_time_us(fn))
    return times


def timed_kernel():
    """The shipped kernel's source with timer stores, loaded as a module of its own (Gluon compiles from source)."""
    from oscarkv.kernels import gluon_history_kernel

    source = inspect.getsource(gluon_history_kernel)
    head, _, body = source.partition("@gluon.jit\ndef history_kernel(")
    body = with_timer(body, "gl.maximum(hi - lo, 0)")
    return load_history_kernel("timed_history_kernel", head + TIMER + "@gluon.jit\ndef history_kernel(" + body)


def run_shape(batch: int, context: int, timed, save: Path | None, forced: int | None = None,
              key_shifts: bool = False) -> None:
    from oscarkv.benchmarks.attention import decode_case
    from oscarkv.kernels import gluon_history, gluon_history_kernel
    from oscarkv.kernels.ops import attend_step, choose_splits

    from probe_gluon_history import _with_key_shifts

    case = decode_case(batch, context)
    layer = _with_key_shifts(case.layer, context) if key_shifts else case.layer
    device = case.q.device
    assert gluon_history.takes(case.layer, case.step, 32, 0, device)
    splits = forced or choose_splits(case.layer, batch, 1, 32, context, device, gluon=True)
    out = torch.empty_like(case.q)
    workspace = (torch.empty(batch, 32, splits, 128, device=device), torch.empty(batch, 32, splits, device=device))
    records = torch.zeros(batch * 8 * splits, 4, dtype=torch.int64, device=device)
    shipped = gluon_history_kernel.history_kernel

    class Timed:
        def __getitem__(self, grid):
            return lambda *args, **kw: timed[grid](*args, timer_ptr=records, **kw)

    def step():
        attend_step(layer, case.step, case.q, case.k_new, case.v_new, 128 ** -0.5, num_splits=splits, out=out,
                    workspace=workspace, validate=False)

    gluon_history_kernel.history_kernel = Timed()
    try:
        for _ in range(5):
            records.zero_()
            step()
        torch.cuda.synchronize()
    finally:
        gluon_history_kernel.history_kernel = shipped
    linear = torch.nonzero(records[:, 1] > 0).flatten().cpu()  # the blocks' linear indices (the order they start)
    rec = records[records[:, 1] > 0].cpu()
    programs = rec.shape[0]
    t0 = rec[:, 0].min()
    start, end = (rec[:, 0] - t0).double(), (rec[:, 1] - t0).double()
    span = end.max().item()
    dur = end - start
    sms = int(rec[:, 2].max().item()) + 1
    # resident programs per multiprocessor over the span, and the tail after the first multiprocessor empties
    resident = dur.sum().item() / (sms * span)
    last_end = torch.zeros(sms, dtype=torch.float64).index_reduce_(0, rec[:, 2], end, "amax", include_self=False)
    used = torch.bincount(rec[:, 2], minlength=sms)
    tail = span - last_end[used > 0].min().item()

    def q(x, f):
        return torch.quantile(x, f).item()

    print(f"{batch}x{context}{' with key shifts' if key_shifts else ''}: {splits} splits, {programs} history programs "
          f"on {int((used > 0).sum())} of {sms} SMs "
          f"(per SM {used.min().item()}-{used.max().item()}), pages per program "
          f"{int(rec[:, 3].min())}-{int(rec[:, 3].max())}")
    print(f"  span {span / 1e3:.1f} us; starts at 0 / 50% / 100% of programs: {q(start, 0) / 1e3:.1f} / "
          f"{q(start, .5) / 1e3:.1f} / {start.max().item() / 1e3:.1f} us; ends 0 / 10% / 50% / 90% / 100%: "
          f"{end.min().item() / 1e3:.1f} / {q(end, .1) / 1e3:.1f} / {q(end, .5) / 1e3:.1f} / {q(end, .9) / 1e3:.1f} / "
          f"{span / 1e3:.1f} us")
    print(f"  durations min / median / max {dur.min().item() / 1e3:.1f} / {q(dur, .5) / 1e3:.1f} / "
          f"{dur.max().item() / 1e3:.1f} us; resident programs per SM over the span {resident:.2f}; "
          f"first SM empty at {(span - tail) / 1e3:.1f} us (tail {tail / 1e3:.1f} us, {tail / span:.0%})")
    tier = tiers(rec, linear)
    ends = [end[tier == t] for t in range(int(tier.max()) + 1)]
    print("  by tier (rank on its SM // 4): mean end " + " / ".join(f"{e.mean().item() / 1e3:.1f}" for e in ends)
          + " us, mean pages " + " / ".join(f"{rec[tier == t, 3].double().mean().item():.1f}" for t in range(len(ends))))
    if save is not None:
        save.mkdir(parents=True, exist_ok=True)
        path = save / f"history-timeline-{batch}x{context}-{splits}{'-shifts' if key_shifts else ''}.csv"
        with path.open("w") as f:
            f.write("linear,sm,start_ns,end_ns,pages\n")
            for i, (s, e, sm, pages) in zip(linear.tolist(), rec.tolist()):
                f.write(f"{i},{sm},{s - t0.item()},{e - t0.item()},{pages}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", default="1x131072,32x32768", nargs="?")
    parser.add_argument("--save", type=Path)
    parser.add_argument("--key-shifts", action="store_true", help="random key shifts (key_centering 'rope')")
    args = parser.parse_args()
    timed = timed_kernel()
    for spec in args.shapes.split(","):
        shape, _, forced = spec.partition(":")
        batch, context = (int(x) for x in shape.split("x"))
        run_shape(batch, context, timed, args.save, int(forced) if forced else None, args.key_shifts)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
