"""Developer tool: the Gluon decode history kernel (`oscarkv.kernels.gluon_history`) against the Triton one.

    TRITON_INTERPRET=0 PYTHONPATH=src python scripts/probe_gluon_history.py sass [terms|shifts] [STAGES]  # sm_90
    PYTHONPATH=src python scripts/probe_gluon_history.py gpu 1x131072,32x32768[:SPLITS] [triton,gluon,gluon@3,gluonH]
    ncu --kernel-name regex:"history_kernel|_paged_attention" ... python scripts/probe_gluon_history.py ncu 1x131072 \
        [triton,gluon]

`sass` compiles the kernel for sm_90 with the installed Triton (use 3.6 for the GPU machine's figures) and counts
the instructions of its page loop by opcode, registers and shared memory. `gpu` times one decode step
(`ops.attend_step`, best of three CUDA-graph timings, the variants alternating) with each history kernel, against
the torch reference; a trailing H drops the window launch (the history launch and the combine alone, a wrong
answer), a trailing S gives the layer random key shifts (key_centering "rope", the default of a centered artifact), SP
computes their score terms once outside the timed step (what their launch costs), ST in their own launch where the
history programs would compute them (`gluon_history.terms_in_programs`);
gluon@N stages pages through N shared-memory slots instead of `gluon_history.STAGES`, gluon~N caps its registers at
N (`gluon_history.register_cap`). `ncu` runs one step
with each variant, no graph, for Nsight Compute. `reads` times a kernel that stages the same history pages through
the same slots and splits and computes nothing, beside the step: the ceiling of the kernel's memory access pattern.

    PYTHONPATH=src python scripts/probe_gluon_history.py reads 1x131072,32x32768[:SPLITS] [reads@2,reads@3,gluon]"""
from __future__ import annotations

import sys


def sass_main(shifts: str = "", stages: str = "") -> None:
    import triton

    from count_history_instructions import count, disassemble, loop_spans
    from oscarkv.kernels.compile_check import compile_kernel, gluon_history_job
    from oscarkv.kernels.gluon_history import STAGES

    key_shifts = {"": 0, "terms": 1, "shifts": 2}[shifts]  # KEY_SHIFTS: none, the terms launch's, each program's
    fn, types, constexprs, options = gluon_history_job(90, key_shifts)  # as shipped, at the Qwen3 shapes
    kernel = compile_kernel(fn, types, dict(constexprs, STAGES=int(stages or STAGES)), 90, **options)
    sass, usage = disassemble(kernel.asm["cubin"])
    print(f"Triton {triton.__version__}: " + usage.strip().splitlines()[-1].strip())
    for first, last in loop_spans(sass)[1]:
        counts = count(sass[first:last + 1])
        print(f"loop, SASS lines {first}-{last}: {sum(counts.values())} instructions")
        print("  " + ", ".join(f"{op} {n}" for op, n in counts.most_common()))


def _step(case, splits: int, history: str, windows: bool = True, layer=None, terms_ready: bool = False,
          terms_launch: bool = False):
    """A decode step's function with the given history kernel; windows=False drops the window launch; layer: in place
    of case.layer (`_with_key_shifts`); terms_ready: the key shifts' score terms computed once, outside the step (a
    wrong answer for other queries; it shows what their launch costs); terms_launch: the terms from their own launch
    even where the history programs could compute them (`gluon_history.terms_in_programs`)."""
    import torch

    from oscarkv.kernels import triton_attention
    from oscarkv.kernels.ops import attend_step

    from oscarkv.kernels import gluon_history

    history, _, cap = history.partition("~")  # gluon~N: register cap N (with and without key shifts)
    history, _, stages = history.partition("@")  # gluon@N: N shared-memory slots of staged pages
    out = torch.zeros_like(case.q)
    batch = case.q.shape[0]
    workspace = (torch.empty(batch, 32, splits, 128, dtype=torch.float32, device=case.q.device),
                 torch.empty(batch, 32, splits, dtype=torch.float32, device=case.q.device))
    shipped = triton_attention._paged_attention_kernel
    default_stages = gluon_history.STAGES
    default_term_rows = gluon_history.TERM_ROWS
    default_caps = gluon_history.REGISTER_CAP, gluon_history.SHIFTS_REGISTER_CAP

    class _NoWindows:
        def __getitem__(self, grid):
            return lambda *args, **kw: None if kw.get("REGIONS") == 2 else shipped[grid](*args, **kw)

    shipped_terms = triton_attention.score_shift_terms
    ready = {}

    def terms_once(*args):
        if "terms" not in ready:
            ready["terms"] = shipped_terms(*args)
        return ready["terms"]

    def fn():
        if not windows:
            triton_attention._paged_attention_kernel = _NoWindows()
        if terms_ready:
            triton_attention.score_shift_terms = terms_once
        if terms_launch:
            gluon_history.TERM_ROWS = 0
        gluon_history.STAGES = int(stages or default_stages)
        if cap:
            gluon_history.REGISTER_CAP = gluon_history.SHIFTS_REGISTER_CAP = int(cap)
        try:
            attend_step(layer or case.layer, case.step, case.q, case.k_new, case.v_new, 128 ** -0.5, num_splits=splits,
                        out=out, workspace=workspace, validate=False, history=history)
        finally:
            triton_attention._paged_attention_kernel = shipped
            triton_attention.score_shift_terms = shipped_terms
            gluon_history.STAGES = default_stages
            gluon_history.TERM_ROWS = default_term_rows
            gluon_history.REGISTER_CAP, gluon_history.SHIFTS_REGISTER_CAP = default_caps

    return fn, out


def _with_key_shifts(layer, context: int):
    """The layer with key shifts (key_centering "rope", the default of a centered artifact; `PagedLayer.key_shifts`):
    `bench attention --key-shifts`'s, RoPE-turned random means over blocks of 1024 positions; the kernels then add
    each page's score term."""
    from oscarkv.benchmarks.attention import with_random_key_shifts

    return with_random_key_shifts(layer, context)


def gpu_main(shapes: str, variants: str = "triton,gluon") -> None:
    import torch

    from oscarkv.benchmarks.attention import _time_us, copy_bandwidth_gbs, decode_bytes, decode_case
    from oscarkv.kernels import gluon_history, reference
    from oscarkv.kernels.ops import choose_splits

    copy = copy_bandwidth_gbs(torch.device("cuda"))
    names = variants.split(",")
    for spec in shapes.split(","):
        shape, _, forced = spec.partition(":")
        batch, context = (int(x) for x in shape.split("x"))
        case = decode_case(batch, context)
        gluon = gluon_history.takes(case.layer, case.step, 32, 0, case.q.device)  # the plan of the shipped step
        splits = int(forced) if forced else choose_splits(case.layer, batch, 1, 32, context, case.q.device, gluon=gluon)
        shifted = _with_key_shifts(case.layer, context) if any("S" in name for name in names) else None
        refs = {key: reference.attention_reference(layer, case.step, case.q, case.k_new, case.v_new,
                                                   128 ** -0.5).float()
                for key, layer in (("plain", case.layer), ("shifted", shifted)) if layer is not None}
        steps, errors = {}, {}
        for name in names:  # suffixes: H drops the window launch, S adds key shifts, P computes their terms once,
            flags = name[len(name.rstrip("HSPT")):]  # T computes them in their own launch
            steps[name] = _step(case, splits, name.rstrip("HSPT"), windows="H" not in flags,
                                layer=shifted if "S" in flags else None, terms_ready="P" in flags,
                                terms_launch="T" in flags)
        for name, (fn, out) in steps.items():
            fn()
            torch.cuda.synchronize()
            errors[name] = (out.float() - refs["shifted" if "S" in name[len(name.rstrip("HSPT")):] else "plain"]
                            ).abs().max().item()
        times = {name: [] for name in names}
        for _ in range(3):
            for name in names:
                times[name].append(_time_us(steps[name][0]))
        nbytes = decode_bytes(case, context)
        line = f"{spec:>14} splits {splits:3d}:"
        for name in names:
            us = min(times[name])
            line += (f"  {name} {us:6.1f} us ({nbytes / us / 1e3 / copy:5.1%}, err {errors[name]:.1e}, "
                     f"{min(times[names[0]]) / us:.2f}x)")
        print(line + f"  [copy {copy:.0f} GB/s]", flush=True)
        case = steps = refs = shifted = None
        torch.cuda.empty_cache()


def _read_pages_kernel_fn():
    """A Gluon kernel that stages a decode step's history pages exactly as `history_kernel` does (same grid, splits,
    slots, copies and register layouts) and does no attention: the ceiling of its memory access pattern."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from oscarkv.kernels.gluon_history_kernel import (KEY_LOAD, ROW_LOAD, VALUE_LOAD, VALUE_ROW_LOAD, _page_slots,
                                                      _stage_page, _staged_page, _warp_barrier, async_copy)

    @gluon.jit
    def read_pages(slots_ptr, bt_ptr, bt_stride, num_pages, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, out_ptr,
                   history_pages, HKV: gl.constexpr, SPLITS: gl.constexpr, STAGES: gl.constexpr):
        pid = gl.program_id(0)
        split = gl.program_id(1)
        b = pid // HKV
        h = pid % HKV
        share = (history_pages + SPLITS - 1) // SPLITS
        lo = split * share
        hi = gl.minimum(lo + share, history_pages)
        bt_row = bt_ptr + gl.load(slots_ptr + b).to(gl.int64) * bt_stride
        kc16 = kc_ptr.to(gl.pointer_type(gl.int16))
        vc16 = vc_ptr.to(gl.pointer_type(gl.int16))
        slots = _page_slots(STAGES)
        last = gl.maximum(hi - 1, 0)
        for j in gl.static_range(STAGES - 1):
            _stage_page(gl.load(bt_row + gl.minimum(lo + j, last)), num_pages, h, kc16, vc16, ks_ptr, kz_ptr,
                        vs_ptr, vz_ptr, slots, j, lo + j < hi, HKV, 64)
        ahead = gl.load(bt_row + gl.minimum(lo + STAGES - 1, last))
        key_sum = gl.zeros([64, 16], gl.int16, KEY_LOAD)
        value_sum = gl.zeros([64, 16], gl.int16, VALUE_LOAD)
        row_sum = gl.zeros([64], gl.float16, ROW_LOAD)
        zero_sum = gl.zeros([64], gl.float16, VALUE_ROW_LOAD)  # the value zeros' load layout (`_staged_page`)
        for index in range(lo, hi):
            i = index - lo
            async_copy.wait_group(STAGES - 2)
            _warp_barrier()
            _stage_page(ahead, num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, slots,
                        (i + STAGES - 1) % STAGES, index + STAGES - 1 < hi, HKV, 64)
            ahead = gl.load(bt_row + gl.minimum(index + STAGES, last))
            kwords, vwords, ks, kz, vs, vz = _staged_page(slots, i % STAGES)
            key_sum = key_sum ^ kwords
            value_sum = value_sum ^ vwords
            row_sum = row_sum + ks + kz + vs
            zero_sum = zero_sum + vz
        async_copy.wait_group(0)
        total = (gl.sum(gl.sum(key_sum.to(gl.int32), 1), 0) + gl.sum(gl.sum(value_sum.to(gl.int32), 1), 0)
                 + gl.sum(row_sum.to(gl.float32), 0).to(gl.int32) + gl.sum(zero_sum.to(gl.float32), 0).to(gl.int32))
        gl.store(out_ptr + pid * SPLITS + split, total)

    return read_pages


def reads_main(shapes: str, variants: str = "reads@2,reads@3,reads@4,gluon") -> None:
    """The decode step with the Gluon kernel (gluon) against the page reads alone (reads@N: N slots), same splits."""
    import torch

    from oscarkv.benchmarks.attention import _time_us, copy_bandwidth_gbs, decode_case
    from oscarkv.kernels.ops import choose_splits, window_split_count

    read_pages = _read_pages_kernel_fn()
    copy = copy_bandwidth_gbs(torch.device("cuda"))
    for spec in shapes.split(","):
        shape, _, forced = spec.partition(":")
        batch, context = (int(x) for x in shape.split("x"))
        case = decode_case(batch, context)
        layer, lay = case.layer, case.layer.layout
        splits = int(forced) if forced else choose_splits(layer, batch, 1, 32, context, case.q.device)
        history_splits = splits - window_split_count(layer, batch, 1, 32, splits, context, case.q.device)
        pages = (lay.history_end(context) - lay.sink_tokens) // lay.page_size
        nbytes = batch * lay.kv_heads * pages * lay.page_size * lay.history_bytes_per_token()
        out = torch.zeros(batch * lay.kv_heads * history_splits, dtype=torch.int32, device=case.q.device)
        line = f"{spec:>14} splits {splits:3d} ({history_splits} history, {pages} pages):"
        for name in variants.split(","):
            if name.startswith("reads"):
                stages = int(name.partition("@")[2] or 2)

                def fn(stages=stages):
                    read_pages[(batch * lay.kv_heads, history_splits)](
                        case.step.slots, case.step.block_table, case.step.block_table.stride(0), layer.num_pages,
                        layer.k_codes, layer.k_scale, layer.k_zero, layer.v_codes, layer.v_scale, layer.v_zero, out,
                        pages, HKV=lay.kv_heads, SPLITS=history_splits, STAGES=stages, num_warps=1)
            else:
                fn = _step(case, splits, name)[0]
            fn()
            torch.cuda.synchronize()
            us = min(_time_us(fn) for _ in range(3))
            line += f"  {name} {us:6.1f} us ({nbytes / us / 1e3 / copy:5.1%})"
        print(line + f"  [history bytes {nbytes / 1e6:.1f} MB, copy {copy:.0f} GB/s]", flush=True)
        case = None
        torch.cuda.empty_cache()


def ncu_main(shape: str, variants: str = "triton,gluon") -> None:
    import torch

    from oscarkv.benchmarks.attention import decode_case
    from oscarkv.kernels.ops import choose_splits

    from oscarkv.kernels import gluon_history

    batch, context = (int(x) for x in shape.split("x"))
    case = decode_case(batch, context)
    gluon = gluon_history.takes(case.layer, case.step, 32, 0, case.q.device)  # the plan of the shipped step
    splits = choose_splits(case.layer, batch, 1, 32, context, case.q.device, gluon=gluon)
    for history in variants.split(","):  # a trailing S: random key shifts, as in `gpu`
        shifted = history.endswith("S")
        _step(case, splits, history.rstrip("S"), layer=_with_key_shifts(case.layer, context) if shifted else None)[0]()
    torch.cuda.synchronize()


if __name__ == "__main__":
    sys.path.insert(0, "scripts")
    {"sass": sass_main, "gpu": gpu_main, "ncu": ncu_main, "reads": reads_main}[sys.argv[1]](*sys.argv[2:])
