#!/usr/bin/env bash
# Refresh the lock to today's releases and run the whole suite on them (docs/development.md, "The lock"):
#   bash scripts/refresh-lock.sh
# 1. the current venvs move aside (.venv.before-STAMP, .venv-vllm.before-STAMP: restore them with mv to go back);
# 2. scripts/setup.sh with REGEN_UNLOCKED=1 REGEN_VLLM=1 installs the newest releases within pyproject.toml's floors;
# 3. requirements/lock.txt and lock-vllm.txt are rewritten from those venvs, pyproject.toml's ceilings follow;
# 4. the whole suite runs (as .ci/run does). Exit 0: commit requirements/ and pyproject.toml. Otherwise `git diff`
#    shows what moved; `git checkout requirements pyproject.toml` and the moved venvs restore the tested state.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=$(date +%Y%m%d-%H%M%S)
for v in .venv .venv-vllm; do
  if [ -d "$v" ]; then mv "$v" "$v.before-$stamp"; echo "refresh-lock: $v moved to $v.before-$stamp" >&2; fi
done
REGEN_UNLOCKED=1 REGEN_VLLM=1 bash scripts/setup.sh
python3 scripts/lock.py freeze .venv requirements/lock.txt
[ -x .venv-vllm/bin/python ] && python3 scripts/lock.py freeze .venv-vllm requirements/lock-vllm.txt
python3 scripts/lock.py ceilings
git --no-pager diff --stat -- requirements pyproject.toml || true
if .venv/bin/python -m pytest -q --durations=25; then
  echo "refresh-lock: the suite passes on the refreshed lock: commit requirements/ and pyproject.toml" >&2
else
  echo "refresh-lock: the suite FAILS on today's releases: do not commit the new lock; 'git diff requirements'" \
       "names what moved (restore: git checkout requirements pyproject.toml; mv the .before-$stamp venvs back)" >&2
  exit 1
fi
