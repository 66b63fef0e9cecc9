#!/usr/bin/env bash
# A/B of `oscarkv serve` with the INT2 cache (method hadamard) between two source trees on one machine:
# old, new, old again (if time allows), each a fresh server with scripts/serve_throughput.sh's settings.
# Machine-to-machine spread is larger than most code changes, so compare runs of one call only.
# The load client is always the new tree's; BENCH_ARGS adds options to it (e.g. "--temperature 0.7 --top-p 0.9");
# SEQS sets the servers' --max-seqs (default CLIENTS; with "--choices N" in BENCH_ARGS, CLIENTS × N).
# Usage (GPU machine, fastapi/uvicorn importable, `oscarkv` on PATH running `python3 -m oscarkv.cli`):
#   mkdir old && git archive REV src | tar -x -C old
#   [BENCH_ARGS=...] scripts/serve_ab.sh OUT_DIR old/src src [CLIENTS] [PROMPT_TOKENS] [MAX_TOKENS]
set -uo pipefail
out=${1:?output directory}; old=$(realpath "${2:?old src directory}"); new=$(realpath "${3:?new src directory}")
clients=${4:-32}; prompt=${5:-8192}; gen=${6:-384}; seqs=${SEQS:-$clients}
mkdir -p "$out"; start=$SECONDS; base=${PYTHONPATH:+$PYTHONPATH:}
source "$(dirname "$0")/serve_common.sh"
one() {  # label src
  t0=$SECONDS
  PYTHONPATH=$base$2 start_server "$out/server-$1.log" random:qwen3-4b --method hadamard --max-seqs "$seqs" \
    --max-context $((prompt + gen + 64)) --prefill-chunk 2048
  echo "$1: server ready after $((SECONDS - t0)) s"
  PYTHONPATH=$base$new oscarkv bench serve --url "http://127.0.0.1:8100" --clients "$clients" \
    --prompt-tokens "$prompt" --max-tokens "$gen" --vocab 151936 ${BENCH_ARGS:-} --json > "$out/serve-$1.json"
  python3 -c "import json; d = json.load(open('$out/serve-$1.json')); print('$1: prompts read in', \
round(d['all_started_s'], 2), 's, decode', round(d['decode_tokens_per_s']), 'tokens/s, KV in use', \
round(d['kv_bytes_used_peak'] / 2**30, 2), 'GiB')"
  kill $server; wait $server 2> /dev/null
}
one old1 "$old"
one new1 "$new"
if (( SECONDS - start < 380 )); then one old2 "$old"; fi
