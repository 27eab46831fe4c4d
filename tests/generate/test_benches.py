"""The quick modes of bench/saturate.py and bench/scale.py: their figures are printed and sane (not the goals;
no wall-clock time is asserted)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def bench(name: str, *args: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-P", str(ROOT / "bench" / name), "--quick", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_saturate_quick_prints_fixed_and_auto_figures_and_ratios():
    lines = bench("saturate.py")
    runs = [json.loads(x) for x in lines if x.startswith('{"target"')]
    for target in ("slots", "slots+metrics"):
        mine = [r for r in runs if r["target"] == target]
        assert [r["concurrency"] for r in mine] == [4, 8, 16, 32, "auto"]
        for r in mine:
            assert r["tok_s"] > 0 and r["requests"] > 0 and r["p50_latency_s"] > 0
        auto = mine[-1]
        assert 1 <= auto["final_limit"] <= 64 and auto["limit_path"][0] == 4
    ratios = [json.loads(x.removeprefix("RATIO ")) for x in lines if x.startswith("RATIO ")]
    assert [r["target"] for r in ratios] == ["slots", "slots+metrics"]
    for r in ratios:
        assert r["best_fixed"] in (4, 8, 16, 32) and 0 < r["tok_s_ratio"] < 5 and 0 < r["p50_ratio"] < 20
        assert isinstance(r["goals_met"], bool)


def test_scale_quick_loses_and_duplicates_nothing_across_a_killed_actor():
    lines = bench("scale.py")
    head = json.loads(lines[0])
    assert head["prompts"] == 400 and head["tool"] > 0 and head["multi_turn"] > 0 and head["servers"] == 8
    summary = json.loads(next(x for x in lines if x.startswith("SUMMARY ")).removeprefix("SUMMARY "))
    assert summary["killed_actor"] and summary["sessions"][0].get("error")  # the kill cut the first session
    assert summary["rows_lost"] == 0 and summary["rows_duplicated"] == 0 and summary["balanced"]
    # exactly the requests sent but not recorded at the kill are sent again, and only the killed actor's shard
    assert summary["resent_after_kill"] == summary["in_flight_at_kill"]
    assert summary["resent_not_in_flight"] == 0 and summary["in_flight_not_resent"] == 0
    assert len(summary["resume_requests_per_shard"]) <= 1 and "-1" not in summary["resume_requests_per_shard"]
    assert summary["output_tokens"] > 0 and summary["client_cpu_s_per_1k_output_tokens"] > 0
    assert summary["part_bytes"] > 0 and summary["journal_peak_bytes"] > 0
    assert len(summary["peak_rss_mb_per_actor_process"]) >= 2
