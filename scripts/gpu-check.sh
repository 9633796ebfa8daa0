#!/usr/bin/env bash
# The CUDA backend on a GPU machine that has the NVIDIA driver but no Rust
# toolchain: runs what scripts/gpu-pack.sh built (gpu-pack/ next to the
# repository's files) and prints a short table last; each step has a time
# limit, the whole run stays under 8 minutes (logs in $OUT or /tmp/kvrun-gpu).
#
#   bash scripts/gpu-check.sh            # every step
#   KVRUN_GPU_BENCH_7B=0 bash scripts/gpu-check.sh   # skip the 7B bench
#   KVRUN_GPU_CHECK_DEVICE=cpu KVRUN_GPU_SMALL=1 bash scripts/gpu-check.sh
#                                       # the script's own dry run, no GPU
#
# 1. the parity tests (tests/cuda.rs: every kernel against the CPU on fresh
#    random data, attention over every store and layout, a synthetic model
#    decoded greedily on both backends, with and without eviction);
# 2. a one-shot greedy decode of 64 tokens on a synthetic model, CPU and GPU;
# 3. kvrun bench --device cuda on synthetic R1-Distill shapes (decode t/s
#    against the measured device read bandwidth), and at depth with a
#    budget (window, h2o, snapkv, epikv) against the full cache.
set -uo pipefail
cd "$(dirname "$0")/.."
pack=${KVRUN_GPU_PACK:-gpu-pack}
out=${OUT:-/tmp/kvrun-gpu}
mkdir -p "$out" "$pack/bin"
for f in kvrun cuda-tests; do
  gunzip -c "$pack/$f.gz" > "$pack/bin/$f" && chmod +x "$pack/bin/$f"
done
bin=$pack/bin/kvrun
header=$(realpath "$pack/header.gguf")
dev=${KVRUN_GPU_CHECK_DEVICE:-cuda}
require=1
if [ "$dev" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
else
  require=0
fi
# the dry run's sizes
if [ "${KVRUN_GPU_SMALL:-0}" = 1 ]; then pp=16 tg=8 depth=256 budget=64 reps=1; else
  pp=512 tg=128 depth=32768 budget=4096 reps=3; fi
declare -a rows
step() { # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name: $*"
  if timeout "$limit" "$@" > "$out/$name.log" 2>&1; then r=ok; else r="FAILED ($?)"; fi
  tail -n 25 "$out/$name.log"
  rows+=("| $name | $r | $((SECONDS - t0)) s |")
}

step parity 240 env KVRUN_REQUIRE_GPU=$require KVRUN_SYNTH_HEADER="$header" \
  "$pack/bin/cuda-tests" --test-threads 1 --nocapture
tiny="synth:$header:tiny"
greedy() { "$bin" -m "$tiny" -p "x" --raw -n 64 --temp 0 --ignore-eos -t 8 "$@"; }
step greedy-cpu 60 sh -c "$(declare -f greedy); bin='$bin' tiny='$tiny'; greedy > '$out/greedy-cpu.txt'"
step greedy-gpu 60 sh -c "$(declare -f greedy); bin='$bin' tiny='$tiny'; greedy --device $dev > '$out/greedy-gpu.txt'"
if cmp -s "$out/greedy-cpu.txt" "$out/greedy-gpu.txt" && [ -s "$out/greedy-cpu.txt" ]; then
  rows+=("| greedy 64 tokens CPU = GPU | ok | - |")
else
  rows+=("| greedy 64 tokens CPU = GPU | DIFFERENT | - |")
fi
q15="synth:$header:r1-distill-qwen-1.5b:Q8_0"
step bench-1.5b-q8 120 "$bin" bench -m "$q15" --device "$dev" -p $pp -n $tg -r $reps -t 16 --no-llama
step bench-1.5b-depth 300 "$bin" bench -m "$q15" --device "$dev" -p 0 -n 64 -r 2 -d $depth \
  --policy full,window,h2o,snapkv,epikv --kv-budget $budget -t 16 --no-llama
if [ "${KVRUN_GPU_BENCH_7B:-1}" = 1 ]; then
  step bench-7b-q4km 200 "$bin" bench -m "synth:$header:Q4_K_M" --device "$dev" -p $pp -n $tg -r $reps -t 16 --no-llama
fi

echo
echo "| step | result | time |"
echo "| --- | --- | ---: |"
printf '%s\n' "${rows[@]}"
for f in "$out"/bench-*.log; do
  [ -f "$f" ] && { echo; echo "$(basename "$f" .log):"; grep -E '^\|.*kvrun|bandwidth|roofline' "$f"; }
done
