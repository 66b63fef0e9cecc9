"""Developer tool (no GPU needed): how many instructions the prompt write kernel issues, and the time that alone takes.

Compiles `_write_kernel` for a prompt (64-token blocks, 4 warps by default; 8 KV heads, D = 128, group 128, INT2,
bfloat16 keys rotated by R_K's pieces, clip 0.96 / 0.92; the keys' and the values' launch) to sm_90 cubins with the
installed Triton, counts their SASS instructions per warp (the clip bisection's loop counted --bisection-steps
times: 9 where every row's clip ranks lie within 4 binades of its largest value, 15 in a block with a row where they
do not; everything else once: a history block skips the sink and ring stores, so this somewhat over-counts them),
and turns that into the time a 32K-token prompt needs if each of the H100's 132 × 4 schedulers issued one
instruction per cycle at 1.755 GHz with nothing else in the way: a floor under the kernel's time from its
instruction count alone.

    TRITON_INTERPRET=0 PYTHONPATH=src python scripts/count_write_instructions.py [--block 64] [--warps 4] \
        [--bisection-steps 9]

Use the Triton version of the GPU (3.6 on the H100 machine) for figures that match it.
"""

from __future__ import annotations

import argparse

import triton

from count_history_instructions import count, disassemble, loop_spans
from oscarkv.kernels import triton_write
from oscarkv.kernels.compile_check import WRITE_TYPES, compile_kernel

TOKENS, KV_HEADS, SCHEDULERS, CLOCK_GHZ = 32768, 8, 132 * 4, 1.755


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, default=64, help="tokens per program")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--bisection-steps", type=int, default=9, help="iterations of the clip's loop")
    parser.add_argument("--opcodes", action="store_true", help="also the most frequent opcodes (static)")
    args = parser.parse_args()
    print(f"Triton {triton.__version__}, sm_90, {args.block}-token blocks, {args.warps} warps; a {TOKENS}-token "
          f"prompt, {KV_HEADS} KV heads; the clip's loop counted {args.bisection_steps} times")
    print("keys and values compiled apart (STREAM 0, 1), as the two branches of a prompt's one launch (STREAM 3, "
          "whose registers are the larger of the two); the floor adds both")
    print("rotate  clip  stream  registers  instructions per warp (loop)  issue floor")
    for rotate, clip in ((2, True), (2, False), (0, True), (0, False)):
        floors = []
        for stream in (0, 1):
            constants = dict(HKV=KV_HEADS, D=128, NG=1, K_BITS=2, V_BITS=2, P=64, S=64, R=256,
                             CLIP_K=triton_write.clip_rank(0.96, 128) if clip else -1,
                             CLIP_V=triton_write.clip_rank(0.92, 128) if clip else -1, SHIFT=16, KEY_SHIFTS=False,
                             SHIFT_BLOCK=1024, FLUSH_BLOCKS=0, ROTATE=rotate, CENTER=True, BLOCK_T=args.block,
                             COMPILED=True, K_LLOYD=False, V_LLOYD=False, STREAM=stream)
            # rot_head_stride is 0 (one R_K per layer) or D·D in a launch: a multiple of 16 either way
            kernel = compile_kernel(triton_write._write_kernel, WRITE_TYPES, constants, 90, aligned=True,
                                    divisible=("rot_head_stride",), num_warps=args.warps, num_stages=3,
                                    enable_fp_fusion=False)
            sass, usage = disassemble(kernel.asm["cubin"])
            _, loops = loop_spans(sass)
            # the clip's bisection is the largest loop (others are a few-instruction wait)
            in_loops = max(sum(count(sass[start:end + 1]).values()) for start, end in loops) if clip else 0
            per_warp = sum(count(sass).values()) + (args.bisection_steps - 1) * in_loops
            programs = TOKENS // args.block * KV_HEADS
            floors.append(per_warp * args.warps * programs / SCHEDULERS / (CLOCK_GHZ * 1e3))
            registers = usage.split("REG:")[1].split()[0]
            print(f"{'pieces' if rotate else 'none':>6}  {'yes' if clip else 'no':>4}  "
                  f"{'values' if stream else 'keys':>6}  {registers:>9}  {per_warp:>20} ({in_loops:>4})  "
                  f"{floors[-1]:8.1f} us")
            if args.opcodes:
                print("    by opcode:", ", ".join(f"{op} {n}" for op, n in count(sass).most_common(16)))
        print(f"{'':>6}  {'':>4}  {'both':>6}  {'':>9}  {'':>20}  {'':>6}  {sum(floors):8.1f} us")

if __name__ == "__main__":
    main()
