"""bench/regen_vs_original.py --quick on a tiny random target: both arms trained on the same prompts, measured
on the same held-out prompts, the JSON in the issue's shape. Figures are not asserted."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from train_helpers import ShardWriter, make_rows, write_profile


def _original_rows(regenerated: list[dict], seed: int) -> list[dict]:
    """Other answers to the first 15 prompts of a regenerated shard, plus 3 prompts only the original set has."""
    rows = make_rows(18, seed=seed, prefix="o")
    for r, g in zip(rows[:15], regenerated[:15]):
        r["prompt_id"] = g["prompt_id"]
    return rows


def _bench_on_two_shard_sets(tmp_path, tiny_target, num_shards: int, *args: str):
    """A run with `num_shards` regenerated shards and their original counterparts; the quick bench on it.
    Returns (run dir, finished process)."""
    run = tmp_path / "run"
    regen = ShardWriter(run)
    orig = ShardWriter(tmp_path / "orig")
    for k in range(num_shards):
        rows = make_rows(20, seed=k)
        regen.add(rows, complete=(k == num_shards - 1))
        orig.add(_original_rows(rows, 10 + k), complete=(k == num_shards - 1))
    shutil.move(str(tmp_path / "orig" / "shards"), str(run / "shards-original"))
    profile = write_profile(tmp_path / "tiny.yaml", tiny_target, heldout_fraction=0.3)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, str(root / "bench" / "regen_vs_original.py"), "--run", str(run),
                           "--profile", str(profile), "--quick", *args],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc


@pytest.mark.integration
def test_bench_regen_vs_original_quick(tmp_path, tiny_target):
    run, proc = _bench_on_two_shard_sets(tmp_path, tiny_target, 2, "--seeds", "0,1")
    out = json.loads((run / "regen_vs_original.json").read_text())
    assert list(out) == ["seeds", "untrained", "original", "regenerated", "per_seed", "per_category"]
    assert out["seeds"] == [0, 1] and len(out["per_seed"]) == 2
    for arm in ("untrained", "original", "regenerated"):
        assert out[arm]["acc_len"] >= 1.0
        assert out[arm]["acc_len"] == sum(s[arm]["acc_len"] for s in out["per_seed"]) / 2
    for s in out["per_seed"]:
        assert s["num_common_prompts"] == 30 and s["num_prompts"] == 2
        assert s["train"]["regenerated"]["steps"] == s["train"]["original"]["steps"] == 4
        ev = json.loads(Path(s["eval_json"]).read_text())
        assert "/train-original/" in ev["drafts"]["original"]["dir"] and "/train-regenerated/" in ev["draft"]
    assert set(out["per_category"]) == {"math"}
    assert "regen/orig" in proc.stdout and "math" in proc.stdout
    # both arms trained on the same 30 prompts: the rows each set has for them, nothing else
    for arm, src in (("regenerated", run / "shards"), ("original", run / "shards-original")):
        sub = run / "regen-vs-original" / arm / "shards"
        m = json.loads((sub / "manifest.json").read_text())
        got = [r for e in m["shards"] for r in pq.read_table(sub / e["path"]).to_pylist()]
        assert m["complete"] and m["num_prompts"] == 30 and len(got) == 30
        ids = {r["prompt_id"] for r in got}
        source = [r for p in sorted(src.glob("shard-*.parquet")) for r in pq.read_table(p).to_pylist()]
        assert {r["sample_id"] for r in got} == {r["sample_id"] for r in source if r["prompt_id"] in ids}
    assert not (run / "train").exists() and not (run / "eval.json").exists()


@pytest.mark.integration
def test_bench_regen_vs_original_needs_the_main_job(tmp_path, tiny_target):
    root = Path(__file__).resolve().parents[2]
    profile = write_profile(tmp_path / "tiny.yaml", tiny_target)
    proc = subprocess.run([sys.executable, str(root / "bench" / "regen_vs_original.py"), "--run", str(tmp_path / "r"),
                           "--profile", str(profile), "--quick"],
                          cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "run the main job first" in proc.stderr and "Traceback" not in proc.stderr


def test_train_and_eval_on_the_original_set_through_the_cli(tmp_path, tiny_target, capsys):
    """`regen train/eval --responses original` read shards-original/ and write train-original/, eval-original.json."""
    from regen.cli import main as cli_main

    run = tmp_path / "run"
    writer = ShardWriter(tmp_path / "orig")
    writer.add(make_rows(20, seed=3), complete=True)
    shutil.move(str(tmp_path / "orig" / "shards"), str(run / "shards-original"))
    profile = write_profile(tmp_path / "tiny.yaml", tiny_target, heldout_fraction=0.3)
    base = ["--profile", str(profile), "--run", str(run), "--responses", "original"]
    assert cli_main(["train", *base, "--max-steps", "2"]) == 0
    assert json.loads((run / "train-original" / "summary.json").read_text())["steps"] == 2
    assert not (run / "train").exists()
    assert cli_main(["eval", *base, "--draft", str(run / "train-original"), "--num-prompts", "1",
                     "--max-new-tokens", "4"]) == 0
    assert json.loads((run / "eval-original.json").read_text())["num_prompts"] == 1
    assert not (run / "eval.json").exists()
    # the regenerated set (the default) has no shards here: an input error naming the fix
    assert cli_main(["train", "--profile", str(profile), "--run", str(run), "--max-steps", "2"]) == 2


@pytest.mark.integration
def test_bench_regen_vs_original_sampled(tmp_path, tiny_target):
    """--temperature adds the rejection-sampling figures beside the greedy ones (never in their place)."""
    run, proc = _bench_on_two_shard_sets(tmp_path, tiny_target, 1, "--temperature", "1.0")
    out = json.loads((run / "regen_vs_original.json").read_text())
    assert list(out) == ["seeds", "untrained", "original", "regenerated", "per_seed", "per_category", "sampled"]
    (s,) = out["per_seed"]
    ev = json.loads(Path(s["eval_json"]).read_text())
    assert s["regenerated"]["acc_len"] == ev["trained"]["acc_len"]  # the greedy figures stay the top level
    assert s["sampled"]["temperature"] == 1.0
    for arm, key in (("regenerated", "trained"), ("original", "original"), ("untrained", "untrained")):
        assert s["sampled"][arm]["acc_len"] == ev["sampled"][key]["acc_len"] == out["sampled"][arm]["acc_len"]
    assert "greedy (T = 0)" in proc.stdout and "rejection sampling (T = 1)" in proc.stdout


@pytest.mark.integration
@pytest.mark.parametrize("temperature", ["-1", "nan"])
def test_bench_regen_vs_original_refuses_a_bad_temperature_before_training(tmp_path, tiny_target, temperature):
    run = tmp_path / "run"
    ShardWriter(run).add(make_rows(4, seed=0), complete=True)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(root)}
    profile = write_profile(tmp_path / "tiny.yaml", tiny_target)
    proc = subprocess.run([sys.executable, str(root / "bench" / "regen_vs_original.py"), "--run", str(run),
                           "--profile", str(profile), "--temperature", temperature],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and f"--temperature {float(temperature)}" in proc.stderr and "Traceback" not in proc.stderr
    assert not (run / "regen-vs-original").exists() and not (run / "shards-original").exists()
