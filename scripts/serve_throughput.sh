#!/usr/bin/env bash
# Decode throughput of `oscarkv serve` on a CUDA GPU: 32 requests of 8K prompt tokens running
# together, the BF16 cache and the paged INT2 cache on the same server code, one after the other.
# Model: random:qwen3-4b (the Qwen3-4B architecture with random weights; speed only).
# INT2 is served with method `hadamard`: the same kernels and bytes as `oscar` (only the rotation
# matrices differ, and a random-weight model has nothing to calibrate).
# Usage: scripts/serve_throughput.sh OUT_DIR [CLIENTS] [PROMPT_TOKENS] [MAX_TOKENS]
set -euo pipefail
out=${1:?output directory}; clients=${2:-32}; prompt=${3:-8192}; gen=${4:-512}
mkdir -p "$out"
source "$(dirname "$0")/serve_common.sh"
for method in bf16 hadamard; do
  start_server "$out/server-$method.log" random:qwen3-4b --method "$method" --max-seqs "$clients" \
    --max-context $((prompt + gen + 64)) --prefill-chunk 2048
  oscarkv bench serve --url "http://127.0.0.1:8100" --clients "$clients" --prompt-tokens "$prompt" \
    --max-tokens "$gen" --vocab 151936 --json | tee "$out/serve-throughput-$method.json"
  kill $server; wait $server || true
done
