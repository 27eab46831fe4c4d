"""bench/suite_cpu.py, the suite's per-module accounting: a pytest run with the plugin writes a line per test whose
CPU seconds are split between the worker and the processes it waited for, and the summary sums them per module."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration

INNER = '''
import subprocess, sys, time

def spin(seconds):
    t = time.process_time()
    while time.process_time() - t < seconds:
        pass

def test_in_process():
    spin(0.6)

def test_in_a_child():
    subprocess.run([sys.executable, "-c", "import time\\nt = time.process_time()\\n"
                    "while time.process_time() - t < 0.6: pass"], check=True)

def test_waits():
    time.sleep(0.6)
'''


def test_the_plugin_splits_cpu_between_the_worker_and_its_children_and_sums_per_module(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER)
    out = tmp_path / "cpu"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}  # the inner run is no worker
    env.update(REGEN_SUITE_CPU_DIR=str(out), PYTHONPATH=str(ROOT / "bench"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_cpu", "-p", "no:cacheprovider",
                           "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    recs = {r["id"].split("::")[1]: r for r in map(json.loads, (out / "main.jsonl").read_text().splitlines())}
    assert set(recs) == {"test_in_process", "test_in_a_child", "test_waits"}
    assert recs["test_in_process"]["self"] >= 0.5 and recs["test_in_process"]["children"] < 0.1
    assert recs["test_in_a_child"]["children"] >= 0.5 and recs["test_in_a_child"]["self"] < 0.3
    waits = recs["test_waits"]
    assert waits["wall"] >= 0.6 and waits["self"] + waits["children"] < 0.2
    summary = subprocess.run([sys.executable, str(ROOT / "bench" / "suite_cpu.py"), str(out)], capture_output=True,
                             text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    (row,) = [x for x in summary.stdout.splitlines() if x.endswith("test_inner.py")]
    wall, _share, self_s, child_s, tests = row.split()[:5]
    assert int(tests) == 3 and float(wall) >= 1.8 and float(self_s) >= 0.5 and float(child_s) >= 0.5
    assert "main: 3 tests" in summary.stdout


def test_the_summary_names_what_it_needs_without_a_folder(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "suite_cpu.py"), str(tmp_path / "missing")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "REGEN_SUITE_CPU_DIR" in proc.stderr and "Traceback" not in proc.stderr
