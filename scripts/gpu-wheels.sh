#!/usr/bin/env bash
# The wheels bench/gpu_check.sh carries to a GPU machine that reaches no package registry: requirements/gpu-wheels.txt's
# pins, for CPython 3.11 and 3.12 on x86_64 and aarch64 (the H200 image is 3.12 x86_64; GB200 hosts are aarch64),
# downloaded without dependencies into .gpu-wheels/ (git-ignored, about 9 MB; the device tool's carry takes it).
#   bash scripts/gpu-wheels.sh [DIR]        # default .gpu-wheels; idempotent
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
dir=${1:-.gpu-wheels}
mkdir -p "$dir"
mapfile -t pins < <(grep -v '^\s*#' requirements/gpu-wheels.txt | grep -v '^\s*$')
for py in 311 312; do
  for plat in manylinux_2_17_x86_64 manylinux_2_17_aarch64; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$py" \
      --platform "$plat" -d "$dir" "${pins[@]}"
  done
done
echo "gpu-wheels: $(ls "$dir" | wc -l) wheels in $dir ($(du -sh "$dir" | cut -f1))" >&2
