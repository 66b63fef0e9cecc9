"""Developer tool (GPU): where the window launch's time goes in one layer's decode step (`ops.attend_step`, the
shipped plan): windows launched second and merging the splits (shipped), second with a combine launch, first with a
combine launch, the window programs merging however many splits and window splits the plan has (`forced_merge`:
launch_attention's merge=True past `merges_in_windows`' limits, e.g. batch 1's 136 splits), and no window launch at
all (history and combine only: a wrong answer); alternating, best of three CUDA-graph timings, µs, % of the copy
bandwidth and the max abs error against the reference. Qwen3 shapes (32 query / 8 KV heads, D 128).

    PYTHONPATH=src:scripts python scripts/probe_window_launch.py 32x32768,64x8192"""
import sys

import torch

from oscarkv.benchmarks.attention import copy_bandwidth_gbs, decode_bytes
from oscarkv.kernels import triton_attention
from probe_window_plans import best_of_rounds, layer_case, step

SHIPPED_LAUNCH = triton_attention.launch_attention
SHIPPED_KERNEL = triton_attention._paged_attention_kernel
VARIANTS = {"merged": {}, "combine": dict(merge=False), "windows_first": dict(merge=False, window_first=True),
            "forced_merge": dict(merge=True), "no_windows": dict(merge=False)}


class _NoWindows:
    def __getitem__(self, grid):
        return lambda *args, **kw: None if kw.get("REGIONS") == 2 else SHIPPED_KERNEL[grid](*args, **kw)


def variant(name: str, run):
    """`run` with launch_attention's options of VARIANTS[name] (and, for no_windows, the window launch skipped)."""
    def fn():
        triton_attention.launch_attention = lambda *a, **kw: SHIPPED_LAUNCH(*a, **{**kw, **VARIANTS[name]})
        if name == "no_windows":
            triton_attention._paged_attention_kernel = _NoWindows()
        try:
            run()
        finally:
            triton_attention.launch_attention = SHIPPED_LAUNCH
            triton_attention._paged_attention_kernel = SHIPPED_KERNEL
    return fn


def main() -> None:
    copy = copy_bandwidth_gbs(torch.device("cuda"))
    for spec in sys.argv[1].split(","):
        case, splits, _, ref, out = layer_case(spec)
        run = step(case, out, splits)
        results = best_of_rounds([variant(name, run) for name in VARIANTS], out, ref)
        nbytes = decode_bytes(case, int(spec.split("x")[1]))
        print(f"{spec:>10} splits {splits:3d}: " + "  ".join(
            f"{name} {us:6.1f} us ({nbytes / us / 1e3 / copy:5.1%}, err {err:.0e})"
            for name, (us, err) in zip(VARIANTS, results)), flush=True)
        case = out = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
