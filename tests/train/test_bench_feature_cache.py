"""Smoke test of bench/feature_cache.py --quick (a tiny random target): both runs train, the cached one reads every
row back after its first epoch; the figures are printed, not asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # starts processes (docs/development.md)


def test_bench_feature_cache_quick_runs_and_prints_its_figures():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(root / "bench" / "feature_cache.py"), "--quick", "--rows", "8",
                           "--epochs", "3"], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert out["baseline"]["steps"] == out["cached"]["steps"] == 6 and out["baseline"]["feature_cache"] is None
    assert out["cached"]["feature_cache"]["misses"] == 8 and out["cached"]["feature_cache"]["hits"] == 16
    assert out["ratio_baseline_to_cached_s_per_step"] > 0
