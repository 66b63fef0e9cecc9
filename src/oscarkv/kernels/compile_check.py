"""Compile the Triton kernels for a GPU architecture, on any machine (no GPU needed).

The CPU interpreter that runs the kernel tests accepts programs that the compiler
rejects (a loop-carried variable that changes dtype, a non-constexpr global). Compiling
every kernel configuration down to a cubin with the ptxas shipped in the Triton wheel
catches those before a GPU ever sees the code:

    TRITON_INTERPRET=0 python -m oscarkv.kernels.compile_check [--arch 90] [--quick]
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

WINDOW = "*bf16"
ATTENTION_TYPES = dict(
    q_ptr=WINDOW, k_new_ptr=WINDOW, v_new_ptr=WINDOW, out_ptr=WINDOW, part_o_ptr="*fp32", part_lse_ptr="*fp32",
    slots_ptr="*i32", cu_ptr="*i32", len_ptr="*i32", bt_ptr="*i32", bt_stride="i32", num_pages="i32",
    kc_ptr="*u8", ks_ptr="*fp16", kz_ptr="*fp16", vc_ptr="*u8", vs_ptr="*fp16", vz_ptr="*fp16",
    sink_k_ptr=WINDOW, sink_v_ptr=WINDOW, ring_k_ptr=WINDOW, ring_v_ptr=WINDOW, qk_scale="fp32", window="i32",
    shift_ptr="*fp32", num_blocks="i32", k_kappa="fp32", k_unit="fp32", v_kappa="fp32", v_unit="fp32",
    count_ptr="*i32")
WRITE_TYPES = dict(
    k_ptr=WINDOW, v_ptr=WINDOW, k_rot_ptr=WINDOW, rot_ptr="*fp32", rot_head_stride="i32", mean_ptr="*fp32",
    pieces_ptr="*bf16", mean_rot_ptr="*fp32",
    slots_ptr="*i32", cu_ptr="*i32", len_ptr="*i32", bt_ptr="*i32", bt_stride="i32", num_pages="i32",
    kc_ptr="*u8", ks_ptr="*fp16", kz_ptr="*fp16", vc_ptr="*u8", vs_ptr="*fp16", vz_ptr="*fp16",
    sink_k_ptr=WINDOW, sink_v_ptr=WINDOW, ring_k_ptr=WINDOW, ring_v_ptr=WINDOW, kshift_ptr="*fp32", num_blocks="i32",
    k_low="fp32", k_high="fp32", v_low="fp32", v_high="fp32")
DENSE_TYPES = dict(
    q_ptr=WINDOW, k_ptr=WINDOW, v_ptr=WINDOW, out_ptr=WINDOW, part_o_ptr="*fp32", part_lse_ptr="*fp32",
    slots_ptr="*i64", lengths_ptr="*i64", stride_slot="i64", stride_head="i64", scale_log2="fp32", window="i32")
SCORE_SHIFT_TYPES = dict(q_ptr=WINDOW, shift_ptr="*fp32", out_ptr="*fp32", qk_scale="fp32", num_blocks="i32")
COMBINE_TYPES = dict(part_o_ptr="*fp32", part_lse_ptr="*fp32", out_ptr=WINDOW)
ROTATE_TYPES = dict(q_ptr=WINDOW, r_ptr="*fp32", out_ptr=WINDOW, rows="i32", n="i32", stride_b="i32",
                    stride_h="i32", stride_n="i32")
GEMV_TYPES = dict(x_ptr="*bf16", w0_ptr="*bf16", w1_ptr="*bf16", w2_ptr="*bf16", b0_ptr="*bf16", b1_ptr="*bf16",
                  b2_ptr="*bf16", y_ptr="*bf16", N0="i32", N1="i32", N2="i32")
GEMV_SILU_TYPES = dict(x_ptr="*bf16", wg_ptr="*bf16", wu_ptr="*bf16", y_ptr="*bf16", N="i32")
ROWS_TYPES = {**GEMV_TYPES, **GEMV_SILU_TYPES, **dict(partial_ptr="*fp32", count_ptr="*i32", M="i32", stride_x="i32",
                                                    stride_y="i32")}
# The query/key launch's cache-write arguments are the write kernel's (`compile_kernel` reads only its own names).
DECODE_QK_TYPES = {**WRITE_TYPES, **dict(
    q_ptr=WINDOW, k_ptr=WINDOW, qw_ptr=WINDOW, kw_ptr=WINDOW, cos_ptr=WINDOW, sin_ptr=WINDOW, r_ptr="*fp32",
    mean_ptr="*fp32", q_out_ptr=WINDOW, k_out_ptr=WINDOW, rows="i32", q_eps="fp32", k_eps="fp32", stride_q="i32",
    stride_k="i32", stride_cos="i32", stride_sin="i32", stride_v="i32")}
DENSE_KV_TYPES = dict(
    kc_ptr="*u8", ks_ptr="*fp16", kz_ptr="*fp16", vc_ptr="*u8", vs_ptr="*fp16", vz_ptr="*fp16", shift_ptr="*fp32",
    sink_k_ptr=WINDOW, sink_v_ptr=WINDOW, ring_k_ptr=WINDOW, ring_v_ptr=WINDOW, k_new_ptr=WINDOW, v_new_ptr=WINDOW,
    keys_ptr="*fp16", values_ptr="*fp16", bt_ptr="*i32", slot="i32", stored="i32", limit="i32", history_end="i32",
    new_start="i32", tokens="i32", num_blocks="i32", k_level1="fp32", k_level2="fp32", v_level1="fp32",
    v_level2="fp32", shift_block="i32")
NORM_TYPES = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", N="i32", eps="fp32", r_ptr="*bf16", sum_ptr="*bf16",
                  M="i32")

# (head_dim, group, key bits, value bits, query heads, kv heads, page, sink, recent): Qwen3-like, its
# INT4 fallback, INT4 keys with INT2 values (sliced and plain paths), SmolLM2, Gemma3, INT4 group D/4,
# and the tests' small layout (sink block smaller than a key block).
FULL = [(128, 128, 2, 2, 32, 8, 64, 64, 256), (128, 128, 4, 4, 32, 8, 64, 64, 256),
        (128, 128, 4, 2, 32, 8, 64, 64, 256), (64, 64, 4, 2, 9, 3, 64, 64, 256), (64, 64, 2, 2, 9, 3, 64, 64, 256),
        (256, 128, 2, 2, 4, 1, 64, 64, 256), (128, 32, 4, 4, 8, 2, 64, 64, 256), (128, 64, 2, 2, 8, 2, 16, 8, 32)]
QUICK = [(128, 128, 2, 2, 32, 8, 64, 64, 256)]


def compile_kernel(fn, types: dict, constexprs: dict, arch: int, aligned: bool = False, divisible: tuple = (),
                   **options):
    """Compile `fn` for sm_`arch`; returns Triton's compiled kernel (its `.asm["cubin"]` is the binary).
    aligned: give the pointer arguments the 16-byte divisibility that the JIT gives real tensors, so
    that loads vectorise as they do on the GPU; divisible: integer arguments to mark as multiples of 16, as the
    JIT marks an integer argument whose value is one (0 too)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    if getattr(fn, "is_gluon", lambda: False)():  # a Gluon kernel (`gluon_history`)
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource

    defaults = {name: param.default for name, param in inspect.signature(fn.fn).parameters.items()
                if param.default is not inspect.Parameter.empty and name not in types}
    constexprs = {**defaults, **constexprs}  # a constexpr left out takes the kernel's default
    signature = {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if (aligned and signature[name].startswith("*")) or name in divisible}
    return compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32), options=options)


def cubin_tool(tool: str, cubin: bytes, *options: str) -> str:
    """The output of one of the CUDA tools shipped in the Triton wheel (nvdisasm, cuobjdump) on a cubin."""
    import pathlib
    import subprocess
    import tempfile

    import triton

    path_of_tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(path_of_tool), *options, str(path)], check=True, capture_output=True,
                              text=True).stdout


def cubin_registers(kernel) -> int:
    """Registers a thread of a compiled kernel (`compile_kernel`) takes, from its cubin's resource usage."""
    import re

    usage = cubin_tool("cuobjdump", kernel.asm["cubin"], "--dump-resource-usage")
    return int(re.search(r"REG:(\d+)", usage).group(1))


def gluon_history_job(arch: int, key_shifts: int, query_heads: int = 32, kv_heads: int = 8, sink: int = 64,
                       recent: int = 256) -> tuple:
    """(kernel, types, constexprs, options) of the Gluon decode history kernel (D = 128, group 128, INT2) as
    `gluon_history.launch` launches it, with its register cap; key_shifts: its KEY_SHIFTS (0, 1 or 2)."""
    from . import gluon_history
    from .gluon_history_kernel import history_kernel

    constexprs, options = gluon_history.launch_settings(query_heads, kv_heads, sink, recent, num_splits=17,
                                                        window_splits=4, overlap=int(arch >= 90),
                                                        key_shifts=key_shifts, shift_block=1024)
    return history_kernel, ATTENTION_TYPES, constexprs, dict(options, aligned=True)  # its copies need 16-byte alignment


def gluon_history_kernel(arch: int = 90, key_shifts: int = 0):
    """The Gluon decode history kernel compiled for sm_`arch` at the Qwen3 shapes (32 query / 8 KV heads)."""
    fn, types, constexprs, options = gluon_history_job(arch, key_shifts)
    return compile_kernel(fn, types, constexprs, arch, **options)


def decode_qk_write_job(arch: int, batch: int, query_heads: int, write: dict) -> tuple:
    """(kernel, types, constexprs, options) of the decode step's query/key launch with its cache write, flush and
    prefetch programs (`ops.decode_query_key_write`) at `batch` rows; write: the write launch's constexprs (HKV, D, P
    and the flush's, `triton_write.flush_arguments`)."""
    from . import triton_decode_qk

    d = write["D"]
    rows, columns, warps = triton_decode_qk.launch_plan(batch, d)
    flush = {name: value for name, value in write.items() if name not in ("HKV", "D")}
    constexprs = dict(HQ=query_heads, HKV=write["HKV"], D=d, ROTATE=True, PER_HEAD=False, ROTATE_KEYS=True,
                      CENTER_KEYS=True, HAS_Q_NORM=True, HAS_K_NORM=True, BLOCK=rows, BLOCK_N=columns,
                      OVERLAP=arch >= 90, **flush, BLOCK_T=16, FLUSH_BLOCKS=-(-write["P"] // 16), PREFETCH_SPLITS=132,
                      PREFETCH_PAGES=2)
    return triton_decode_qk._decode_qk_kernel, DECODE_QK_TYPES, constexprs, dict(num_warps=warps,
                                                                                 enable_fp_fusion=False)


def decode_qk_write_kernel(arch: int = 90, batch: int = 1, key_shifts: bool = False):
    """`decode_qk_write_job` compiled for sm_`arch` at the Qwen3 shapes (32 query / 8 KV heads, D = 128, INT2 pages of
    64 tokens); key_shifts: its flush subtracts key shifts (key_centering "rope")."""
    d = 128
    write = dict(D=d, HKV=8, NG=1, K_BITS=2, V_BITS=2, P=64, S=64, R=256, K_LLOYD=False, V_LLOYD=False,
                 CLIP_K=int(0.96 * d), CLIP_V=int(0.92 * d), SHIFT=16, KEY_SHIFTS=key_shifts, SHIFT_BLOCK=1024,
                 COMPILED=True)
    fn, types, constexprs, options = decode_qk_write_job(arch, batch, 32, write)
    return compile_kernel(fn, types, constexprs, arch, **options)


def sass_instructions(kernel) -> list[str]:
    """The SASS instructions of a compiled kernel (`compile_kernel`), in the order of its code."""
    return [line for line in cubin_tool("nvdisasm", kernel.asm["cubin"]).splitlines()
            if line.strip().startswith("/*") and "*/" in line and ";" in line]


def _compile(fn, types: dict, constexprs: dict, arch: int, **options) -> float:
    start = time.perf_counter()
    compile_kernel(fn, types, constexprs, arch, **options)
    return time.perf_counter() - start


def check(arch: int = 90, configs=FULL, verbose: bool = True) -> int:
    """Compile every kernel for each configuration; returns how many compiled (raises on the first failure)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 replaces the kernels by interpreted functions; unset it to compile.")
    import triton.language as tl

    from . import (gluon_history, triton_attention, triton_decode_qk, triton_dense, triton_dequantize, triton_gemv,
                   triton_norm, triton_rotate, triton_write)
    from .hardware import register_cap_supported
    from .ops import HISTORY_REGISTERS_BESIDE_WINDOWS, choose_splits  # noqa: F401  (the dispatch imports cleanly too)

    count = 0
    for d, group, key_bits, value_bits, hq, hkv, page, sink, recent in configs:
        shape = dict(D=d, NG=d // group, K_BITS=key_bits, V_BITS=value_bits, P=page, S=sink, R=recent,
                     K_LLOYD=False, V_LLOYD=False)
        # prefill; decode history, windows; decode history with key_centering="rope" shifts. Decode
        # launches overlap (programmatic dependent launch) from sm_90: history first, windows second.
        pdl = arch >= 90

        def attention(splits: int, regions: int, windows: int, shifted: bool = False, warps: int | None = None,
                      block_n: int = 64, **extra):
            overlap = 0 if regions == 0 or not pdl else regions
            return (triton_attention._paged_attention_kernel, ATTENTION_TYPES,
                    {**dict(shape, PART_PAGE=regions == 0, HQ=hq, HKV=hkv, NUM_SPLITS=splits, BLOCK_M=16,
                            BLOCK_N=block_n, SINK_BLOCK=max(16, 1 << (sink - 1).bit_length()), ASM=True,
                            REGIONS=regions, WINDOW_SPLITS=windows, KEY_SHIFTS=shifted, SHIFT_BLOCK=1024,
                            OVERLAP=overlap, ROW_GROUPS=1), **extra},
                    dict(num_warps=warps or (1 if regions == 1 else 4), num_stages=2))

        jobs = [attention(*job) for job in ((1, 0, 1), (17, 1, 4), (17, 2, 4), (17, 1, 4, True))]
        # extend steps in 32-row query blocks (`ops.choose_block_m`): unsplit; split, one block (one warp) or more
        jobs += [attention(1, 0, 1, BLOCK_M=32), attention(17, 1, 4, BLOCK_M=32),
                 attention(17, 1, 4, warps=4, BLOCK_M=32)]
        if d <= 128:  # one-warp window programs of 16-key blocks (`ops.window_plan`)
            jobs.append(attention(17, 2, 1, warps=1, block_n=16))
        if d <= 128:  # large batches: one two-warp window program of 32-key blocks (`ops._two_warp_windows`)
            jobs.append(attention(17, 2, 1, warps=2, block_n=32))
        # window programs that merge the splits (`triton_attention.merges_in_windows`): one, of one or two warps, or
        # two four-warp ones per (sequence, KV head)
        if d <= 128:
            jobs += [attention(17, 2, 1, warps=1, block_n=16, MERGE=4), attention(17, 2, 1, warps=2, block_n=32,
                                                                                     MERGE=4)]
        jobs.append(attention(17, 2, 2, MERGE=4))
        # few history programs (`ops.history_warps`): four-warp history beside 16 one-warp window programs
        jobs += [attention(30, 1, 16, warps=4), attention(30, 2, 16, warps=1, block_n=16)]
        if d >= 128:  # decode history with two pages per softmax step (`ops.choose_row_groups`)
            jobs.append(attention(17, 1, 4, ROW_GROUPS=2))
        if register_cap_supported():  # history beside four-warp window programs (`ops.history_registers`)
            kernel, types, constants, options = attention(17, 1, 4)
            jobs.append((kernel, types, constants, dict(options, maxnreg=HISTORY_REGISTERS_BESIDE_WINDOWS)))
        write = dict(shape, HKV=hkv, CLIP_K=int(0.96 * d), CLIP_V=int(0.92 * d), SHIFT=16, KEY_SHIFTS=False,
                     SHIFT_BLOCK=1024, COMPILED=True)
        # flush and write in one launch, keys and values in one program
        decode_write = dict(write, FLUSH_BLOCKS=-(-page // 16), STREAM=2)
        short_write = dict(write, FLUSH_BLOCKS=0, STREAM=2)  # a step of 2 to 63 tokens per sequence
        prompt = dict(write, FLUSH_BLOCKS=0, STREAM=3)  # keys and values in separate programs of one launch
        # rotation by bfloat16 pieces (bfloat16 keys, D <= 128) and by float32 dots (any other)
        rotations = (2, 1) if d <= 128 else (1,)
        unfused = dict(enable_fp_fusion=False)  # as launch_write runs them
        capped = dict(unfused, **({"maxnreg": triton_write.PROMPT_WRITE_REGISTERS} if register_cap_supported() else {}))
        for rotate in rotations:
            for block, step, options in ((16, decode_write, unfused), (16, short_write, unfused), (64, prompt, capped)):
                jobs.append((triton_write._write_kernel, WRITE_TYPES,
                             dict(step, ROTATE=rotate, CENTER=True, BLOCK_T=block), options))
        jobs.append((triton_write._write_kernel, WRITE_TYPES,
                     dict(prompt, ROTATE=rotations[0], CENTER=True, BLOCK_T=64, KEY_SHIFTS=True), capped))
        jobs.append((triton_write._write_kernel, WRITE_TYPES,
                     dict(decode_write, ROTATE=0, CENTER=False, BLOCK_T=16), unfused))
        for shifted in (False, True):
            jobs.append((triton_write._flush_kernel, WRITE_TYPES, dict(write, BLOCK_T=16, KEY_SHIFTS=shifted),
                         unfused))
        if key_bits == value_bits == 2:  # Lloyd–Max levels: prefill, decode history, prompt write, flush
            lloyd = dict(K_LLOYD=True, V_LLOYD=True)
            jobs += [attention(1, 0, 1, **lloyd), attention(17, 1, 4, **lloyd)]
            jobs.append((triton_write._write_kernel, WRITE_TYPES,
                         dict(prompt, ROTATE=rotations[0], CENTER=True, BLOCK_T=64, **lloyd), capped))
            jobs.append((triton_write._flush_kernel, WRITE_TYPES, dict(write, BLOCK_T=16, **lloyd), unfused))
        # extend steps' dense keys and values (`kernels.extend`): keys with shifts, values at Lloyd-Max levels if INT2
        dense_kv = dict(HKV=hkv, D=d, NG=d // group, K_BITS=key_bits, V_BITS=value_bits, P=page, S=sink,
                        C=recent + page, K_LLOYD=False, V_LLOYD=value_bits == 2, KEY_SHIFTS=True, BLOCK=64)
        jobs.append((triton_dequantize._dense_kv_kernel, DENSE_KV_TYPES, dense_kv, dict(num_warps=4)))
        # A launch passes an int argument equal to 1 as a constant, except those it does not specialise (the
        # per-step ones): the kernel must compile with each of them so (a constant has no `.to`).
        ones = {name: 1 for name, kind in DENSE_KV_TYPES.items()
                if kind == "i32" and name not in triton_dequantize.PER_STEP_INTS}
        jobs.append((triton_dequantize._dense_kv_kernel, DENSE_KV_TYPES, dict(dense_kv, **ones), dict(num_warps=4)))
        jobs.append((triton_dense._dense_decode_kernel, DENSE_TYPES,
                     dict(HQ=hq, HKV=hkv, D=d, NUM_SPLITS=17, BLOCK_M=16, BLOCK_N=64, DOT_DTYPE=tl.bfloat16),
                     dict(num_warps=4, num_stages=3)))
        jobs.append((triton_attention._score_shift_kernel, SCORE_SHIFT_TYPES, dict(HQ=hq, HKV=hkv, D=d, BLOCK_B=32),
                     {}))
        jobs.append((triton_attention._combine_kernel, COMBINE_TYPES,
                     dict(D=d, NUM_SPLITS=17, SPLIT_BLOCK=32, WAIT=pdl, D_BLOCK=min(32, d)), {}))
        jobs.append((triton_rotate._rotate_queries_kernel, ROTATE_TYPES,
                     dict(HQ=hq, GROUP=hq // hkv, PER_HEAD=True, D=d, BLOCK=16, BLOCK_N=min(d, 32), BLOCK_K=32),
                     dict(num_warps=4)))
        # a prompt chunk's larger blocks: R_K's terms in 64-row blocks and, at D >= 128, 128-row blocks
        plans = {triton_rotate.launch_blocks(rows, hq, d, triton_rotate.PIECE_DTYPES[0])
                 for rows in (triton_rotate.LONG_STEP_ROWS * -(-triton_rotate.LONG_STEP_PROGRAMS // hq), 4096)}
        for block, warps, pieces in sorted(plans):
            jobs.append((triton_rotate._rotate_queries_kernel, ROTATE_TYPES,
                         dict(HQ=hq, GROUP=hq // hkv, PER_HEAD=True, D=d, BLOCK=block,
                              BLOCK_N=min(d, triton_rotate.LONG_BLOCK_COLUMNS), BLOCK_K=32, PIECES=pieces),
                         dict(num_warps=warps)))
        # the query/key launch at batch 1 and at 32 rows: alone (no cache arguments), and with the step's cache write
        # and flush (`ops.decode_query_key_write`; the flush's constexprs as the write launch's)
        for batch in (1, 32):
            rows, columns, warps = triton_decode_qk.launch_plan(batch, d)
            decode_qk = dict(HQ=hq, HKV=hkv, D=d, ROTATE=True, PER_HEAD=False, ROTATE_KEYS=True, CENTER_KEYS=True,
                             HAS_Q_NORM=True, HAS_K_NORM=True, BLOCK=rows, BLOCK_N=columns, OVERLAP=pdl)
            jobs.append((triton_decode_qk._decode_qk_kernel, DECODE_QK_TYPES,
                         dict(decode_qk, **dict.fromkeys(triton_decode_qk.WRITE_ARGUMENTS)), dict(num_warps=warps)))
            jobs.append(decode_qk_write_job(arch, batch, hq, write))
        if gluon_history.available() and (d, group, key_bits, value_bits, page) == (128, 128, 2, 2, 64):
            for key_shifts in (0, 1, 2):  # decode history in Gluon (`gluon_history.takes`), each key-shift mode
                jobs.append(gluon_history_job(arch, key_shifts, hq, hkv, sink, recent))
        for fn, types, constexprs, options in jobs:
            seconds = _compile(fn, types, constexprs, arch, **options)
            count += 1
            if verbose:
                print(f"sm_{arch} {fn.__name__:<24} D={d} G={group} bits={key_bits}/{value_bits} "
                      f"ok ({seconds:.1f} s)", flush=True)
    # batch-1 linear layers (model shapes, not cache configurations): q/k/v in one launch with biases, a
    # row longer than one load, the gated MLP's first half; the RMSNorm of decode steps and of a prompt's q/k rows
    gemv = dict(BLOCK_N=triton_gemv.BLOCK_N, OVERLAP=arch >= 90)
    tiled_rows, tiled_warps = triton_norm.norm_plan(triton_norm.MANY_ROWS, 128)
    for fn, types, constexprs, label, warps in (
            (triton_gemv._gemv_kernel, GEMV_TYPES,
             dict(gemv, K=2560, KB=4096, SEGMENTS=3, HAS_BIAS=True, stride0=2560, stride1=2560, stride2=2560),
             "K=2560", 4),
            (triton_gemv._gemv_kernel, GEMV_TYPES,
             dict(gemv, K=40000, KB=triton_gemv.CHUNK, SEGMENTS=1, HAS_BIAS=False, stride0=40000, stride1=40000,
                  stride2=40000), "K=40000", 4),
            (triton_gemv._gemv_silu_mul_kernel, GEMV_SILU_TYPES,
             dict(gemv, K=2560, KB=4096, stride_g=2560, stride_u=2560), "K=2560", 4),
            (triton_norm._rms_norm_kernel, NORM_TYPES, dict(BLOCK=4096, OVERLAP=arch >= 90, RESIDUAL=True),
             "N=2560, residual", triton_norm.norm_warps(2560)),
            (triton_norm._rms_norm_kernel, NORM_TYPES, dict(BLOCK=128, OVERLAP=arch >= 90, ROWS=tiled_rows),
             f"N=128, {tiled_rows} rows", tiled_warps)):
        seconds = _compile(fn, types, constexprs, arch, num_warps=warps, num_stages=1)
        count += 1
        if verbose:
            print(f"sm_{arch} {fn.__name__:<24} {label} ok ({seconds:.1f} s)", flush=True)
    # linear layers of batches of 2 to 32 rows: q/k/v in one launch, its columns in one program and split over
    # three (split-K); the gated MLP's first half, split over two
    tile = triton_gemv.ROW_TILE
    rows = dict(BLOCK_N=tile.block_n, BLOCK_M=32, BLOCK_K=tile.block_k, DOT_DTYPE=tl.bfloat16, OVERLAP=arch >= 90)
    qkv = dict(rows, K=2560, SEGMENTS=3, HAS_BIAS=True, stride0=2560, stride1=2560, stride2=2560)
    for fn, constexprs, label in (
            (triton_gemv._rows_kernel, dict(qkv, SPLITS=1, K_SPLIT=2560), "K=2560, M=32"),
            (triton_gemv._rows_kernel, dict(qkv, SPLITS=3, K_SPLIT=896), "K=2560, M=32, 3 splits"),
            (triton_gemv._rows_silu_mul_kernel, dict(rows, K=2560, SPLITS=2, K_SPLIT=1280, stride_g=2560,
                                                     stride_u=2560), "K=2560, M=32, 2 splits")):
        seconds = _compile(fn, ROWS_TYPES, constexprs, arch, num_warps=tile.warps, num_stages=tile.stages)
        count += 1
        if verbose:
            print(f"sm_{arch} {fn.__name__:<24} {label} ok ({seconds:.1f} s)", flush=True)
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100)")
    parser.add_argument("--quick", action="store_true", help="only the Qwen3-like INT2 configuration")
    args = parser.parse_args(argv)
    count = check(args.arch, QUICK if args.quick else FULL)
    print(f"{count} kernel configurations compiled for sm_{args.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
