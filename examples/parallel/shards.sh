#!/usr/bin/env bash
# kvrun batch in N shards on one multi-core machine with GNU parallel, each
# shard with T threads (N × T ≈ the core count), then one report:
#
#   examples/parallel/shards.sh MODEL INPUT OUTDIR [N] [T] [-- more kvrun batch flags]
#   examples/parallel/shards.sh models/SmolLM2-135M-Instruct.Q4_1.gguf gsm8k_test.jsonl results 4 2 -- --max-tokens 256
#
# Each job's index is GNU parallel's PARALLEL_SEQ (--shard auto), the count is
# --shards N; -N0 runs the command N times without inserting arguments.
# Rerunning the same command resumes every shard (--resume).
set -euo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,11p' "$0" >&2
  exit 2
fi
model=$1 input=$2 out=$3
shift 3
n=4 t=1
if [ $# -gt 0 ] && [ "$1" != "--" ]; then n=$1; shift; fi
if [ $# -gt 0 ] && [ "$1" != "--" ]; then t=$1; shift; fi
[ "${1:-}" = "--" ] && shift
kvrun=${KVRUN:-kvrun}
mkdir -p "$out"
# a shard with failed lines exits 1 after finishing the rest: let the
# others finish too, report what was done, then pass the failure on
status=0
seq "$n" | parallel --will-cite -q -N0 -j "$n" \
  "$kvrun" batch -m "$model" -t "$t" -i "$input" \
  -o "$out/records.{shard}.jsonl" --summary "$out/summary.{shard}.json" \
  --shard auto --shards "$n" --resume "$@" || status=$?
"$kvrun" batch report "$out"/records.*.jsonl --out "$out/report"
exit "$status"
