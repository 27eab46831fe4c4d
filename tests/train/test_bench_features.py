"""Smoke test of bench/features.py --quick: every section runs and prints its figures (not asserted as times);
the counts it prints (copies per object, objects resident on the device) are asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # starts processes (docs/development.md)


def test_bench_features_quick_prints_each_section():
    pytest.importorskip("mooncake.store", reason="the Mooncake store (bash scripts/setup.sh installs it)")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(root / "bench" / "features.py"), "--quick", "--steps", "4"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert [t["object_bytes"] for t in out["transport"]] == [256 << 10, 1 << 20, 4 << 20]
    assert all(t["put_gib_per_s"] > 0 and t["get_gib_per_s"] > 0 and t["memcpy_gib_per_s"] > 0
               for t in out["transport"])
    k = out["k3_stream"]
    assert k["object_bytes"] > 64 * 6 * 7168 * 2 and k["store_samples"] > 0 and k["resident_within_budget"]
    # steps of 4 through a budget of 3 objects: each read by the store into a host slot, no copy after it, at most
    # 2 on the device (CPU: no device copy)
    assert k["grad_accum"] == 4 and k["store_reads_into_slots_per_object"] == 1 and k["host_copies_per_object"] == 0
    assert k["device_resident_objects_max"] == 2
    o = out["overlap"]  # through the trainer's client: serial (read_ahead 0) and overlapped (read_ahead 2)
    assert (o["objects"], o["steps"], o["grad_accum"], o["read_ahead"]) == (8, 2, 4, 2)
    assert all(o[m]["step_s"] > 0 for m in ("resident", "serial", "overlapped"))
    assert o["overlapped_vs_serial"] > 0 and o["overlapped_vs_resident"] > 0 and "overlapped with compute" in o["measures"]
    for mode, slots in (("serial", 4), ("overlapped", 3)):  # a step's 4; CPU: at most read_ahead + 1
        m = o[mode]
        assert 1 <= m["host_slots"] <= slots and m["device_resident_objects_max"] <= 2, mode
        assert m["host_copies_per_object"] == 0 and m["store_reads_into_slots_per_object"] == 1, mode
    assert "overlap, 2 steps of 4" in proc.stderr and "at most 2 object(s) resident" in proc.stderr
    e = out["end_to_end"]
    assert e["producers"]["loss_last"] == e["in_process"]["loss_last"]  # the same training, two feature paths
    assert e["producers_vs_in_process_tokens_per_s"] > 0 and 0 <= e["producers"]["data_wait_fraction"] <= 1
    assert e["producers"]["trainer_rows_per_s"] > 0 and e["producers"]["producer_rows_per_s"] > 0
    assert "end to end: producers" in proc.stderr and "K3-shaped rows of 64 tokens" in proc.stderr
    v = out["value_check"]
    assert v["object_bytes"] == 64 * 6 * 7168 * 2 and v["check_s"] > 0 and "non-finite value check" in proc.stderr
