"""Developer tool (CPU, Triton interpreter; or a GPU): how far the decode/prefill attention kernels are from exact
attention on keys and values with outliers, beside BF16 and FP16 SDPA over the same stored contents.

    TRITON_INTERPRET=1 PYTHONPATH=src python scripts/probe_outlier_precision.py [--bf16-queries] [--outliers k]

The data is `test_clip_threshold_far_below_outliers`'s: keys and values neither rotated nor centered, about 2 in
100 entries 40 times the rest. Every attention reads the same stored history (INT2 codes, scales, zeros) and
windows; "exact" is float64 attention over them. Queries are float32 by default, so that the outputs are float32;
with --bf16-queries the outputs are bfloat16, as a bfloat16 model's are, and their rounding shows too.
--outliers k (or v): only the keys (or the values) get them."""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from paged_helpers import PagedRun, random_step  # noqa: E402
from test_kernels import SMALL, _with_outliers  # noqa: E402

from oscarkv.cache.paged import PagedLayout  # noqa: E402
from oscarkv.kernels import reference  # noqa: E402
from oscarkv.kernels.ops import attend_step, write_step  # noqa: E402


QK_SCALE = 128 ** -0.5 * 1.4426950408889634  # the softmax scale, base 2, that the kernels folded into the queries
# before 876a30a


def attention_over_stored(layer, batch, q, k_rot, v, scale, dtype, sdpa: bool) -> torch.Tensor:
    """[T, Hq, D] float64: attention of the step's queries over the stored keys and values and the step's own,
    the operands in `dtype` (torch SDPA on them if `sdpa`, else a plain softmax in that dtype)."""
    hq, hkv = q.shape[1], layer.layout.kv_heads
    outs, cu = [], batch.cu_new.tolist()
    for b, (slot, old) in enumerate(zip(batch.slots.tolist(), batch.lengths.tolist())):
        n = cu[b + 1] - cu[b]
        keys, values = reference.stored_kv_reference(layer, batch.block_table, slot, old,
                                                     layer.layout.history_end(old + n))
        fresh = slice(cu[b], cu[b + 1])
        keys = torch.cat([keys, k_rot[fresh].transpose(0, 1).float()], dim=1).repeat_interleave(hq // hkv, 0)
        values = torch.cat([values, v[fresh].to(layer.ring_v.dtype).transpose(0, 1).float()],
                           dim=1).repeat_interleave(hq // hkv, 0)
        queries = q[fresh].float().transpose(0, 1)
        positions = torch.arange(old + n, device=keys.device)
        visible = positions[None, :] <= positions[old:, None]
        if sdpa:
            o = torch.nn.functional.scaled_dot_product_attention(
                queries.to(dtype)[None], keys.to(dtype)[None], values.to(dtype)[None], attn_mask=visible,
                scale=scale)[0]
        else:
            s = (queries.to(dtype) @ keys.to(dtype).transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
            o = torch.softmax(s, -1) @ values.to(dtype)
        outs.append(o.transpose(0, 1).double().cpu())
    return torch.cat(outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bf16-queries", action="store_true")
    parser.add_argument("--outliers", choices=("kv", "k", "v"), default="kv", help="which of keys and values get them")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layout = PagedLayout(kv_heads=2, head_dim=128, group_size=128, **SMALL)
    runs = {backend: PagedRun(layout, 2, 1024, 4, backend, device=device, center=False, rotate=False)
            for backend in ("triton", "torch")}
    g = torch.Generator().manual_seed(7)
    scale = layout.head_dim ** -0.5
    for new_tokens in ([140, 40], [1, 1], [1, 1]):
        q, k, v = random_step(layout, 4, new_tokens, g, dtype=torch.bfloat16, device=device)
        k = _with_outliers(k) if "k" in args.outliers else k
        v = _with_outliers(v) if "v" in args.outliers else v
        q = q if args.bf16_queries else q.float()
        out = {}
        for backend, run in runs.items():
            batch = run.cache.step(run.slots, new_tokens)
            k_rot = write_step(run.layer, batch, k, v, run.rotation, run.mean, run.clip_k, run.clip_v,
                               backend=backend)
            out[backend] = attend_step(run.layer, batch, q, k_rot, v, scale, 0, backend=backend).double().cpu()
        layer = runs["torch"].layer
        exact = attention_over_stored(layer, batch, q, k_rot, v, scale, torch.float64, False)
        gaps = {"kernel": out["triton"], "torch reference": out["torch"],
                "BF16 SDPA": attention_over_stored(layer, batch, q, k_rot, v, scale, torch.bfloat16, True),
                "FP16 SDPA": attention_over_stored(layer, batch, q, k_rot, v, scale, torch.float16, True),
                # exact attention, with the queries rounded as the kernels rounded them before 876a30a: times the
                # softmax scale (base 2), then to float16
                "exact, queries rounded as before 876a30a": attention_over_stored(
                    layer, batch, ((q.double() * QK_SCALE).half().double() / QK_SCALE).to(q.dtype), k_rot, v, scale,
                    torch.float64, False)}
        print(f"step {new_tokens}: largest |output| {exact.abs().max():.3g}; max abs difference from exact: "
              + ", ".join(f"{name} {(o - exact).abs().max():.3g}" for name, o in gaps.items()), flush=True)


if __name__ == "__main__":
    main()
