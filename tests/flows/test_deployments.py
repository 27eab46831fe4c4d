"""`prefect deployment run regen/kimi-k3` and `regen/local` on a real Prefect server and process worker.

kimi-k3: endpoint pointed at the project's fake OpenAI server (regen.testing.openai_server, logging every body
it receives); the run completes, and every body carries the Kimi-K3 request (model, thinking, effort). The API
key comes from the worker's environment and appears in no artifact, log or output file.

local: the embedded real model. The worker (with its flow run and the embedded server) is killed mid-generate;
a second deployment run on the same run directory completes, and the server is asked only for the requests
the generate ledger had not recorded (exactly once).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect_stack import REPO, kill_tree

from regen.generate import ledger

pytestmark = pytest.mark.slow
SECRET = "sk-test-never-in-outputs-0123456789"


@pytest.fixture()
def fake_openai(tmp_path):
    log = tmp_path / "bodies.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "regen.testing.openai_server", "--host", "127.0.0.1", "--port", "0",
                             "--log-file", str(log), "--settings", json.dumps({"models": ["moonshotai/Kimi-K3"]})],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    line = proc.stdout.readline()
    assert "listening on" in line, line
    url = line.split("listening on", 1)[1].strip()
    yield url, log
    kill_tree(proc.pid)


def _files_text(root: Path) -> str:
    chunks = []
    for p in root.rglob("*"):
        if p.is_file():
            chunks.append(p.read_bytes().decode("utf-8", "replace"))
    return "\n".join(chunks)


def test_kimi_k3_deployment_against_a_test_server(prefect_stack, fake_openai, tmp_path):
    url, log = fake_openai
    prefect_stack.kill_worker()
    # Production reads its prompt pool, endpoints and key from the worker's environment; the pool here is the
    # bundled kimi-mtp fixture, the endpoint the fake server (a run-time parameter), training off.
    prefect_stack.start_worker(REGEN_API_KEY=SECRET, KIMI_MTP_DATASET=str(REPO / "data" / "prompts" / "kimi_mtp_sample"))
    run_dir = tmp_path / "kimi"
    params = {"run_dir": str(run_dir), "train": False, "overrides": {
        "select.total": 24, "generate.endpoints": [url], "generate.max_in_flight": 8, "generate.max_tokens": 256,
        "render.tokenizer": None, "generate.progress_interval_s": 0.01}}
    fr = prefect_stack.deployment_run("kimi-k3", params)
    assert prefect_stack.wait_final(fr) == "COMPLETED", "\n".join(prefect_stack.logs(fr)[-30:])

    bodies = [json.loads(x)["body"] for x in log.read_text().splitlines()]
    manifest = json.loads((run_dir / "generations" / "manifest.json").read_text())
    assert manifest["accounting"]["balanced"] and len(bodies) == manifest["metrics"]["attempts"] >= 24
    modes = set()
    for body in bodies:  # the profile's three generation modes
        assert body["model"] == "moonshotai/Kimi-K3"
        modes.add((body["thinking"], body.get("thinking_effort"), body["temperature"]))
    assert modes == {(True, "max", 1.0), (True, "low", 1.0), (False, None, 0.6)}
    shards = json.loads((run_dir / "shards" / "manifest.json").read_text())
    assert sum(s["rows"] for s in shards["shards"]) > 0

    # the generate stage's progress lines reach the flow run's logs (no bar draws in a worker)
    logs = prefect_stack.logs_until(fr, lambda m: "generate: " in m and " units (100.0%)" in m)
    progress = [x for x in logs if "generate: " in x and " units (" in x]
    assert progress and any("100.0%" in x for x in progress), "\n".join(logs)
    artifacts = prefect_stack.artifacts(fr)
    keys = {a["key"] for a in artifacts}
    assert {"regen-select", "regen-generate", "regen-filter", "regen-render"} <= keys
    mix = next(a for a in artifacts if a["key"] == "regen-select")["data"]
    assert "| category |" in mix and "reasoning" in mix
    everything = json.dumps(artifacts) + "\n".join(prefect_stack.logs(fr)) + _files_text(run_dir)
    assert SECRET not in everything


def _server_posts(server_log: Path) -> int:
    """Chat requests the embedded target logged: transformers serve's access lines, or llama.cpp's one
    `launch_slot_` line per request (regen.target.server.EmbeddedTarget.request_count)."""
    if not server_log.exists():
        return 0
    return sum('"POST /v1/chat/completions' in line or "launch_slot_" in line
               for line in server_log.read_text(errors="replace").splitlines())


def test_local_deployment_survives_a_killed_worker(prefect_stack, tmp_path):
    prefect_stack.kill_worker()
    prefect_stack.start_worker()
    run_dir = tmp_path / "local"
    gen_dir, server_log = run_dir / "generations", run_dir / "serve" / "server.log"
    params = {"run_dir": str(run_dir), "train": False, "overrides": {  # train: tests/train and tests/e2e
        "select.total": 12, "generate.max_tokens": 16, "generate.max_in_flight": 2}}
    first = prefect_stack.deployment_run("local", params)

    deadline = time.monotonic() + 900
    while not (gen_dir.is_dir() and ledger.recorded_keys(gen_dir)):  # some requests recorded: kill now
        assert time.monotonic() < deadline and prefect_stack.state(first) not in ("COMPLETED", "FAILED", "CRASHED")
        time.sleep(0.5)
    prefect_stack.kill_worker()  # the worker, its flow run and the embedded server
    recorded = len(ledger.recorded_keys(gen_dir))
    posts_before = _server_posts(server_log)
    assert prefect_stack.state(first) != "COMPLETED"

    prefect_stack.start_worker()
    second = prefect_stack.deployment_run("local", params)
    assert prefect_stack.wait_final(second) == "COMPLETED", "\n".join(prefect_stack.logs(second)[-30:])

    manifest = json.loads((gen_dir / "manifest.json").read_text())
    acc, metrics = manifest["accounting"], manifest["metrics"]  # metrics: the second session's
    assert acc["balanced"]
    units = acc["units"]
    assert 0 < recorded < units, f"the kill came too late or too early: {recorded} of {units} recorded"
    keys = ledger.read_index(gen_dir, ["request_key"]).column("request_key").to_pylist()
    assert len(keys) == len(set(keys)) == units
    # The second session wrote rows only for the units not recorded before the kill ...
    assert sum(metrics["rows"].values()) == units - recorded
    # ... and the server received exactly its requests (one warm-up + every attempt, retries included).
    assert _server_posts(server_log) - posts_before == 1 + metrics["attempts"]
    assert metrics["attempts"] >= units - recorded
    shards = json.loads((run_dir / "shards" / "manifest.json").read_text())
    assert sum(s["rows"] for s in shards["shards"]) > 0
