#!/usr/bin/env bash
# Developer tool (GPU): Nsight Compute's pipe use and stall reasons for the Gluon decode history launch, one launch of
# each variant that scripts/probe_gluon_history.py takes (gluon, gluon@3, gluon~N, ...; the sixtieth session's ablation
# variants need docs/data/history-ablation-variant.patch applied), clocks as the driver sets them:
#   PYTHONPATH=src bash scripts/ncu_history_variants.sh 32x32768 gluon,gluon@3
base=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,launch__registers_per_thread,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__warps_active.avg.per_cycle_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fmaheavy_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_uniform.avg.pct_of_peak_sustained_active
stalls=""
for s in wait math_pipe_throttle not_selected selected short_scoreboard long_scoreboard dispatch_stall mio_throttle lg_throttle barrier no_instruction branch_resolving imc_miss; do
  stalls="$stalls,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio"
done
ncu --clock-control none --kernel-name regex:history_kernel --launch-count 8 --metrics "$base$stalls" \
  python scripts/probe_gluon_history.py ncu "$1" "$2" 2>&1 | grep -v -E "^==PROF==|Warning|WARNING"
