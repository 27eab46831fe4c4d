#!/usr/bin/env bash
# The trainer's first GPU check (issue 26, point 10): bench/gpu_check.py under a time limit, without network.
#
#   bash bench/gpu_check.sh                         # on one GPU (an H200: about 5 minutes); figures as JSON lines
#   bash bench/gpu_check.sh --wheels DIR            # first install what the image lacks from wheels in DIR
#   bash bench/gpu_check.sh --cpu --quick           # the CPU fallback at toy shapes (the test suite runs this)
#   bash bench/gpu_check.sh --only k3_step --tokens 16384 --attention flex
#
# Needs a CUDA PyTorch image (torch, transformers, safetensors, pyarrow, pyyaml, rich); what else the trainer
# imports (pydantic, ...) comes from --wheels DIR (`pip download -d DIR -r requirements.txt` on a machine with
# network). Every other option goes to bench/gpu_check.py (--help lists them). Exit status: 0 all checks passed,
# 1 a check failed, 2 bad arguments, 124 the time limit (GPU_CHECK_TIMEOUT_S, default 480 s) ran out.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels)
      [[ $# -ge 2 && -d "$2" ]] || { echo "gpu_check.sh: --wheels needs a directory of wheels" >&2; exit 2; }
      "$PY" -m pip install --no-index --find-links "$2" pydantic pyarrow pyyaml rich safetensors >&2
      shift 2 ;;
    -h|--help)
      sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
      "$PY" bench/gpu_check.py --help
      exit 0 ;;
    *) args+=("$1"); shift ;;
  esac
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec timeout "${GPU_CHECK_TIMEOUT_S:-480}" "$PY" bench/gpu_check.py ${args[@]+"${args[@]}"}
