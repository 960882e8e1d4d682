#!/usr/bin/env bash
# Builds specrl-cpu:latest (docker/Dockerfile.cpu) without Docker Hub, reusing what exists:
#   1. specrl-base:bookworm: a minimal Debian made by `debootstrap` from the Debian mirror the
#      host's apt sources name, then `docker import` (needs root and debootstrap);
#   2. the image's first stage (Debian's Python and Redis), whose Python version the wheels are for;
#   3. build/wheelhouse: every Python dependency as a wheel (`pip wheel` on the host, CPU build
#      of torch 2.13.0; no vLLM), plus requirements.txt, so the image build needs no index;
#   4. the image, `docker build --network host` (apt inside the build reaches the same mirror).
# Environment: DEBIAN_MIRROR (default: from /etc/apt/sources.list*), PYTHON (a Python 3.11 for
# `pip wheel`; default python3), SPECRL_REBUILD_BASE=1 / SPECRL_REBUILD_WHEELS=1 to start over.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=specrl-base:bookworm
IMAGE=specrl-cpu:latest
WHEELS=build/wheelhouse
PYTHON="${PYTHON:-python3}"
now() { date +%s; }
t0=$(now)

# 1. Base image.
if [ "${SPECRL_REBUILD_BASE:-0}" != 1 ] && docker image inspect "$BASE" >/dev/null 2>&1; then
  echo "build-cpu-image: $BASE exists (SPECRL_REBUILD_BASE=1 rebuilds it)"
else
  mirror="${DEBIAN_MIRROR:-}"
  if [ -z "$mirror" ]; then
    mirror=$(grep -hoE 'https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null \
      | head -n 1 | tr -d ' ' || true)
  fi
  [ -n "$mirror" ] || { echo "build-cpu-image: no Debian mirror in /etc/apt/sources.list*; set DEBIAN_MIRROR" >&2; exit 1; }
  command -v debootstrap >/dev/null || { echo "build-cpu-image: debootstrap is missing (apt-get install debootstrap)" >&2; exit 1; }
  root=$(mktemp -d /tmp/specrl-base.XXXXXX)
  trap 'rm -rf "$root"' EXIT
  echo "build-cpu-image: debootstrap bookworm from $mirror"
  debootstrap --variant=minbase bookworm "$root" "$mirror" >"$root.log" 2>&1 \
    || { tail -n 20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
  rm -f "$root.log"
  # As Docker's own Debian images: services that packages install are not started during
  # builds (redis-server's would otherwise start, on the host's network), and apt keeps no cache.
  printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
  chmod +x "$root/usr/sbin/policy-rc.d"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import - "$BASE" >/dev/null
  rm -rf "$root"
  trap - EXIT
  echo "build-cpu-image: $BASE imported ($(($(now) - t0)) s)"
fi

# 2. The image's runtime stage (Debian's Python and Redis), to learn its Python version.
t1=$(now)
docker build -q --force-rm --network host --target runtime -f docker/Dockerfile.cpu -t specrl-cpu-runtime:latest . >/dev/null
image_python=$(docker run --rm --network none specrl-cpu-runtime:latest python3 -c 'import platform; print(platform.python_version())')
echo "build-cpu-image: runtime stage has Python $image_python ($(($(now) - t1)) s)"

# 3. Wheelhouse (rebuilt when pyproject.toml changes).
t2=$(now)
if [ "${SPECRL_REBUILD_WHEELS:-0}" != 1 ] && [ -f "$WHEELS/requirements.txt" ] \
  && [ "$WHEELS/requirements.txt" -nt pyproject.toml ]; then
  echo "build-cpu-image: $WHEELS is up to date (SPECRL_REBUILD_WHEELS=1 rebuilds it)"
else
  "$PYTHON" -c "import sys; v = '.'.join(map(str, sys.version_info[:2])); assert v == '${image_python%.*}', f'set PYTHON to a Python ${image_python%.*} (the image has ${image_python}), found {v}'"
  rm -rf "$WHEELS"
  mkdir -p "$WHEELS"
  # The runtime dependencies of pyproject.toml (no extras: no vLLM), plus what an editable
  # install of specrl needs without an index.
  "$PYTHON" - "$WHEELS/requirements.in" <<'PY'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))
deps = [*project["project"]["dependencies"], *project["build-system"]["requires"], "wheel"]
open(sys.argv[1], "w").write("\n".join(deps) + "\n")
PY
  echo "build-cpu-image: pip wheel into $WHEELS"
  reqs=("-r" "$WHEELS/requirements.in")
  for _ in 1 2 3 4 5; do
    "$PYTHON" -m pip wheel -q --wheel-dir "$WHEELS" "${reqs[@]}" 2>&1 \
      | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    # Markers evaluated for the image's Python, which pip on the host did not do.
    mapfile -t reqs < <("$PYTHON" docker/wheelhouse_missing.py "$WHEELS" "$image_python" "$WHEELS/requirements.in")
    [ "${#reqs[@]}" -gt 0 ] || break
    echo "build-cpu-image: for Python $image_python also: ${reqs[*]}"
  done
  [ "${#reqs[@]}" -eq 0 ] || { echo "build-cpu-image: still missing: ${reqs[*]}" >&2; exit 1; }
  ls "$WHEELS"/torch-2.13.0*.whl >/dev/null 2>&1 || { echo "build-cpu-image: no torch 2.13.0 wheel in $WHEELS" >&2; exit 1; }
  if find "$WHEELS" -name 'nvidia_*' -o -name 'triton-*' | grep -q .; then
    echo "build-cpu-image: $WHEELS holds CUDA wheels (an index gave torch's CUDA build); give pip the CPU build, e.g. PIP_FIND_LINKS=<folder with torch-2.13.0+cpu>" >&2
    exit 1
  fi
  mv "$WHEELS/requirements.in" "$WHEELS/requirements.txt"
  echo "build-cpu-image: $WHEELS: $(find "$WHEELS" -name '*.whl' | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1) ($(($(now) - t2)) s)"
fi

# 4. The image (Docker's layer cache makes an unchanged rebuild take seconds).
t3=$(now)
docker build -q --force-rm --network host -f docker/Dockerfile.cpu -t "$IMAGE" . >/dev/null
echo "build-cpu-image: $IMAGE built ($(($(now) - t3)) s; total $(($(now) - t0)) s)"
