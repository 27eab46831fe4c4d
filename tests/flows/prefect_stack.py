"""A real Prefect stack for tests, as scripts/prefect-up.sh makes it: a server on 127.0.0.1 (a free port, a
PREFECT_HOME of its own), the process work pool, the deployments from flows/deploy.py, and a worker that can be
killed (with its flow runs) and restarted. Talks to the server over its REST API."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (flow runs start their own sessions)."""
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


class PrefectStack:
    def __init__(self, home: Path, pool: str = "regen-test"):
        self.home = home
        self.pool = pool
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.env = dict(os.environ)
        self.env.update({
            "PREFECT_HOME": str(home), "PREFECT_API_URL": self.api, "PREFECT_SERVER_API_HOST": "127.0.0.1",
            "PREFECT_SERVER_API_PORT": str(self.port), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1", "PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY": "false",
            "PREFECT_RUNNER_POLL_FREQUENCY": "2", "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_WORKER_PREFETCH_SECONDS": "2", "PREFECT_SERVER_UI_ENABLED": "false",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
            "PREFECT_LOGGING_LEVEL": "INFO",
        })
        self.server: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None
        self.worker_env: dict = {}

    def start(self) -> "PrefectStack":
        self.home.mkdir(parents=True, exist_ok=True)
        with open(self.home / "server.log", "ab") as log:
            self.server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port",
                                            str(self.port)], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO)
        deadline = time.monotonic() + 240
        while True:
            assert self.server.poll() is None, (self.home / "server.log").read_text()[-3000:]
            try:
                if httpx.get(self.api + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prefect server not healthy after 240 s"
            time.sleep(0.5)
        out = subprocess.run([sys.executable, "flows/deploy.py", "--pool", self.pool], env=self.env, cwd=REPO,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        return self

    def start_worker(self, **extra_env: str) -> None:
        self.worker_env = extra_env
        env = {**self.env, **extra_env}
        with open(self.home / "worker.log", "ab") as log:
            self.worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", self.pool, "--type", "process"],
                                           env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True, cwd=REPO)

    def kill_worker(self) -> None:
        if self.worker is not None:
            kill_tree(self.worker.pid)
            self.worker.wait(10)
            self.worker = None

    def stop(self) -> None:
        self.kill_worker()
        if self.server is not None:
            os.killpg(self.server.pid, signal.SIGTERM)
            try:
                self.server.wait(20)
            except subprocess.TimeoutExpired:
                kill_tree(self.server.pid)
            self.server = None

    # -- the CLI a user types, and the API read-back
    def deployment_run(self, name: str, params: dict) -> str:
        """`prefect deployment run regen/<name> --params JSON`; returns the flow run id."""
        import json

        out = subprocess.run([PREFECT, "deployment", "run", f"regen/{name}", "--params", json.dumps(params)],
                             env=self.env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        found = UUID.findall(out.stdout)
        assert found, out.stdout
        return found[-1]

    def flow_run(self, flow_run_id: str) -> dict:
        r = httpx.get(f"{self.api}/flow_runs/{flow_run_id}", timeout=10)
        r.raise_for_status()
        return r.json()

    def state(self, flow_run_id: str) -> str:
        return self.flow_run(flow_run_id)["state"]["type"]

    def wait_final(self, flow_run_id: str, timeout_s: float = 900) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state(flow_run_id)
            if state in TERMINAL:
                return state
            assert time.monotonic() < deadline, f"flow run {flow_run_id} still {state}; see {self.home}/worker.log"
            time.sleep(1)

    def artifacts(self, flow_run_id: str) -> list[dict]:
        body = {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}
        r = httpx.post(f"{self.api}/artifacts/filter", json=body, timeout=10)
        r.raise_for_status()
        return r.json()

    def logs_until(self, flow_run_id: str, found, timeout_s: float = 60.0) -> list[str]:
        """The flow run's logs once one message satisfies `found` (or `timeout_s` passed): the flow run's process
        sends its logs in batches, some after the run's final state is already set."""
        deadline = time.monotonic() + timeout_s
        while True:
            logs = self.logs(flow_run_id)
            if any(found(m) for m in logs) or time.monotonic() > deadline:
                return logs
            time.sleep(0.5)

    def logs(self, flow_run_id: str) -> list[str]:
        out: list[str] = []
        while True:  # every page (the API answers at most `limit` rows a call), in time order
            body = {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200, "offset": len(out),
                    "sort": "TIMESTAMP_ASC"}
            r = httpx.post(f"{self.api}/logs/filter", json=body, timeout=10)
            r.raise_for_status()
            page = [x["message"] for x in r.json()]
            out += page
            if len(page) < 200:
                return out
