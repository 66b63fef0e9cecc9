"""Developer tool (GPU, Hopper, Triton >= 3.6): how fast one-warp programs read a decode step's INT2 history pages
into shared memory through the TMA (bulk tensor copies completed on an mbarrier), against the same pages read by
plain vector loads (`probe_page_layout._read_history`, the decode plan and two pages a loop step).

    PYTHONPATH=src:scripts python scripts/probe_tma_reads.py [--shapes 1x131072,1x100000] [--stages 2,3,4]
        [--kernel] [--rounds 3]

--kernel: the Gluon history kernel itself with its pages staged this way (`tma_history_kernel`, built from the
shipped kernel's source), in the decode step, against the shipped kernel, with errors against the torch reference.
Found: correct and slower (1x128K 35.0 us against 32.1; docs/data/tma-kernel-h200-s70.txt).

Why: the Gluon history kernel's own copies (per-thread 16-byte cp.async, one commit group, a wait and a warp barrier
a page), with every page's arithmetic removed, take 91-100% of its time at batch 1, and more staged pages read more
slowly, while plain vector loads of the same pages with the same plan read faster
(docs/data/history-reads-h200-s69.txt).
Here each page is six TMA copies issued by one thread (key codes and value codes, 64 rows of 32 bytes each; the four
128-byte rows of scales and zeros), completed on the page's mbarrier; the program waits on the barrier, reads the
slot back from shared memory and sums it (so that the copies must land), with STAGES slots in flight. Same programs
(132 history splits per KV head at batch 1, one warp each), same pages, same bytes. Reads only: no attention.
"""

from __future__ import annotations

import argparse

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from oscarkv.benchmarks.attention import copy_bandwidth_gbs, decode_case
from oscarkv.kernels.ops import choose_splits, window_plan

# Gluon's names moved between releases (3.6: async_copy_global_to_shared, thread_barrier; 3.9: async_load, barrier)
_copy = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_warp_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _copy_page(descs, bufs, bars, slot, block, live):
    """Page `block` (page id · HKV + KV head) into slot `slot` of bufs by six TMA copies on the slot's mbarrier
    (none where not `live`): key and value codes (64 rows of 32 bytes), then the four parameter rows."""
    kd, vd, ksd, kzd, vsd, vzd = descs
    kbuf, vbuf, ksbuf, kzbuf, vsbuf, vzbuf = bufs
    bar = bars.index(slot)
    mbarrier.expect(bar, 2 * 64 * 32 + 4 * 64 * 2, pred=live)
    _copy(kd, [block * 64, 0], bar, kbuf.index(slot), pred=live)
    _copy(vd, [block * 64, 0], bar, vbuf.index(slot), pred=live)
    _copy(ksd, [block, 0], bar, ksbuf.index(slot), pred=live)
    _copy(kzd, [block, 0], bar, kzbuf.index(slot), pred=live)
    _copy(vsd, [block, 0], bar, vsbuf.index(slot), pred=live)
    _copy(vzd, [block, 0], bar, vzbuf.index(slot), pred=live)


@gluon.jit
def _tma_read_history(kd, vd, ksd, kzd, vsd, vzd, bt_ptr, bt_stride, pages, out_ptr,
                      HKV: gl.constexpr, SPLITS: gl.constexpr, STAGES: gl.constexpr):
    """Sum of the history words and parameters of (sequence, KV head) program_id(0)'s split program_id(1), each page
    copied into shared memory by the TMA (STAGES slots, one mbarrier each)."""
    P: gl.constexpr = 64
    pid = gl.program_id(0)
    split = gl.program_id(1)
    b = pid // HKV
    h = pid % HKV
    share = (pages + SPLITS - 1) // SPLITS
    lo = split * share
    hi = gl.minimum(lo + share, pages)
    kbuf = gl.allocate_shared_memory(gl.int16, [STAGES, P, 16], kd.layout)
    vbuf = gl.allocate_shared_memory(gl.int16, [STAGES, P, 16], vd.layout)
    ksbuf = gl.allocate_shared_memory(gl.float16, [STAGES, 1, P], ksd.layout)
    kzbuf = gl.allocate_shared_memory(gl.float16, [STAGES, 1, P], kzd.layout)
    vsbuf = gl.allocate_shared_memory(gl.float16, [STAGES, 1, P], vsd.layout)
    vzbuf = gl.allocate_shared_memory(gl.float16, [STAGES, 1, P], vzd.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()
    bt_row = bt_ptr + b.to(gl.int64) * bt_stride
    descs = (kd, vd, ksd, kzd, vsd, vzd)
    bufs = (kbuf, vbuf, ksbuf, kzbuf, vsbuf, vzbuf)
    for j in gl.static_range(STAGES - 1):
        _copy_page(descs, bufs, bars, j, gl.load(bt_row + gl.minimum(lo + j, pages - 1)) * HKV + h, lo + j < hi)
    WORDS: gl.constexpr = gl.BlockedLayout([2, 16], [32, 1], [1, 1], [1, 0])
    ROW: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [1, 1], [1, 0])
    acc = gl.zeros([P, 16], gl.int32, WORDS)
    params = gl.zeros([1, P], gl.float32, ROW)
    for index in range(lo, hi):
        i = index - lo
        at = i % STAGES
        mbarrier.wait(bars.index(at), (i // STAGES) & 1)
        _warp_barrier()  # everyone is done with the slot refilled below
        nxt = index + STAGES - 1
        _copy_page(descs, bufs, bars, (i + STAGES - 1) % STAGES,
                   gl.load(bt_row + gl.minimum(nxt, pages - 1)) * HKV + h, nxt < hi)
        acc += kbuf.index(at).load(WORDS).to(gl.int32) ^ vbuf.index(at).load(WORDS).to(gl.int32)
        params += (ksbuf.index(at).load(ROW).to(gl.float32) + kzbuf.index(at).load(ROW).to(gl.float32)
                   + vsbuf.index(at).load(ROW).to(gl.float32) + vzbuf.index(at).load(ROW).to(gl.float32))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
    total = gl.sum(gl.sum(acc, 1), 0).to(gl.float32) + gl.sum(gl.sum(params, 1), 0)
    gl.store(out_ptr + pid * SPLITS + split, total)


def descriptors(layer) -> tuple:
    """TMA descriptors of a layer's code pools (rows of 16 int16 words, 64-row boxes) and parameter rows (64 float16
    per (page, KV head))."""
    words = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    rows = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    p = layer.layout.page_size
    codes = [TensorDescriptor.from_tensor(t.view(torch.int16).reshape(-1, 16), [p, 16], words)
             for t in (layer.k_codes, layer.v_codes)]
    params = [TensorDescriptor.from_tensor(t.reshape(-1, p), [1, p], rows)
              for t in (layer.k_scale, layer.k_zero, layer.v_scale, layer.v_zero)]
    return (*codes, *params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x131072,1x100000")
    parser.add_argument("--stages", default="2,3,4")
    parser.add_argument("--kernel", action="store_true",
                        help="instead: the decode step with the history kernel's pages staged by the TMA "
                             "(`tma_history_kernel`) against the shipped kernel")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.kernel:
        return kernel_main(args.shapes, args.stages, args.rounds)
    from probe_history_timeline import alternating_times
    from probe_page_layout import _read_history

    device = torch.device("cuda")
    copy = copy_bandwidth_gbs(device)
    print(f"{torch.cuda.get_device_name(device)}, copy bandwidth {copy:.0f} GB/s, Triton {triton.__version__}")
    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        case = decode_case(batch, context)
        layer, step, lay = case.layer, case.step, case.layer.layout
        splits = choose_splits(layer, batch, 1, 32, context, device, gluon=True)
        history_splits = splits - window_plan(layer, batch, 1, 32, splits, context, device, gluon=True).splits
        pages = lay.pages_needed(context)
        heads = lay.kv_heads
        used = step.block_table[:, :pages].contiguous()
        nbytes = batch * heads * pages * (2 * lay.key_code_bytes * lay.page_size + 8 * lay.page_size)
        out = torch.zeros(batch * heads * 2 * history_splits, dtype=torch.float32, device=device)
        descs = descriptors(layer)
        codes16 = [t.view(torch.int16) for t in (layer.k_codes, layer.v_codes)]

        def plain(step_pages: int):
            return lambda: _read_history[(batch * heads, history_splits)](
                used, used.stride(0), pages, *codes16, layer.k_scale, layer.k_zero, layer.v_scale, layer.v_zero,
                codes16[0], out, HKV=heads, P=lay.page_size, W=lay.key_code_bytes // 2, SPLITS=history_splits,
                STEP=step_pages, BLOCKS=False, num_warps=1, num_stages=3)

        def tma_reads(stages: int):
            return lambda: _tma_read_history[(batch * heads, history_splits)](
                *descs, used, used.stride(0), pages, out, HKV=heads, SPLITS=history_splits, STAGES=stages,
                num_warps=1)

        runs = {"plain loads, 1 page a step": plain(1), "plain loads, 2 pages a step": plain(2)}
        runs.update({f"TMA, {s} slots": tma_reads(s) for s in (int(x) for x in args.stages.split(","))})
        sums = {}
        for name, fn in runs.items():
            out.zero_()
            fn()
            torch.cuda.synchronize()
            sums[name] = out.double().sum().item()
        times = alternating_times({name: (fn, None) for name, fn in runs.items()}, args.rounds)
        print(f"{shape}: {history_splits} history splits x {batch * heads} (sequence, KV head), {pages} pages; "
              f"history bytes {nbytes / 1e6:.1f} MB")
        for name in runs:
            us = min(times[name])
            print(f"  {name:<30} {us:7.1f} us  {nbytes / us / 1e3 / copy:6.1%} of copy   checksum {sums[name]:.6g}",
                  flush=True)



TMA_HELPERS = '''
_copy = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _page_slots(STAGES: gl.constexpr, kd, vd, ksd, kzd, vsd, vzd):
    """STAGES slots of staged pages in the TMA's layouts, one mbarrier each, and the descriptors."""
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()
    return (gl.allocate_shared_memory(gl.int16, [STAGES, 64, WORDS], kd.layout),
            gl.allocate_shared_memory(gl.int16, [STAGES, 64, WORDS], vd.layout),
            gl.allocate_shared_memory(gl.float16, [STAGES, 1, 64], ksd.layout),
            gl.allocate_shared_memory(gl.float16, [STAGES, 1, 64], kzd.layout),
            gl.allocate_shared_memory(gl.float16, [STAGES, 1, 64], vsd.layout),
            gl.allocate_shared_memory(gl.float16, [STAGES, 1, 64], vzd.layout),
            bars, kd, vd, ksd, kzd, vsd, vzd)


@gluon.jit
def _stage_page(page, num_pages, h, kc16, vc16, ks_ptr, kz_ptr, vs_ptr, vz_ptr, slots, stage, live,
                HKV: gl.constexpr, P: gl.constexpr):
    """One history page into slot `stage` by six TMA copies on the slot's mbarrier (none where not `live`); returns
    whether its id is valid (an id out of range reads page 0, and the caller masks its scores)."""
    kbuf, vbuf, ksbuf, kzbuf, vsbuf, vzbuf, bars, kd, vd, ksd, kzd, vsd, vzd = slots
    page_ok = (page >= 0) & (page < num_pages)
    _copy_page((kd, vd, ksd, kzd, vsd, vzd), (kbuf, vbuf, ksbuf, kzbuf, vsbuf, vzbuf), bars, stage,
               gl.where(page_ok, page, 0) * HKV + h, live)
    return page_ok


@gluon.jit
def _staged_page(slots, at):
    """Slot `at` in registers, in the load layouts (as the shipped `_staged_page`)."""
    kbuf, vbuf, ksbuf, kzbuf, vsbuf, vzbuf, bars, kd, vd, ksd, kzd, vsd, vzd = slots
    return (kbuf.index(at).load(KEY_LOAD), vbuf.index(at).load(VALUE_LOAD),
            ksbuf.index(at).reshape([64]).load(ROW_LOAD), kzbuf.index(at).reshape([64]).load(ROW_LOAD),
            vsbuf.index(at).reshape([64]).load(ROW_LOAD), vzbuf.index(at).reshape([64]).load(VALUE_ROW_LOAD))

'''


def _cut_function(source: str, name: str) -> str:
    """`source` without the @gluon.jit function `name` (its decorator through the line before the next decorator)."""
    start = source.index(f"@gluon.jit\ndef {name}(")
    end = source.index("@gluon.jit\n", start + 1)
    return source[:start] + source[end:]


def tma_kernel_source(helpers: str, more_edits=()) -> str:
    """The shipped history kernel's source with `helpers` (Gluon functions `_page_slots`, `_stage_page` and
    `_staged_page` of the TMA's slots) in place of its own, each slot waited on by its mbarrier instead of cp.async
    groups, taking a layer's descriptors as keyword arguments kd .. vzd; then the (old, new) texts of more_edits."""
    import inspect

    from oscarkv.kernels import gluon_history_kernel
    from probe_history_timeline import apply_edits

    source = inspect.getsource(gluon_history_kernel)
    for name in ("_page_slots", "_stage_page", "_staged_page"):
        source = _cut_function(source, name)
    edits = [
        ("from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2\n",
         "from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2\n"
         "from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma\n"),
        ("SHIFT_BLOCK: gl.constexpr = 1, STAGES: gl.constexpr = 2, TERM_ROWS: gl.constexpr = 8):",
         "SHIFT_BLOCK: gl.constexpr = 1, STAGES: gl.constexpr = 2, TERM_ROWS: gl.constexpr = 8,\n"
         "        kd=None, vd=None, ksd=None, kzd=None, vsd=None, vzd=None):"),
        ("    slots = _page_slots(STAGES)\n", "    slots = _page_slots(STAGES, kd, vd, ksd, kzd, vsd, vzd)\n"),
        ("        async_copy.wait_group(STAGES - 2)  # this thread's copies of page index have landed\n",
         "        mbarrier.wait(slots[6].index(i % STAGES), (i // STAGES) & 1)\n"),
        ("@gluon.jit\ndef history_kernel(", helpers + "\n\n@gluon.jit\ndef history_kernel("),
    ]
    return apply_edits(source, [*edits, *more_edits])


def tma_history_kernel():
    """The shipped history kernel with its pages staged by the TMA (`TMA_HELPERS` and `_copy_page`,
    `tma_kernel_source`), taking the layer's descriptors (`descriptors`) as keyword arguments kd .. vzd; loaded as a
    module of its own."""
    import inspect

    from probe_history_timeline import load_history_kernel

    return load_history_kernel("tma_history_kernel",
                               tma_kernel_source(TMA_HELPERS + "\n" + inspect.getsource(_copy_page.fn)))


def with_descriptors(kernel, descs):
    """A history kernel launched with a layer's TMA descriptors as its keyword arguments kd .. vzd."""
    from probe_score_chains import WithKeywords

    return WithKeywords(kernel, **dict(zip(("kd", "vd", "ksd", "kzd", "vsd", "vzd"), descs)))


def kernel_main(shapes: str, stages: str, rounds: int) -> None:
    """The decode step (`ops.attend_step`) with the TMA-staged history kernel against the shipped one: errors
    against the torch reference and alternating CUDA-graph timings (`probe_score_chains.compare_variants`)."""
    from oscarkv.kernels import gluon_history, gluon_history_kernel
    from probe_score_chains import compare_variants

    copy = copy_bandwidth_gbs(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {copy:.0f} GB/s, Triton {triton.__version__}")
    tma_kernel = tma_history_kernel()

    def variants(case, spec):
        tma = with_descriptors(tma_kernel, descriptors(case.layer))
        return {"shipped (cp.async), 2 slots": (gluon_history_kernel.history_kernel, gluon_history.STAGES),
                **{f"TMA, {s} slots": (tma, s) for s in (int(x) for x in stages.split(","))}}

    for shape in shapes.split(","):
        compare_variants(shape, variants, rounds, copy)


if __name__ == "__main__":
    main()
