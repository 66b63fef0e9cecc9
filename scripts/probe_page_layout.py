"""Developer tool (GPU): how fast can the decode kernel's history bytes be read at all, in the cache's layout and in
a layout that keeps each (page, KV head) in one block?

The decode attention reads, per history page and KV head, 2 KB of key codes and 2 KB of value codes from two pools
and four 128-byte rows of float16 scales and zeros from four more (`PagedLayer`, INT2, group 128, D 128). This
tool times a kernel that only reads those bytes (and sums them, so that the loads stay), with the decode kernel's
program plan for the shape (one-warp programs, the same history splits, 3 pipeline stages, 2 pages per loop step
where the kernel takes 2), over:

- `pools`: the cache's own tensors and block table (`benchmarks.attention.decode_case`);
- `blocks`: the same bytes repacked so that each (page, KV head) is one 4,608-byte block: key codes, value codes,
  then the four parameter rows;
- `pools, shuffled` / `blocks, shuffled`: the same with the pages of every sequence in a random order.

Beside them: the decode step itself (`ops.attend_step`, all its launches) and the same number of bytes read as
one contiguous stream by the same kernel shape. Each as CUDA-graph replays, best of three; bandwidth against the
measured device-to-device copy bandwidth (read + write bytes / time of a 2 GiB copy).

`--plans` also reads the pools with other program plans, each `SPLITSxWARPSxSTAGESxSTEP` (history splits per
(sequence, KV head), warps per program, pipeline stages, pages per loop step): which plan could stream a step's
history at the bandwidth a plain read of the same bytes reaches (`benchmarks.stream_read`).

    PYTHONPATH=src python scripts/probe_page_layout.py [--shapes 32x32768,1x131072] [--plans 264x1x3x1,132x4x4x2]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from oscarkv.benchmarks.attention import _time_us, copy_bandwidth_gbs, decode_case
from oscarkv.kernels.ops import attend_step, choose_row_groups, choose_splits, window_plan

BLOCK_WORDS = 2304  # int16 words of one (page, KV head) block: 1024 + 1024 code words, 4 x 64 parameters


@triton.jit
def _read_history(bt_ptr, bt_stride, pages, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, block_ptr, out_ptr,
                  HKV: tl.constexpr, P: tl.constexpr, W: tl.constexpr, SPLITS: tl.constexpr, STEP: tl.constexpr,
                  BLOCKS: tl.constexpr):
    """Sum of every history code word and parameter of (sequence, KV head) program_id(0)'s split program_id(1)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // HKV
    h = pid % HKV
    share = tl.cdiv(pages, SPLITS)
    lo = split * share
    hi = tl.minimum(lo + share, pages)
    rows = tl.arange(0, P)
    words = rows[:, None] * W + tl.arange(0, W)[None, :]
    acc = tl.zeros([P, W], tl.int32)
    params = tl.zeros([P], tl.float32)
    for base in range(lo, hi, STEP):
        for a in tl.static_range(STEP):
            index = base + a
            page = tl.load(bt_ptr + b * bt_stride + index, mask=index < hi, other=0)
            block = page.to(tl.int64) * HKV + h
            if BLOCKS:
                start = block_ptr + block * (2 * P * W + 4 * P)
                k = tl.load(start + words)
                v = tl.load(start + P * W + words)
                p = (tl.load(start + 2 * P * W + rows).to(tl.float16, bitcast=True).to(tl.float32)
                     + tl.load(start + 2 * P * W + P + rows).to(tl.float16, bitcast=True).to(tl.float32)
                     + tl.load(start + 2 * P * W + 2 * P + rows).to(tl.float16, bitcast=True).to(tl.float32)
                     + tl.load(start + 2 * P * W + 3 * P + rows).to(tl.float16, bitcast=True).to(tl.float32))
            else:
                row0 = block * P
                k = tl.load(kc_ptr + row0 * W + words)
                v = tl.load(vc_ptr + row0 * W + words)
                p = (tl.load(ks_ptr + row0 + rows).to(tl.float32) + tl.load(kz_ptr + row0 + rows).to(tl.float32)
                     + tl.load(vs_ptr + row0 + rows).to(tl.float32) + tl.load(vz_ptr + row0 + rows).to(tl.float32))
            acc += tl.where(index < hi, (k ^ v).to(tl.int32), 0)
            params += tl.where(index < hi, p, 0.0)
    tl.store(out_ptr + pid * SPLITS + split, tl.sum(tl.sum(acc, 1), 0).to(tl.float32) + tl.sum(params, 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="32x32768,1x131072")
    parser.add_argument("--plans", default="", help="more plans for the pools' read: SPLITSxWARPSxSTAGESxSTEP,...")
    args = parser.parse_args()
    plans = [tuple(int(x) for x in plan.split("x")) for plan in args.plans.split(",") if plan]
    device = torch.device("cuda")
    copy = copy_bandwidth_gbs(device)
    print(f"{torch.cuda.get_device_name(device)}, copy bandwidth {copy:.0f} GB/s")
    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        case = decode_case(batch, context)
        layer, step, lay = case.layer, case.step, case.layer.layout
        splits = choose_splits(layer, batch, 1, 32, context, device)
        plan = window_plan(layer, batch, 1, 32, splits, context, device)
        history_splits = splits - plan.splits
        pages = lay.pages_needed(context)
        row_groups = choose_row_groups(layer, 1, 32, splits, plan.splits, context)
        heads, p, w = lay.kv_heads, lay.page_size, lay.key_code_bytes // 2
        codes16 = [t.view(torch.int16) for t in (layer.k_codes, layer.v_codes)]
        used = step.block_table[:, :pages].contiguous()
        # (page, head) blocks of the same bytes, in the same page ids
        blocks = torch.cat([codes16[0].reshape(-1, heads, p * w), codes16[1].reshape(-1, heads, p * w),
                            *(t.view(torch.int16).reshape(-1, heads, p) for t in
                              (layer.k_scale, layer.k_zero, layer.v_scale, layer.v_zero))], dim=2).contiguous()
        assert blocks.shape[2] == BLOCK_WORDS
        gen = torch.Generator(device="cpu").manual_seed(0)
        shuffled = torch.stack([row[torch.randperm(pages, generator=gen).to(device)] for row in used])
        # one contiguous stream: sequence b's pages are ids b*pages .. b*pages + pages - 1 of a block array
        stream_table = torch.arange(batch * pages, dtype=torch.int32, device=device).reshape(batch, pages)
        stream = torch.zeros(batch * pages, heads, BLOCK_WORDS, dtype=torch.int16, device=device)
        out = torch.empty(batch * heads * max([history_splits] + [plan[0] for plan in plans]), dtype=torch.float32,
                          device=device)
        nbytes = batch * heads * pages * BLOCK_WORDS * 2

        def reader(table, block_tensor, use_blocks, splits=history_splits, warps=1, stages=3, step=row_groups):
            def run():
                _read_history[(batch * heads, splits)](
                    table, table.stride(0), pages, *codes16, layer.k_scale, layer.k_zero, layer.v_scale,
                    layer.v_zero, block_tensor, out, HKV=heads, P=p, W=w, SPLITS=splits, STEP=step,
                    BLOCKS=use_blocks, num_warps=warps, num_stages=stages)
            return run

        q, k, v = case.q, case.k_new, case.v_new
        attention_out = torch.empty_like(q)
        workspace = (torch.empty(batch, 32, splits, 128, device=device), torch.empty(batch, 32, splits, device=device))

        def decode_step():
            attend_step(layer, step, q, k, v, 128 ** -0.5, num_splits=splits, out=attention_out, workspace=workspace,
                        validate=False)

        runs = {"decode step (all launches; more bytes: windows, queries)": decode_step,
                "read, pools": reader(used, blocks, False), "read, blocks": reader(used, blocks, True),
                "read, pools, shuffled": reader(shuffled, blocks, False),
                "read, blocks, shuffled": reader(shuffled, blocks, True),
                "read, one contiguous stream": reader(stream_table, stream, True)}
        for splits_, warps, stages, step_ in plans:
            runs[f"read, pools: {splits_} splits, {warps} warps, {stages} stages, {step_} pages a step"] = reader(
                used, blocks, False, splits_, warps, stages, step_)
        print(f"{shape}: {history_splits} history splits x {batch * heads} (sequence, KV head), {pages} pages, "
              f"{row_groups} per loop step; history bytes {nbytes / 1e6:.1f} MB")
        for name, fn in runs.items():
            fn()
            us = min(_time_us(fn) for _ in range(3))
            print(f"  {name:<58} {us:8.1f} us  {nbytes / us / 1e3 / copy:6.1%} of copy", flush=True)


if __name__ == "__main__":
    main()
