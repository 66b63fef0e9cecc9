#!/usr/bin/env bash
# Developer tool (GPU): where the Gluon decode history kernel's warps wait, per SASS instruction. Nsight Compute
# (its warp-state sampling, SourceCounters) on the first LAUNCHES (default 5) history launches of a probe at one
# shape, its eager error runs: by default probe_score_chains.py --reads (the shipped kernel with 2 slots, then its
# copies alone, no arithmetic, with 2, 3, 4 and 6 slots); PROBE="probe_dual_streams.py --splits plan" LAUNCHES=2 the
# shipped kernel and the two-stream variant. Writes, under OUT (default .): history-stalls.txt (each launch's
# warp-state section) and history-stalls-N.csv (launch N's SASS lines with their stall samples), which
# scripts/summarize_history_stalls.py reads.
#   PYTHONPATH=src:scripts OUT=/tmp/o bash scripts/ncu_history_stalls.sh 1x131072
set -euo pipefail
shape=${1:-1x131072}
out=${OUT:-.}
ncu=${NCU:-ncu}
launches=${LAUNCHES:-5}
probe=${PROBE:-probe_score_chains.py --reads}
"$ncu" --kernel-name regex:history_kernel --launch-count "$launches" --import-source no \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters -f -o "$out/history-stalls" \
  python scripts/$probe "$shape" --rounds 1 > "$out/history-stalls-run.txt" 2>&1 || true
"$ncu" -i "$out/history-stalls.ncu-rep" --page details --print-details all > "$out/history-stalls.txt" 2>&1 || true
for n in $(seq 0 $((launches - 1))); do
  "$ncu" -i "$out/history-stalls.ncu-rep" --page source --csv --print-source sass --launch-skip "$n" --launch-count 1 \
    > "$out/history-stalls-$n.csv" 2>&1 || true
done
