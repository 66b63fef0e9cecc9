#!/usr/bin/env bash
# Developer tool (GPU): issue rate, pipes and warp states of the Gluon decode history kernel by history plan, and of
# the score-dot instruction mix alone (scripts/probe_mix_ipc.py), under Nsight Compute at the clocks the driver
# sets (--clock-control none). Writes under OUT (default .): history-plans.csv (the history launches of
# probe_batch1_splits.py --once: 1x128K with the shipped 132, 198 and 264 history splits a KV head, then 32x32K
# shipped) and mix-ipc.csv (probe_mix_ipc.py --once), Nsight's raw page, one row a launch.
#   PYTHONPATH=src:scripts OUT=/tmp/o NCU=/usr/local/cuda/bin/ncu bash scripts/ncu_history_plans.sh
set -euo pipefail
out=${OUT:-.}
reports=${REPORTS:-$(mktemp -d)}  # the .ncu-rep files (not needed once the CSVs are written)
ncu=${NCU:-ncu}
metrics=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,smsp__inst_executed.sum
metrics=$metrics,smsp__inst_executed.avg.per_cycle_active,smsp__issue_active.avg.pct_of_peak_sustained_active
metrics=$metrics,smsp__warps_active.avg.per_cycle_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active
metrics=$metrics,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active
metrics=$metrics,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
metrics=$metrics,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active
metrics=$metrics,dram__throughput.avg.pct_of_peak_sustained_elapsed
run() {  # run NAME KERNEL-REGEX COMMAND...
  local name=$1 kernel=$2
  shift 2
  "$ncu" --kernel-name "regex:$kernel" --clock-control none --section WarpStateStats --metrics "$metrics" \
    -f -o "$reports/$name" "$@" > "$out/$name-run.txt" 2>&1 || true
  "$ncu" -i "$reports/$name.ncu-rep" --page raw --csv > "$out/$name.csv" 2>&1 || true
}
run history-plans history_kernel python scripts/probe_batch1_splits.py --once --shapes 1x131072 --splits 198,264
run history-plans-32 history_kernel python scripts/probe_batch1_splits.py --once --shapes 32x32768 --splits ""
run mix-ipc _mix_kernel python scripts/probe_mix_ipc.py --once --iters 2000
