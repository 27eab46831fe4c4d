"""bench/gpu_check.sh as far as a CPU allows: its argument handling and its CPU fallback (toy shapes)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # starts processes (docs/testing.md)

ROOT = Path(__file__).resolve().parents[2]


def run(*args, timeout=300):
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_bad_arguments_exit_2():
    assert run("--tokens", "0").returncode == 2
    assert run("--wheels", "/nonexistent").returncode == 2
    assert run("--cpu", "--attention", "flex").returncode == 2
    assert run("--only", "nothing").returncode == 2


def test_the_cpu_fallback_runs_the_k3_step_and_the_copy_sections():
    # the train section is bench/train.py --quick, which tests/train/test_bench_train.py runs
    proc = run("--cpu", "--quick", "--only", "k3_step", "--only", "h2d")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    recs = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    k3, h2d, summary = recs
    assert k3["section"] == "k3_step" and k3["finite"] and k3["layers"] == 5 and len(k3["losses"]) == 2
    assert k3["plan_memory_per_gpu_gib"]["total"] > 0  # the kimi-k3 plan's figure at this row length, W = 1
    assert h2d["host_clone_gib_s"] > 0 and h2d["staging"]["host_copies"] == h2d["staging"]["objects"] > 0
    assert summary == {"summary": {"k3_step": True, "h2d": True}, "ok": True, "device": "cpu",
                       "date": summary["date"]}
