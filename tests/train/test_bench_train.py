"""Smoke test of bench/train.py --quick (a tiny random target; the figures are printed, not asserted)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # starts processes (docs/development.md)


def test_bench_train_quick_runs_and_prints_its_figures():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(root / "bench" / "train.py"), "--quick", "--steps", "3"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert out["steps_timed"] == 3 and out["tokens"] > 0
    assert out["train_tokens_per_s"] > 0 and out["target_forward_tokens_per_s"] > 0
    assert 0 < out["target_share_of_step_time"] < 1
