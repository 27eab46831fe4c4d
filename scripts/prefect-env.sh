# Source me: the environment of this project's Prefect server, worker and CLI (loopback, offline, no analytics).
#   source scripts/prefect-env.sh && .venv/bin/prefect deployment run regen/local --watch
# PREFECT_HOME is per project (.prefect/, git-ignored) unless already set; the port defaults to 4200.
_REGEN_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PREFECT_HOME="${PREFECT_HOME:-$_REGEN_ROOT/.prefect}"
export REGEN_PREFECT_PORT="${REGEN_PREFECT_PORT:-4200}"
export PREFECT_API_URL="http://127.0.0.1:${REGEN_PREFECT_PORT}/api"
export PREFECT_SERVER_API_HOST=127.0.0.1
export PREFECT_SERVER_API_PORT="$REGEN_PREFECT_PORT"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export DO_NOT_TRACK=1
export PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY=false
export PREFECT_RUNNER_POLL_FREQUENCY=2
export PREFECT_WORKER_QUERY_SECONDS=2
export PREFECT_WORKER_PREFETCH_SECONDS=2
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export REGEN_WORK_POOL="${REGEN_WORK_POOL:-regen-local}"
unset _REGEN_ROOT
