#!/usr/bin/env bash
# Build what scripts/gpu-check.sh runs, on a machine with Rust and nvcc but
# no GPU, into gpu-pack/ (git-ignored; under 64 MiB): the kvrun binary and
# the CUDA test binary (stripped, gzipped) and the R1-Distill header GGUF
# the synthetic models are made from.
#
#   KVRUN_NVCC=/path/to/nvcc bash scripts/gpu-pack.sh [HEADER.gguf]
set -euo pipefail
cd "$(dirname "$0")/.."
header=${1:-../shared/data/r1-distill-qwen-7b.header.gguf}
[ -f "$header" ] || { echo "gpu-pack: no header GGUF at $header" >&2; exit 1; }
export KVRUN_REQUIRE_NVCC=1
# The GPU machine's CPU is not this one: build for any x86-64 with AVX2
# (kvrun's own wider kernels are chosen at run time; this also keeps
# llama.cpp's ggml from being built for this CPU with GGML_NATIVE), in a
# target directory of its own.
export RUSTFLAGS="-C target-cpu=${KVRUN_PACK_CPU:-x86-64-v3}"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/portable}
cargo build --release
exe=$(cargo test --release --test cuda --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda":
        print(m["executable"])')
[ -n "$exe" ] || { echo "gpu-pack: the cuda test binary was not built" >&2; exit 1; }
rm -rf gpu-pack && mkdir -p gpu-pack
strip -o gpu-pack/kvrun "$CARGO_TARGET_DIR/release/kvrun"
strip -o gpu-pack/cuda-tests "$exe"
gzip -9 gpu-pack/kvrun gpu-pack/cuda-tests
cp "$header" gpu-pack/header.gguf
du -sh gpu-pack
