#!/usr/bin/env bash
# Writes docker/requirements-gpu.txt, the GPU image's Python packages (Dockerfile):
#   1. resolves pyproject.toml's dependencies with the vllm extra, plus docker/requirements-gpu.in,
#      for CPython PYTHON_VERSION (the Dockerfile's ARG) on x86_64 Linux, from PyPI, with uv:
#      every package pinned, with its hashes;
#   2. appends the Requires-Dist of the locked torch and vllm wheels (their METADATA on PyPI), which
#      tests/test_image_pins.py checks the lock against (torch's version, one CUDA major).
# Needs network access to PyPI. uv is taken from PATH, else installed from PyPI into a temporary
# folder. Run from anywhere: bash docker/lock-gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=docker/requirements-gpu.txt
PYTHON_VERSION=$(sed -n 's/^ARG PYTHON_VERSION=//p' Dockerfile)
[ -n "$PYTHON_VERSION" ] || { echo "lock-gpu.sh: no ARG PYTHON_VERSION in Dockerfile" >&2; exit 1; }
PLATFORM=manylinux_2_28_x86_64
INDEX=https://pypi.org/simple
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

uv=$(command -v uv || true)
if [ -z "$uv" ]; then
  python3 -m pip install --quiet --target "$tmp/uv" uv
  uv="$tmp/uv/bin/uv"
fi

# uv writes the pins, hashes and "# via" annotations; --no-config: no uv.toml or pip.conf of
# this machine changes the result.
"$uv" pip compile pyproject.toml docker/requirements-gpu.in --extra vllm \
  --python-version "$PYTHON_VERSION" --python-platform "x86_64-${PLATFORM%_x86_64}" \
  --index-url "$INDEX" --no-config --generate-hashes --annotation-style split \
  --custom-compile-command "bash docker/lock-gpu.sh" --quiet -o "$tmp/lock.txt"

pinned() { sed -n "s/^$1==\([^ ]*\) .*/\1/p" "$tmp/lock.txt"; }
torch=$(pinned torch)
vllm=$(pinned vllm)
# The two wheels' METADATA, from PyPI's metadata files (PEP 658): nothing is downloaded whole.
python3 -m pip --isolated install --quiet --dry-run --ignore-installed --no-deps \
  --only-binary=:all: --platform "$PLATFORM" --python-version "$PYTHON_VERSION" \
  --implementation cp --target "$tmp/target" --index-url "$INDEX" \
  --report "$tmp/report.json" "torch==$torch" "vllm==$vllm"
{
  cat "$tmp/lock.txt"
  echo "#"
  echo "# Requires-Dist of the locked wheels that carry CUDA code (their METADATA on PyPI, $PLATFORM):"
  python3 - "$tmp/report.json" <<'PY'
import json
import sys

for item in json.load(open(sys.argv[1]))["install"]:
    meta = item["metadata"]
    print(f"# wheel {meta['name']}=={meta['version']}: {item['download_info']['url'].rsplit('/', 1)[1]}")
    for requirement in meta.get("requires_dist", []):
        print(f"# requires-dist {meta['name']}=={meta['version']}: {requirement}")
PY
} >"$OUT"
echo "lock-gpu.sh: wrote $OUT (torch $torch, vllm $vllm, Python $PYTHON_VERSION)"
