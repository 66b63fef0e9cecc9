"""Developer tool (no GPU needed): count the SASS instructions of the decode kernel's history loop.

Compiles `_paged_attention_kernel` for the history launch (REGIONS=1) of the benchmark shape
(32 query / 8 KV heads, D = 128, group 128, INT2, one warp; or SmolLM2's, `--head-dim 64`) down to an
sm_90 cubin with the ptxas of the installed Triton, disassembles it with Triton's nvdisasm, and counts the
instructions between the history loop's label and its backward branch, by opcode. Pointer arguments get the 16-byte
divisibility that the JIT gives real tensors, so the loads vectorise as they do on the GPU.

    TRITON_INTERPRET=0 PYTHONPATH=src python scripts/count_history_instructions.py [--stages 3] [--maxnreg N] [--row-groups 2] \
        [--head-dim 64]

The count is static: both sides of a branch inside the loop are counted (the sliding-window mask
and the rare rescale of the accumulators); the branches are listed so they can be subtracted.
Use the Triton version of the GPU (3.6 on the H100 machine) for figures that match it.
"""

from __future__ import annotations

import argparse
import collections
import re

import triton

from oscarkv.kernels import triton_attention
from oscarkv.kernels.compile_check import ATTENTION_TYPES, compile_kernel, cubin_tool

INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")


# (query heads, KV heads) of the layer shapes by head_dim: Qwen3-4B/8B's, SmolLM2-135M's
HEADS = {128: (32, 8), 64: (9, 3)}


def compile_history_kernel(stages: int, maxnreg: int | None, row_groups: int = 1, head_dim: int = 128) -> bytes:
    hq, hkv = HEADS[head_dim]
    constexprs = dict(HQ=hq, HKV=hkv, D=head_dim, NG=1, K_BITS=2, V_BITS=2, P=64, S=64, R=256, NUM_SPLITS=17,
                      BLOCK_M=16,
                      BLOCK_N=64, SINK_BLOCK=64, ASM=True, REGIONS=1, WINDOW_SPLITS=4, KEY_SHIFTS=False,
                      SHIFT_BLOCK=1024, OVERLAP=1, K_LLOYD=False, V_LLOYD=False, PART_PAGE=False)
    constexprs["ROW_GROUPS"] = row_groups
    options = dict(num_warps=1, num_stages=stages, **({} if maxnreg is None else dict(maxnreg=maxnreg)))
    kernel = compile_kernel(triton_attention._paged_attention_kernel, ATTENTION_TYPES, constexprs, 90,
                            aligned=True, **options)
    return kernel.asm["cubin"]


def disassemble(cubin: bytes) -> tuple[list[str], str]:
    """(SASS lines, resource usage text) of a cubin, with the nvdisasm and cuobjdump of the installed Triton."""
    return (cubin_tool("nvdisasm", cubin, "-c").splitlines(),
            cubin_tool("cuobjdump", cubin, "--dump-resource-usage"))


def loop_spans(sass: list[str]) -> tuple[dict[str, int], list[tuple[int, int]]]:
    """(label -> line, [(first, last) line of each loop]): a loop runs from a label to a branch back to it."""
    labels = {m.group(1): i for i, line in enumerate(sass) if (m := LABEL.match(line.strip()))}
    return labels, [(labels[m.group(1)], i) for i, line in enumerate(sass)
                    if (m := BRANCH.search(line)) and m.group(1) in labels and labels[m.group(1)] < i]


def count(lines: list[str]) -> collections.Counter:
    """Instructions by opcode."""
    return collections.Counter(m.group(1) for line in lines if (m := INSTRUCTION.match(line)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--maxnreg", type=int, default=None)
    parser.add_argument("--row-groups", type=int, default=1, help="pages per softmax step (ROW_GROUPS)")
    parser.add_argument("--head-dim", type=int, default=128, choices=sorted(HEADS),
                        help="128: Qwen3 shapes (32 query / 8 KV heads); 64: SmolLM2's (9 / 3), group 64")
    args = parser.parse_args()
    sass, usage = disassemble(compile_history_kernel(args.stages, args.maxnreg, args.row_groups, args.head_dim))
    labels, loops = loop_spans(sass)
    start, end = max(loops, key=lambda span: span[1] - span[0])  # the history loop is the largest
    ops = count(sass[start:end + 1])
    print(f"Triton {triton.__version__}, sm_90, head_dim {args.head_dim}, {args.stages} stages, "
          f"maxnreg {args.maxnreg}, "
          f"{args.row_groups} row group(s): the loop reads {args.row_groups} page(s) per iteration")
    print("registers:", re.search(r"REG:(\d+)", usage).group(1))
    print("history loop instructions:", sum(ops.values()))
    print("by opcode:", ", ".join(f"{op} {n}" for op, n in ops.most_common()))
    for i in range(start, end + 1):  # branches inside the loop, with the instructions they jump over
        m = BRANCH.search(sass[i])
        if m and m.group(1) in labels and start < labels[m.group(1)] <= end:
            skipped = sum(1 for line in sass[i + 1:labels[m.group(1)]] if INSTRUCTION.match(line))
            print(f"branch at line {i - start}: skips {skipped} instructions when taken")


if __name__ == "__main__":
    main()
