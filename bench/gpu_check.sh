#!/usr/bin/env bash
# The trainer's GPU check: bench/gpu_check.py under a time limit, without network, on a GPU machine's image as it is.
#
#   bash bench/gpu_check.sh                         # on one GPU (an H200: about 4 minutes); figures as JSON lines
#   bash bench/gpu_check.sh --wheels DIR            # the carried wheels from DIR (default .gpu-wheels when present)
#   bash bench/gpu_check.sh --cpu --quick           # every section at toy shapes on CPU (the code paths only)
#   bash bench/gpu_check.sh --only k3_step --tokens 16384
#
# Uses the machine's python3 (a CUDA PyTorch image: torch, transformers, safetensors, pyarrow, pyyaml), or $PYTHON.
# What the trainer imports beyond such an image (pydantic and what it needs: requirements/gpu-wheels.txt) is installed
# offline from the carried wheels (`bash scripts/gpu-wheels.sh` fills .gpu-wheels/ on a machine with a registry)
# into a temporary folder put first on the path: no index, no dependency resolution, nothing installed into the
# image. Exit status: 0 every section passed, 1 a section failed, 2 bad arguments or wheels, 3 no CUDA device
# (unless --cpu), 124 the time limit (GPU_CHECK_TIMEOUT_S, default 480 s) ran out.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
wheels=""
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels)
      [[ $# -ge 2 && -d "$2" ]] || { echo "gpu_check.sh: --wheels needs a directory of wheels" >&2; exit 2; }
      wheels=$2; shift 2 ;;
    -h|--help)
      sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
      "$PY" bench/gpu_check.py --help
      exit 0 ;;
    *) args+=("$1"); shift ;;
  esac
done
[[ -z "$wheels" && -d .gpu-wheels ]] && wheels=.gpu-wheels
site=""
if [[ -n "$wheels" ]]; then
  site=$(mktemp -d "${TMPDIR:-/tmp}/regen-gpu-site.XXXXXX")
  trap 'rm -rf "$site"' EXIT
  mapfile -t pins < <(grep -v '^\s*#' requirements/gpu-wheels.txt | grep -v '^\s*$')
  # each pin's wheel for this interpreter and platform from DIR alone; a missing one is named, and nothing resolves
  if ! "$PY" -m pip install -q --no-index --no-deps --disable-pip-version-check --target "$site" \
      --find-links "$wheels" "${pins[@]}" >&2; then
    echo "gpu_check.sh: the wheels in $wheels do not cover requirements/gpu-wheels.txt for $("$PY" -V 2>&1) on" \
         "$(uname -m): run 'bash scripts/gpu-wheels.sh $wheels' on a machine with a package registry" >&2
    exit 2
  fi
  echo "gpu_check.sh: carried wheels from $wheels installed into $site (first on the path)" >&2
fi
export PYTHONPATH="${site:+$site:}$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# not exec: the EXIT trap removes the temporary site when the check ends
rc=0
timeout "${GPU_CHECK_TIMEOUT_S:-480}" "$PY" bench/gpu_check.py ${args[@]+"${args[@]}"} || rc=$?
exit "$rc"
