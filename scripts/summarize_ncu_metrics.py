"""Developer tool: one line per profiled launch from Nsight Compute's raw CSV page (`ncu -i REP --page raw --csv`, as
scripts/ncu_history_plans.sh writes it): grid, time, SM clock, warp instructions, instructions per scheduler and
cycle, warps per scheduler, the ALU, FMA and tensor (mma) pipes' busy share, and the largest warp-stall reasons
(Nsight's warps stalled for that reason per cycle with an issue, 'selected' being the issuing warp itself).

    python scripts/summarize_ncu_metrics.py history-plans.csv [mix-ipc.csv ...]
"""

from __future__ import annotations

import csv
import sys

COLUMNS = [("grid", "Grid Size"), ("us", "gpu__time_duration.sum"), ("GHz", "sm__cycles_elapsed.avg.per_second"),
           ("instructions", "smsp__inst_executed.sum"), ("IPC", "smsp__inst_executed.avg.per_cycle_active"),
           ("warps", "smsp__warps_active.avg.per_cycle_active"),
           ("ALU%", "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active"),
           ("FMA%", "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"),
           ("tensor%", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
           ("DRAM%", "dram__throughput.avg.pct_of_peak_sustained_elapsed")]
STALL = "smsp__average_warps_issue_stalled_"


def number(text: str) -> float:
    return float(text.replace(",", "")) if text else 0.0


def summarize(path: str) -> None:
    rows = list(csv.reader(open(path)))
    header = rows[0]
    print(f"== {path}")
    for row in rows[2:]:  # the second row holds the units
        cells = []
        for name, metric in COLUMNS:
            if metric in header:
                value = row[header.index(metric)]
                if name == "us":
                    unit = rows[1][header.index(metric)]
                    scale = {"ms": 1e3, "msecond": 1e3, "ns": 1e-3, "nsecond": 1e-3}.get(unit, 1)
                    value = f"{number(value) * scale:.1f}"
                elif name == "GHz":
                    value = f"{number(value):.2f}"
                elif name == "instructions":
                    value = f"{number(value) / 1e6:.1f}M"
                elif name != "grid":
                    value = f"{number(value):.3g}"
                cells.append(f"{name} {value}")
        print("  " + " | ".join(cells))
        stalls = sorted(((number(row[i]), h[len(STALL):].split("_per_")[0].split(".")[0])
                         for i, h in enumerate(header) if h.startswith(STALL) and "not_issued" not in h),
                        reverse=True)[:7]
        print("    warps stalled per issue cycle: " + ", ".join(f"{name} {v:.2f}" for v, name in stalls))


if __name__ == "__main__":
    for path in sys.argv[1:]:
        summarize(path)
