"""Progress where nobody watches a terminal: `regen generate` with stdout sent to a file
prints a progress line at a steady interval, and one at the end; on a terminal the bar draws instead."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from conftest import write_prompts

from regen.generate.metrics import ProgressLine
from regen.testing.openai_server import ServerThread, Settings

SNAP = {"req_per_s": 2.0, "out_tok_per_s": 50.0, "failures": {"timeout": 1}}


def test_plain_lines_at_the_interval_when_stdout_is_not_a_terminal(monkeypatch):
    out = io.StringIO()
    now = [0.0]
    monkeypatch.setattr("regen.generate.metrics.time.monotonic", lambda: now[0])
    bar = ProgressLine(100, 0, enabled=True, interval_s=60.0, out=out, terminal=False)
    for t, done in ((10, 10), (30, 20)):  # before the interval
        now[0] = t
        bar.update(done, SNAP, 4)
    assert out.getvalue() == ""
    now[0] = 70
    bar.update(50, SNAP, 4)  # a line
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("generate: 50/100 units (50.0%), 2.0 req/s  50 tok/s  in flight 4")
    assert "errors timeout=1" in lines[0] and "ETA 1.2 min" in lines[0]  # 50 left at 50 per 70 s
    now[0] = 100
    bar.update(60, SNAP, 4)  # 30 s after the last line: none
    now[0] = 131
    bar.update(100, SNAP, 0)  # 61 s after it: the next line
    bar.close()  # and one at the end
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[-1].endswith("done")


def test_no_plain_lines_under_a_bar_or_with_interval_zero():
    out = io.StringIO()
    quiet = ProgressLine(10, 0, enabled=False, interval_s=0.0, out=out, terminal=False)
    quiet.update(5, SNAP, 1)
    quiet.close()
    assert out.getvalue() == ""
    bar = ProgressLine(10, 0, enabled=True, interval_s=0.001, out=out, terminal=True)
    assert bar.enabled and bar.interval_s == 0.0  # the rich bar, no plain line beside it
    bar.close()


@pytest.fixture
def slow_server():
    srv = ServerThread(Settings(delay_s=0.25))
    yield srv
    srv.stop()


@pytest.mark.integration
def test_cli_with_stdout_to_a_file_prints_lines_while_it_runs(slow_server, tmp_path):
    from regen.rundir import RunDir

    run = RunDir.at(tmp_path / "run")
    write_prompts(run, [([{"role": "user", "content": f"question {i}"}], None) for i in range(8)])
    log = tmp_path / "generate.log"
    with open(log, "w") as f:  # stdout is a file, as `regen run > run.log` makes it
        rc = subprocess.run([sys.executable, "-m", "regen.cli", "generate", "--run", str(run.root), "--endpoint",
                             slow_server.base_url, "--max-in-flight", "1", "--set", "generate.model=fake",
                             "--set", "generate.progress_interval_s=0.3", "--set", "generate.retry.base_s=0.01"],
                            stdout=f, stderr=subprocess.PIPE, text=True, env=dict(os.environ), timeout=120)
    assert rc.returncode == 0, rc.stderr[-2000:]
    lines = [x for x in log.read_text().splitlines() if x.startswith("generate: ")]
    assert len(lines) >= 3, log.read_text()  # at least two while it ran, and the last
    assert lines[-1].startswith("generate: 8/8 units (100.0%)") and lines[-1].endswith("done")
    assert "\x1b[" not in log.read_text()  # no terminal control codes in the file
