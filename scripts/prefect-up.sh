#!/usr/bin/env bash
# Start what `prefect deployment run regen/<name>` needs on this machine, fully offline, on 127.0.0.1:
# a Prefect server (PREFECT_HOME=.prefect/), the process work pool `regen-local`, the deployments
# `regen/local` and `regen/kimi-k3` (flows/deploy.py) and a process worker. Idempotent; pids and logs in
# $PREFECT_HOME/. Stop with scripts/prefect-down.sh.
#   bash scripts/prefect-up.sh [--no-worker]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/prefect-env.sh
mkdir -p "$PREFECT_HOME"
PREFECT=.venv/bin/prefect
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

if ! alive "$PREFECT_HOME/server.pid"; then
  # Started in the background with its output in a file (not `--background`): see shared stack notes.
  setsid "$PREFECT" server start --host 127.0.0.1 --port "$REGEN_PREFECT_PORT"\
    >"$PREFECT_HOME/server.log" 2>&1 < /dev/null &
  echo $! > "$PREFECT_HOME/server.pid"
fi
for i in $(seq 1 240); do
  if .venv/bin/python -c "import urllib.request,sys; urllib.request.urlopen('$PREFECT_API_URL/health', timeout=2)" 2>/dev/null; then
    break
  fi
  if ! alive "$PREFECT_HOME/server.pid"; then echo "prefect server exited; see $PREFECT_HOME/server.log" >&2; tail -20 "$PREFECT_HOME/server.log" >&2; exit 1; fi
  sleep 0.5
done
echo "prefect server: $PREFECT_API_URL (log $PREFECT_HOME/server.log)"

.venv/bin/python flows/deploy.py --pool "$REGEN_WORK_POOL"

if [ "${1:-}" != "--no-worker" ] && ! alive "$PREFECT_HOME/worker.pid"; then
  setsid "$PREFECT" worker start --pool "$REGEN_WORK_POOL" --type process --name "regen-worker-$(hostname)" \
    >"$PREFECT_HOME/worker.log" 2>&1 < /dev/null &
  echo $! > "$PREFECT_HOME/worker.pid"
  echo "prefect worker: pid $(cat "$PREFECT_HOME/worker.pid") (log $PREFECT_HOME/worker.log)"
fi
echo "next: source scripts/prefect-env.sh && $PREFECT deployment run regen/local --watch"
