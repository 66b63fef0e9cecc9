"""Developer tool (GPU): the prompt write's keys and values launches timed apart, and the same work as one launch.

A 32K-token prompt into an empty paged cache (8 KV heads, D = 128, group 128, INT2, bfloat16 keys rotated by R_K's
pieces, clip 0.96 / 0.92), as in `oscarkv bench attention`'s write row. `launch_write` runs a prompt's keys and
values as separate programs of one launch (STREAM 3, 2·Hkv programs per block, capped at 168 registers); two launches
(STREAM 0 and 1) and one launch with both in one program (STREAM 2, as short steps take) must store the same bytes.
All are timed, some with and without the cap; then either stream in other block sizes.

    PYTHONPATH=src python scripts/probe_write_streams.py
"""

from __future__ import annotations

import torch
import triton

from oscarkv.benchmarks.attention import write_case
from oscarkv.kernels import triton_write

TOKENS, KV_HEADS, HEAD_DIM = 32768, 8, 128


def main() -> None:
    case = write_case(TOKENS, KV_HEADS, HEAD_DIM)
    device, batch, layer, layout = case.k.device, case.step, case.layer, case.layer.layout
    k, v, rotation, mean, pieces = case.k, case.v, case.rotation, case.mean, case.pieces
    k_rot = torch.empty_like(k)
    pages = (layer.k_codes, layer.k_scale, layer.k_zero, layer.v_codes, layer.v_scale, layer.v_zero)
    stored = (*pages, layer.sink_k, layer.sink_v, layer.ring_k, layer.ring_v, k_rot)
    print(f"{torch.cuda.get_device_name(device)}, Triton {triton.__version__}, torch {torch.__version__}")

    def launch(streams, maxnreg=None, block=64, warps=4):
        extra = {} if maxnreg is None else dict(maxnreg=maxnreg)
        for stream in streams:
            grid = (1, triton.cdiv(TOKENS, block), 2 * KV_HEADS if stream == 3 else KV_HEADS)
            triton_write._write_kernel[grid](
                k, v, k_rot, rotation, 0, mean, pieces.pieces, pieces.mean_rotated, batch.slots, batch.cu_new,
                batch.lengths, batch.block_table, batch.block_table.stride(0), layer.num_pages, *pages,
                layer.sink_k, layer.sink_v, layer.ring_k, layer.ring_v, k, 1, 0.0, 0.0, 0.0, 0.0,
                HKV=KV_HEADS, D=HEAD_DIM, NG=layout.groups, K_BITS=2, V_BITS=2, P=layout.page_size,
                S=layout.sink_tokens, R=layout.recent_tokens, CLIP_K=triton_write.clip_rank(0.96, HEAD_DIM),
                CLIP_V=triton_write.clip_rank(0.92, HEAD_DIM), SHIFT=16, ROTATE=2, CENTER=True, BLOCK_T=block,
                KEY_SHIFTS=False, SHIFT_BLOCK=1, STREAM=stream, enable_fp_fusion=False, num_warps=warps, **extra)

    def outputs(*config):
        for t in stored:
            t.zero_()
        launch(*config)
        return [t.clone() for t in stored]

    shipped = outputs((3,), triton_write.PROMPT_WRITE_REGISTERS)
    for name, config in (("two launches (STREAM 0, 1)", ((0, 1),)), ("one program for both (STREAM 2)", ((2,),))):
        print(f"{name} stores the same bytes as the shipped launch:",
              all(torch.equal(a, b) for a, b in zip(shipped, outputs(*config))))

    configs = {"keys launch (STREAM 0)": ((0,),), "values launch (STREAM 1)": ((1,),),
               "both, one launch by program (shipped)": ((3,), triton_write.PROMPT_WRITE_REGISTERS),
               "both, one launch by program, no cap": ((3,),),
               "both, two launches": ((0, 1),), "both, one program (STREAM 2)": ((2,),),
               "both, one program, 168 registers": ((2,), 168),
               "keys, 128-token blocks, 8 warps": ((0,), None, 128, 8),
               "keys, 32-token blocks, 2 warps": ((0,), None, 32, 2),
               "values, 128-token blocks, 8 warps": ((1,), None, 128, 8)}
    for round_ in range(2):
        for name, config in configs.items():
            us = triton.testing.do_bench(lambda: launch(*config), warmup=25, rep=300) * 1e3
            print(f"round {round_}: {name:34s} {us:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
