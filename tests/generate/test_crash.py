"""kill -9 at random points + the same command resumes: same output as an uninterrupted run, and only requests
in flight at a kill are sent twice (the server's log is the witness)."""
from __future__ import annotations

import random
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
from conftest import conversations, write_prompts

from regen.generate import ledger
from regen.rundir import RunDir
from regen.testing.openai_server import ServerThread, Settings

pytestmark = pytest.mark.timeout(240)
IN_FLIGHT = 16


def command(run: RunDir, url: str) -> list[str]:
    return [sys.executable, "-m", "regen.cli", "generate", "--profile", "local", "--run", str(run.root),
            "--endpoint", url, "--no-progress", "--set", "generate.model=fake",
            "--set", f"generate.max_in_flight={IN_FLIGHT}", "--set", "generate.part_rows=25"]


def outputs(run: RunDir) -> dict:
    out = {}
    for p in ledger.part_paths(run.generations):
        for r in pq.read_table(p).to_pylist():
            key = (r["prompt_id"], r["turn"])
            assert key not in out, f"duplicate row {key}"
            out[key] = (r["request_key"], r["status"], r["content"], r["reasoning_content"], str(r["tool_calls"]),
                        r["finish_reason"], str(r["messages"]))
    return out


@pytest.mark.integration
def test_sigkill_at_random_points_then_resume(tmp_path):
    rng = random.Random(1234)
    convs = conversations(160)
    with ServerThread(Settings(delay_s=0.08, tokens=16)) as server:
        log = server.server.log
        base = RunDir.at(tmp_path / "uninterrupted")
        write_prompts(base, convs)
        subprocess.run(command(base, server.base_url), check=True, timeout=120, capture_output=True)
        expected = outputs(base)
        assert len(expected) == 320
        log.clear()

        run = RunDir.at(tmp_path / "killed")
        write_prompts(run, convs)
        boundaries, recorded_at_kill = [], []
        for _ in range(3):
            start = len(log)
            proc = subprocess.Popen(command(run, server.base_url), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            target = start + rng.randint(15, 90)
            deadline = time.time() + 60
            while len(log) < target and proc.poll() is None and time.time() < deadline:
                time.sleep(0.002)
            time.sleep(rng.uniform(0, 0.05))
            proc.kill()  # SIGKILL
            proc.wait()
            assert proc.returncode == -9, proc.stdout.read().decode()[-2000:]
            time.sleep(0.3)  # let the server log requests already in its socket buffers
            boundaries.append(len(log))
            recorded_at_kill.append(ledger.recorded_keys(run.generations))
        done = subprocess.run(command(run, server.base_url), timeout=120, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "== 320 (prompt, turn) units of 160 prompts" in done.stdout

        assert outputs(run) == expected
        entries = list(log)
    sessions = [entries[a:b] for a, b in zip([0] + boundaries, boundaries + [len(entries)])]
    for i, recorded in enumerate(recorded_at_kill):
        later = {e["key"] for s in sessions[i + 1:] for e in s}
        assert not (later & recorded), f"a request recorded before kill {i + 1} was sent again"
    for s in sessions:
        keys = [e["key"] for e in s]
        assert len(keys) == len(set(keys)), "a request was sent twice within one process (no faults here)"
    last_seen: dict[str, int] = {}
    resent = 0
    for i, s in enumerate(sessions):
        for e in s:
            if e["key"] in last_seen:
                resent += 1
                assert last_seen[e["key"]] == i - 1  # sent in the session just killed ...
                assert e["key"] not in recorded_at_kill[i - 1]  # ... and not recorded there: it was in flight
            last_seen[e["key"]] = i
    print(f"kills at log entries {boundaries}; {resent} requests in flight at a kill were sent again")
    assert 0 < resent <= IN_FLIGHT * len(boundaries)
    assert len(last_seen) == 320  # every unit was requested (none came from elsewhere)
