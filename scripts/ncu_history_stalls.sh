#!/usr/bin/env bash
# Developer tool (GPU): where the Gluon decode history kernel's warps wait, per SASS instruction. Nsight Compute
# (its warp-state sampling, SourceCounters) on the first LAUNCHES (default 5) history launches of a probe at one
# shape, its eager error runs: by default probe_score_chains.py --reads (the shipped kernel with 2 slots, then its
# copies alone, no arithmetic, with 2, 3, 4 and 6 slots); PROBE="probe_dual_streams.py --splits plan" LAUNCHES=2 the
# shipped kernel and the two-stream variant. Writes, under OUT (default .): history-stalls.txt (each launch's
# warp-state section) and history-stalls-N.csv (launch N's SASS lines with their stall samples), which
# scripts/summarize_history_stalls.py reads.
# PIPES=1 also collects each pipe's share of its peak (the sm__pipe_* and sm__inst_executed_pipe_* metrics) and the
# instruction mix (InstructionStats), printed on the details page. NATIVE_CLOCKS=1: the clocks as the driver sets them
# (--clock-control none; by default Nsight Compute locks the SMs at their base clock, 1.35 GHz on the H200, at which
# memory weighs less against the instructions than at the 1.98 GHz the kernel runs at).
#   PYTHONPATH=src:scripts OUT=/tmp/o bash scripts/ncu_history_stalls.sh 1x131072
set -euo pipefail
shape=${1:-1x131072}
out=${OUT:-.}
ncu=${NCU:-ncu}
launches=${LAUNCHES:-5}
probe=${PROBE:-probe_score_chains.py --reads}
extra=()
if [ "${PIPES:-0}" = 1 ]; then
  pipes=sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active
  pipes=$pipes,sm__pipe_fmaheavy_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
  pipes=$pipes,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active
  pipes=$pipes,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_uniform.avg.pct_of_peak_sustained_active
  pipes=$pipes,sm__inst_executed_pipe_adu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_cbu.avg.pct_of_peak_sustained_active
  pipes=$pipes,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__warps_active.avg.per_cycle_active
  extra=(--section InstructionStats --section ComputeWorkloadAnalysis --metrics "$pipes")
fi
[ "${NATIVE_CLOCKS:-0}" = 1 ] && extra+=(--clock-control none)
"$ncu" --kernel-name regex:history_kernel --launch-count "$launches" --import-source no \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters "${extra[@]}" -f -o "$out/history-stalls" \
  python scripts/$probe "$shape" --rounds 1 > "$out/history-stalls-run.txt" 2>&1 || true
"$ncu" -i "$out/history-stalls.ncu-rep" --page details --print-details all > "$out/history-stalls.txt" 2>&1 || true
for n in $(seq 0 $((launches - 1))); do
  "$ncu" -i "$out/history-stalls.ncu-rep" --page source --csv --print-source sass --launch-skip "$n" --launch-count 1 \
    > "$out/history-stalls-$n.csv" 2>&1 || true
done
