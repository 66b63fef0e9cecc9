"""Developer tool (GPU): how fast one-warp programs issue the decode history kernel's score-dot instruction mix,
alone, with no memory traffic: the INT2 code words unpacked by one 32-bit AND per two float16 operands, each
operand fed to an mma.sync m16n8k16 (as `gluon_history_kernel` does for a page's key codes), at 4, 8 and 16
programs a multiprocessor (one, two and four warps a scheduler).

Why: the history kernel issues about half an instruction per scheduler and cycle, with two warps a scheduler at
1x128K and four at 32x32K, while no pipe is near its peak (docs/kernels-log.md, "Where the warps wait"). This asks
whether that rate belongs to the instruction mix itself. Modes, per loop step (8 slices of a [64, 16] word tile):
- "and+mma": the shift of the high bytes and 8 x 16 ANDs feeding 8 x 4 mma into one [64, 8] accumulator (4
  independent chains of 8, the score dot's shape);
- "mma": the 32 mma alone, on two fixed operands;
- "and": the ANDs alone, each folded into a running word by the same one instruction (lop3 x ^ (w & mask));
- "and|mma": both, independent of each other (the ANDs of "and" beside the mma of "mma"): can the two pipes overlap
  when no mma waits for an AND?
- "and+wgmma", "wgmma": "and+mma" and "mma" as programs of one warpgroup (4 warps), each warp unpacking its 16 rows
  of the tile and the 8 dots a step as asynchronous wgmma m64n8k16 (A from registers), waited once a step: a step
  does the same tile as a one-warp program's step, with the instruction that runs Hopper's tensor cores at full rate
  for wide tiles.
Each step also XORs the words with the step's index (16 instructions: ptxas hoists the ANDs of fixed words out of
the loop), where the kernel loads a page's words from shared memory (8 loads).

    PYTHONPATH=src:scripts python scripts/probe_mix_ipc.py [--iters 4000] [--per-sm 4,8,16] [--modes and+mma,wgmma,...]
        [--once]

Prints, per mode and warps a multiprocessor (4, 8, 16: one-warp programs, or 1, 2, 4 warpgroups): the loop's SASS
instructions a warp and step (counted from the cubin), the time, the warp instructions issued per scheduler per
nanosecond (divide by the SM clock in GHz, which Nsight Compute reports, for instructions per cycle), and the word
tiles done per multiprocessor and microsecond (the measure that compares one-warp and warpgroup programs).

Found (H200, docs/data/mix-ipc-h200-s72.txt, docs/data/wgmma-mix-h200-s72.txt): an mma.sync takes the tensor pipe 6
cycles a scheduler, an ALU instruction the ALU pipe 2, and an mma.sync holds the ALU work beside it about 2 cycles;
the dependent mix issues 0.27 / 0.40 / 0.45 instructions a cycle with 1 / 2 / 4 warps a scheduler. At N = 8 a wgmma
does less than half of mma.sync's dot work per unit of time, and with the unpacking it is no faster.
"""

from __future__ import annotations

import argparse
import re

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from oscarkv.kernels.gluon_history_kernel import _high_bytes, _masked_units  # the kernel's own unpacking

MODES = {"and+mma": 0, "mma": 1, "and": 2, "and|mma": 3}
WGMMA_MODES = {"and+wgmma": 0, "wgmma": 1}


@gluon.jit
def _fold_and(x, w, MASK: gl.constexpr):
    """x ^ (w & MASK), one lop3 per pair (the AND of `_masked_units`, its result kept); non-pure, so it stays."""
    mask = gl.full(w.shape, MASK, gl.int16, w.type.layout)
    return gl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0x78;", "=r,r,r,r", [x, w, mask], dtype=gl.int16,
                                     is_pure=False, pack=2)


@gluon.jit
def _mix_kernel(w_ptr, q_ptr, out_ptr, word_out_ptr, ITERS: gl.constexpr, MODE: gl.constexpr):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, A))
    words = gl.arange(0, 16, layout=gl.SliceLayout(0, A))
    w = gl.load(w_ptr + rows[:, None] * 16 + words[None, :])
    k = gl.arange(0, 16, layout=gl.SliceLayout(1, B))
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, B))
    q = gl.load(q_ptr + k[:, None] * 8 + n[None, :])
    acc = gl.zeros([64, 8], gl.float32, MMA)
    x = w
    if MODE == 1 or MODE == 3:
        a0 = _masked_units(w, 0x0303)
        a1 = _masked_units(w, 0x0C0C)
    for i in range(ITERS):
        if MODE != 1:  # new words every step (ptxas would hoist the ANDs of fixed words out of the loop)
            w = w ^ gl.full(w.shape, 0, gl.int16, w.type.layout).__add__(i.to(gl.int16))
        if MODE == 0:
            h = _high_bytes(w)
            for s in gl.static_range(8):
                acc = mma_v2(_masked_units(w if s < 4 else h, 3 << (2 * (s % 4))), q, acc)
        if MODE == 1 or MODE == 3:
            for s in gl.static_range(8):
                acc = mma_v2(a0 if s % 2 == 0 else a1, q, acc)
        if MODE >= 2:
            h = _high_bytes(w)
            for s in gl.static_range(8):
                x = _fold_and(x, w if s < 4 else h, 3 << (2 * (s % 4)))
    pid = gl.program_id(0)
    m = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    c = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    gl.store(out_ptr + pid * 512 + m[:, None] * 8 + c[None, :], acc)
    gl.store(word_out_ptr + pid * 1024 + rows[:, None] * 16 + words[None, :], x)


@gluon.jit
def _wgmma_mix_kernel(w_ptr, q_ptr, out_ptr, ITERS: gl.constexpr, MODE: gl.constexpr):
    """The score mix of `_mix_kernel` ("and+mma" / "mma") as one warpgroup of 4 warps: the same [64, 16] word tile,
    each warp unpacking its 16 rows, 8 asynchronous wgmma m64n8k16 a step (A from registers, the queries from shared
    memory) chained on one accumulator, then one wait."""
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, A))
    words = gl.arange(0, 16, layout=gl.SliceLayout(0, A))
    w = gl.load(w_ptr + rows[:, None] * 16 + words[None, :])
    QL: gl.constexpr = gl.BlockedLayout([1, 1], [16, 2], [1, 4], [1, 0])
    k = gl.arange(0, 16, layout=gl.SliceLayout(1, QL))
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, QL))
    q = gl.load(q_ptr + k[:, None] * 8 + n[None, :])
    q_smem = gl.allocate_shared_memory(gl.float16, [16, 8], gl.NVMMASharedLayout.get_default_for([16, 8], gl.float16),
                                       q)
    fence_async_shared()
    acc = gl.zeros([64, 8], gl.float32, ACC)
    f0 = _masked_units(w, 0x0303)
    f1 = _masked_units(w, 0x0C0C)
    for i in range(ITERS):
        if MODE == 0:
            w = w ^ gl.full(w.shape, 0, gl.int16, w.type.layout).__add__(i.to(gl.int16))
            h = _high_bytes(w)
            a0 = _masked_units(w, 0x0003)
            a1 = _masked_units(w, 0x000C)
            a2 = _masked_units(w, 0x0030)
            a3 = _masked_units(w, 0x00C0)
            a4 = _masked_units(h, 0x0003)
            a5 = _masked_units(h, 0x000C)
            a6 = _masked_units(h, 0x0030)
            a7 = _masked_units(h, 0x00C0)
            acc = warpgroup_mma(a0, q_smem, acc, is_async=True)
            acc = warpgroup_mma(a1, q_smem, acc, is_async=True)
            acc = warpgroup_mma(a2, q_smem, acc, is_async=True)
            acc = warpgroup_mma(a3, q_smem, acc, is_async=True)
            acc = warpgroup_mma(a4, q_smem, acc, is_async=True)
            acc = warpgroup_mma(a5, q_smem, acc, is_async=True)
            acc = warpgroup_mma(a6, q_smem, acc, is_async=True)
            acc = warpgroup_mma(a7, q_smem, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc, a0, a1, a2, a3, a4, a5, a6, a7])[0]
        else:
            for s in gl.static_range(8):
                acc = warpgroup_mma(f0 if s % 2 == 0 else f1, q_smem, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc, f0, f1])[0]
    pid = gl.program_id(0)
    m = gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
    c = gl.arange(0, 8, layout=gl.SliceLayout(0, ACC))
    gl.store(out_ptr + pid * 512 + m[:, None] * 8 + c[None, :], acc)


def loop_instructions(kernel) -> float:
    """SASS instructions a warp issues in a loop step: the lines from the loop's label to its backward branch, divided
    by the times ptxas unrolled the step (32 mma or 8 wgmma a step, or else 16 high-byte shifts)."""
    from oscarkv.kernels.compile_check import cubin_tool

    text = cubin_tool("nvdisasm", kernel.asm["cubin"]).splitlines()
    branch = next(i for i, line in enumerate(text) if re.search(r"BRA\s+`\(\.L_x_0\)", line))
    head = next(i for i, line in enumerate(text) if line.strip() == ".L_x_0:")
    body = [line for line in text[head:branch + 1] if re.search(r"/\*[0-9a-f]+\*/", line)]
    mma = sum("HMMA" in line for line in body)
    wgmma = sum("HGMMA" in line for line in body)
    unroll = mma / 32 if mma else wgmma / 8 if wgmma else sum("SHF.R.U32.HI" in line for line in body) / 16
    return len(body) / unroll


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=4000)
    parser.add_argument("--per-sm", default="4,8,16", help="warps a multiprocessor")
    parser.add_argument("--modes", default=",".join([*MODES, *WGMMA_MODES]))
    parser.add_argument("--once", action="store_true", help="one launch each, untimed (under Nsight Compute)")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    print(f"{props.name}, {sms} SMs, torch {torch.__version__}, triton {triton.__version__}, iters {args.iters}")
    w = torch.randint(-32768, 32767, (64, 16), dtype=torch.int16, device="cuda")
    q = (torch.randn(16, 8, device="cuda") * 1e-3).half()
    for mode in args.modes.split(","):
        warps = 4 if mode in WGMMA_MODES else 1
        for per_sm in (int(p) for p in args.per_sm.split(",")):
            programs = sms * per_sm // warps
            out = torch.empty(programs, 512, device="cuda")
            words = torch.empty(programs, 1024, dtype=torch.int16, device="cuda")
            if warps == 4:
                launch = lambda: _wgmma_mix_kernel[(programs,)](w, q, out, args.iters, WGMMA_MODES[mode],  # noqa: E731
                                                                num_warps=4)
            else:
                launch = lambda: _mix_kernel[(programs,)](w, q, out, words, args.iters, MODES[mode],  # noqa: E731
                                                          num_warps=1)
            kernel = launch()
            torch.cuda.synchronize()
            per_step = loop_instructions(kernel)
            if args.once:
                print(f"{mode:9s} {per_sm:2d} warps/SM: {per_step:.1f} SASS a warp and step", flush=True)
                continue
            us = triton.testing.do_bench(launch, warmup=3, rep=30) * 1e3
            issued = per_step * args.iters * programs * warps  # warp instructions of the loops
            rate = issued / (sms * 4) / (us * 1e3)
            tiles = programs * args.iters / sms / us  # [64, 16] word tiles (8 slices each) a multiprocessor and µs
            print(f"{mode:9s} {per_sm:2d} warps/SM ({per_sm / 4:g} a scheduler): {per_step:.1f} SASS a warp and step, "
                  f"{us:9.1f} us, {rate:.3f} warp instructions per scheduler per ns, {tiles:.2f} tiles per SM per us",
                  flush=True)


if __name__ == "__main__":
    main()
