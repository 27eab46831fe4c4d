#!/usr/bin/env bash
# Stop the worker and the server started by scripts/prefect-up.sh (their whole process groups: flow runs too).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/prefect-env.sh
for name in worker server; do
  f="$PREFECT_HOME/$name.pid"
  [ -f "$f" ] || continue
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
    for i in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    echo "stopped prefect $name (pid $pid)"
  fi
  rm -f "$f"
done
