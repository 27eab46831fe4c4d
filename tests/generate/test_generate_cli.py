"""`regen generate` as a user runs it, the fake server as a module, and resuming a finished run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest
from conftest import conversations, fast_config, write_prompts

from regen.errors import InputError
from regen.generate.stage import run_generate

pytestmark = pytest.mark.timeout(120)


def test_finished_run_is_not_requested_again_and_a_changed_config_is_refused(server, run_dir):
    write_prompts(run_dir, conversations(8))
    first = run_generate(fast_config(), run_dir, endpoints=[server.base_url], progress=False)
    sent = len(server.server.log)
    again = run_generate(fast_config(), run_dir, endpoints=[server.base_url], progress=False)
    assert len(server.server.log) == sent and again["accounting"] == first["accounting"]
    with pytest.raises(InputError, match="another request config"):
        run_generate(fast_config(temperature=0.1), run_dir, endpoints=[server.base_url], progress=False)
    manifest = json.loads((run_dir.generations / "manifest.json").read_text())
    assert manifest["complete"] and manifest["metrics"]["attempts"] == sent
    import pyarrow.parquet as pq

    table = pq.read_table(run_dir.generations / "throughput.parquet").to_pylist()
    assert sum(r["requests"] for r in table) == sent and sum(r["ok"] for r in table) == first["accounting"]["generated"]


def test_missing_prompts_is_a_clear_error(run_dir):
    with pytest.raises(InputError, match="regen select"):
        run_generate(fast_config(), run_dir, endpoints=["http://127.0.0.1:9/v1"], progress=False)


@pytest.mark.integration
def test_server_module_and_cli_with_a_kimi_style_body(tmp_path, repo_root):
    """The fake server as a process (as the deployment test uses it) logs the bodies the kimi-k3 profile sends."""
    from regen.rundir import RunDir

    log_file = tmp_path / "bodies.jsonl"
    env = {**os.environ, "REGEN_API_KEY": "sk-kimi-test-key-123"}
    srv = subprocess.Popen([sys.executable, "-m", "regen.testing.openai_server", "--port", "0", "--log-file",
                            str(log_file), "--api-key-env", "REGEN_API_KEY",
                            "--settings", json.dumps({"models": ["moonshotai/Kimi-K3"]})],  # the endpoint check asks
                           stdout=subprocess.PIPE, text=True, env=env)
    try:
        url = srv.stdout.readline().split("listening on", 1)[1].strip()
        run = RunDir.at(tmp_path / "run")
        write_prompts(run, conversations(4))
        out = subprocess.run([sys.executable, "-m", "regen.cli", "generate", "--profile", "kimi-k3", "--run",
                              str(run.root), "--endpoint", url, "--no-progress", "--max-in-flight", "8",
                              "--set", "generate.retry.base_s=0.01"],
                             capture_output=True, text=True, env=env, timeout=100)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "generated 8 + error 0 + skipped 0 == 8" in out.stdout
        remote = json.loads(urllib.request.urlopen(url.removesuffix("/v1") + "/_log").read())
    finally:
        srv.kill()
        srv.wait()
    bodies = [json.loads(line)["body"] for line in log_file.read_text().splitlines()]
    assert len(bodies) == len(remote) == 8
    for b in bodies:
        assert b["model"] == "moonshotai/Kimi-K3" and b["thinking"] is True and b["thinking_effort"] == "max"
        assert b["max_tokens"] == 32768 and b["stream"] is True and "seed" not in b
    for path in [log_file, *run.root.rglob("*")]:
        if path.is_file():
            assert b"sk-kimi-test-key-123" not in path.read_bytes()


def test_a_second_concurrent_run_on_the_same_directory_is_refused(server, run_dir):
    import fcntl

    write_prompts(run_dir, conversations(2))
    run_dir.generations.mkdir(parents=True, exist_ok=True)
    with open(run_dir.generations / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(InputError, match="another `regen generate`"):
            run_generate(fast_config(), run_dir, endpoints=[server.base_url], progress=False)
    assert run_generate(fast_config(), run_dir, endpoints=[server.base_url], progress=False)["complete"]
