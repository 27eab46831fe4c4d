"""Training with `train.features: producers` against a real Mooncake store, real producer processes and real faults.

Every run here happens in a private network namespace with only loopback up (Mooncake's clients listen on all
interfaces): `regen train` puts a local pool there itself, the rest goes through `loopback_only`.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from regen.config import load_profile
from regen.rundir import RunDir
from regen.train.features.netns import loopback_only
from regen.train.loop import run_train

pytestmark = pytest.mark.integration  # starts processes (docs/development.md)

HERE = Path(__file__).parent
pytest.importorskip("mooncake.store", reason="the Mooncake store (bash scripts/setup.sh installs it)")
if loopback_only(["true"]) is None:
    pytest.skip("no network namespace here (unshare --net): Mooncake clients would listen on all interfaces",
                allow_module_level=True)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "PYTHONPATH": str(HERE.parents[1])}
PRODUCERS = ["train.features=producers", "train.producers.lease_timeout_s=3", "train.producers.heartbeat_s=0.5",
             "train.producers.startup_timeout_s=300", "train.log_samples=true"]


def regen_train(profile, run, sets, *, background=False, extra=()):
    cmd = [sys.executable, "-m", "regen.cli", "train", "--profile", str(profile), "--run", str(run), *extra]
    for s in sets:
        cmd += ["--set", s]
    if background:
        return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900)


def wait_for(pred, timeout_s=300, what="condition"):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def logged_steps(run):
    log = Path(run) / "train" / "log.jsonl"
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def weights(run):
    latest = json.loads((Path(run) / "train" / "latest.json").read_text())
    return load_file(str(Path(run) / "train" / latest["path"] / "model.safetensors"))


def samples(run, world=1):
    out = []
    for r in range(world):
        out += [json.loads(x)["sample_ids"] for x in (Path(run) / "train" / f"samples-rank{r}.jsonl").read_text()
                .splitlines()]
    return out


def _rows(run):
    import pyarrow.parquet as pq

    return [r for f in sorted((Path(run) / "shards").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]


def copy_run(src, dst):
    shutil.copytree(Path(src) / "shards", Path(dst) / "shards")
    return Path(dst)


def test_producers_through_mooncake_train_the_same_draft_as_in_process(tiny_run, tmp_path):
    from train_helpers import one_torch_thread

    profile, run = tiny_run
    other = copy_run(run, tmp_path / "producers")
    # 4 micro-batches a step through a store budget of 3 objects: each is read out of the store in fetch
    cfg = load_profile(str(profile), ["train.max_steps=6", "train.log_samples=true", "train.grad_accum=4"]).train
    with one_torch_thread():  # as the trainer below (OMP_NUM_THREADS=1): the draft's own arithmetic then matches too
        inproc = run_train(cfg, RunDir.at(run))
    # a budget of three objects binds (the pool would run further ahead): the store's own bytes stay within it
    proc = regen_train(profile, other, PRODUCERS + ["train.max_steps=6", "train.producers.budget_bytes=802000",
                                                    "train.grad_accum=4"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((other / "train" / "summary.json").read_text())
    f = summary["features"]
    assert summary["features_from"] == "producers" and f["objects"] > 0 and f["failed_microbatches"] == 0
    assert f["store_samples"] > 0 and 0 < f["store_allocated_bytes_max"] <= f["budget_bytes"] == 802000
    assert f["accounted_bytes_max"] <= f["budget_bytes"]
    # into the device: each object read by the store straight into a host slot (no copy after
    # it), at most 2 objects resident, whatever grad_accum
    st = f["staging"]
    assert st["store_reads_into_slots"] == f["objects"] == 24 and st["host_copies"] == 0 and st["resident_max"] == 2
    # read ahead (train.producers.read_ahead 2): each step after the first submitted while the one before computed
    assert f["read_ahead"] == 2 and f["steps_submitted_ahead"] == 5
    assert summary["target_memory_bytes_per_rank"] < inproc["target_memory_bytes_per_rank"]
    assert samples(other) == samples(run)  # the same micro-batches in the same order
    assert [h["loss"] for h in logged_steps(other)] == [h["loss"] for h in inproc["history"]]
    a, b = weights(run), weights(other)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert 0.0 <= f["data_wait_fraction"] <= 1.0 and f["trainer_rows_per_s"] > 0 and f["producer_rows_per_s"] > 0


def test_producers_leave_out_the_per_cell_held_out_picks_as_the_trainer_does(tiny_run, tmp_path):
    """The dispatcher's feed leaves out the same prompts as the trainer's (train.heldout_per_cell's picks): one
    epoch trains every row but theirs, with features from the producers."""
    from test_heldout_cells import write_selection

    from regen.train.heldout import heldout_split

    profile, run = tiny_run
    pids = sorted({r["prompt_id"] for r in _rows(run)})
    write_selection(run, {p: ("math", ("0-128", "128-512", "512-2K")[i % 3], None) for i, p in enumerate(pids)})
    picks = heldout_split(RunDir.at(run), 0.0, 2).picks
    assert len(picks) == 6
    proc = regen_train(profile, run, PRODUCERS + ["train.max_steps=0", "train.epochs=1", "train.heldout_fraction=0",
                                                  "train.heldout_per_cell=2"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trained = {sid for step in samples(run) for sid in step}
    assert {"p" + sid for sid in trained} == set(pids) - picks


FEATURE_CASES = [("tiny", "float32"), ("tiny", "bfloat16"), ("smollm2", "float32"), ("smollm2", "bfloat16")]


@pytest.fixture(scope="module")
def features_through_the_store(tiny_target, tmp_path_factory) -> dict:
    """{(target, dtype): the driver's figures, or None where the target is not prepared}: every case of
    FEATURE_CASES through one driver process and one Mooncake master (each case's own rows: 12 on the tiny target,
    6 on SmolLM2)."""
    from train_helpers import ShardWriter, make_rows

    from regen.config import REPO_ROOT

    root = tmp_path_factory.mktemp("features-through-the-store")
    paths = {"tiny": tiny_target, "smollm2": REPO_ROOT / "data" / "models" / "smollm2-135m"}
    cases = {}
    for target, dtype in FEATURE_CASES:
        if not (paths[target] / "config.json").exists():
            continue
        run = root / f"{target}-{dtype}"
        ShardWriter(run).add(make_rows(12 if target == "tiny" else 6, seed=3, vocab=500), complete=True)
        cases[target, dtype] = [str(paths[target]), str(run / "shards"), dtype]
    cmd = loopback_only([sys.executable, str(HERE / "feature_drivers.py"), "roundtrip",
                         *(arg for case in cases.values() for arg in case)])
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = dict(zip(cases, json.loads(proc.stdout.strip().splitlines()[-1])))
    return {case: figures.get(case) for case in FEATURE_CASES}


@pytest.mark.parametrize("target,dtype", FEATURE_CASES)
def test_features_through_the_store_equal_in_process_exactly(features_through_the_store, target, dtype):
    r = features_through_the_store[target, dtype]
    if r is None:
        pytest.skip(f"the {target} target is not prepared (bash scripts/setup.sh)")
    assert r["microbatches"] > 0 and r["equal"] == r["microbatches"] and r["max_abs_diff"] == 0.0, r


def test_two_ranks_two_producers_one_killed_every_row_once_per_epoch(tiny_run, tmp_path):
    """The CI end-to-end run: torchrun with 2 gloo ranks, 2 local producers, one SIGKILLed mid-run."""
    profile, run = tiny_run
    ref_run = copy_run(run, tmp_path / "ref")
    two = copy_run(run, tmp_path / "two")
    common = ["train.epochs=2", "train.max_steps=0", "train.log_samples=true", "train.grad_accum=1"]
    ref = run_train(load_profile(str(profile), common + ["train.grad_accum=2"]).train, RunDir.at(ref_run))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "regen.train", "--", "--profile", str(profile), "--run", str(two)]
    for s in common + PRODUCERS + ["train.producers.budget_bytes=1100000"]:  # four objects: it binds
        cmd += ["--set", s]
    proc = subprocess.Popen(loopback_only(cmd), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pids = wait_for(lambda: (two / "train/features/producers.json").exists() and json.loads(
            (two / "train/features/producers.json").read_text()), what="producers.json")
        wait_for(lambda: len(logged_steps(two)) >= 2, what="two steps")
        # mid-run for certain: with the other producer stopped, the trainer has at most the budget's four objects
        # (two steps) ahead, so the run cannot end before it continues; the killed one may or may not have
        # registered yet (it loads the target first): either way it is in the summary, dead
        os.kill(pids[1]["pid"], signal.SIGSTOP)
        os.kill(pids[0]["pid"], signal.SIGKILL)
        steps_at_kill = len(logged_steps(two))
        os.kill(pids[1]["pid"], signal.SIGCONT)
        out, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-5000:]
    summary = json.loads((two / "train" / "summary.json").read_text())
    f = summary["features"]  # the store's own resident bytes stayed within the budget, the dead one's lease included
    assert 0 < f["store_allocated_bytes_max"] <= f["budget_bytes"] == 1100000 and f["store_samples"] > 10
    # every producer started is in the summary once with its final state, whatever the timing of the kill (the
    # pool ends its producers before it reports and reads their exit; each timing: tests/train/
    # test_producer_roster.py): the killed one dead with signal 9, the other finished (status 0, told the work
    # was done)
    assert steps_at_kill < summary["steps"]
    producers = {p["pid"]: p for p in summary["features"]["producers"]}
    assert len(producers) == len(summary["features"]["producers"]) == 2
    assert {pid: (p["alive"], p["state"]) for pid, p in producers.items()} == {
        pids[0]["pid"]: (False, "dead"), pids[1]["pid"]: (False, "finished")}
    assert "signal 9" in producers[pids[0]["pid"]]["observed"] and producers[pids[0]["pid"]]["name"] == "local-0"
    survivor = producers[pids[1]["pid"]]
    assert survivor["registered"] and survivor["last_seen_at"] and "status 0" in survivor["observed"]
    assert survivor["completed"] > 0
    # the two ranks consumed exactly the micro-batches one rank accumulating both does, in the same order
    r0, r1, single = samples(two, 1), samples(two, 2)[len(samples(two, 1)):], samples(ref_run)
    assert [a + b for a, b in zip(r0, r1)] == single and len(r0) == ref["steps"] == summary["steps"]
    epochs = [x["epoch"] for x in logged_steps(two)]
    assert sorted(set(epochs)) == [0, 1]
    all_rows = {r["sample_id"] for r in _rows(run)}
    for e in (0, 1):  # every row once per epoch, but those of the trailing partial step the feed drops
        rows = [sid for k, (a, b) in enumerate(zip(r0, r1)) if epochs[k] == e for sid in a + b]
        assert len(rows) == len(set(rows)) and set(rows) <= all_rows
        assert len(all_rows) - len(rows) < 2 * 4  # at most one micro-batch per rank (max_batch 4) left out
    assert summary["loss_last"] == pytest.approx(ref["loss_last"], rel=1e-4)


def test_every_producer_gone_is_a_clear_error_and_the_checkpoint_stays(tiny_run):
    profile, run = tiny_run
    proc = regen_train(profile, run, PRODUCERS + ["train.max_steps=40", "train.producers.num_local=1",
                                                  "train.producers.no_producer_timeout_s=4", "train.checkpoint_every=2"],
                       background=True)
    try:
        pids = wait_for(lambda: (run / "train/features/producers.json").exists() and json.loads(
            (run / "train/features/producers.json").read_text()), what="producers.json")
        wait_for(lambda: len(logged_steps(run)) >= 3, what="three steps")
        os.kill(pids[0]["pid"], signal.SIGKILL)
        t_kill = time.monotonic()
        out, _ = proc.communicate(timeout=300)
        waited = time.monotonic() - t_kill
    finally:
        proc.kill()
    assert proc.returncode == 2, out[-3000:]
    assert "every feature producer is gone" in out and "Traceback" not in out
    assert "train.producers.no_producer_timeout_s" in out and "checkpoint" in out
    assert waited < 3 + 4 + 30  # lease timeout + no-producer timeout + teardown
    latest = json.loads((run / "train" / "latest.json").read_text())
    assert (run / "train" / latest["path"] / "model.safetensors").exists() and latest["step"] >= 2


def test_a_row_whose_features_fail_every_time_stops_the_run_or_is_zeroed(tiny_run, tmp_path):
    profile, run = tiny_run
    other = copy_run(run, tmp_path / "zero")
    # local producers run at most 40 tokens per row: the feed's longer micro-batches fail on every attempt
    sets = PRODUCERS + ["train.max_steps=4", "train.producers.local_max_len=40", "train.producers.max_attempts=2"]
    proc = regen_train(profile, run, sets)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    err = proc.stderr + proc.stdout
    assert "failed on every attempt" in err and "longer than this producer's max_len 40" in err
    assert "train.producers.on_failure=zero_loss" in err and "Traceback" not in err
    proc = regen_train(profile, other, sets + ["train.producers.on_failure=zero_loss"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((other / "train" / "summary.json").read_text())
    zeroed = summary["features"]["zeroed_microbatches"]
    assert zeroed and summary["steps"] == 4 and all("max_len 40" in z["reason"] for z in zeroed)
    assert {s for z in zeroed for s in z["sample_ids"]} <= {s for step in samples(other) for s in step}


def test_local_producers_that_cannot_start_stop_the_run_at_once(tiny_run):
    profile, run = tiny_run
    t0 = time.monotonic()
    proc = regen_train(profile, run, PRODUCERS + ["train.max_steps=2", "train.producers.local_device=cuda:0"])
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    err = proc.stderr + proc.stdout
    assert "every local feature producer exited" in err and "producer-0 exited with status" in err
    assert "Traceback" not in err.split("regen train: error:")[-1]
    assert time.monotonic() - t0 < 120  # not startup_timeout_s (300 here)


def test_a_budget_smaller_than_one_object_is_refused_before_any_work(tiny_run):
    profile, run = tiny_run
    proc = regen_train(profile, run, PRODUCERS + ["train.max_steps=2", "train.producers.budget_bytes=100KiB"])
    assert proc.returncode == 2
    err = proc.stderr + proc.stdout
    assert "smaller than one feature object" in err and "train.max_tokens=256" in err and "Traceback" not in err
    assert not (run / "train" / "latest.json").exists()


def test_killed_and_resumed_replays_exactly_and_cleans_the_store(tiny_run, tmp_path):
    profile, run = tiny_run
    b = copy_run(run, tmp_path / "b")
    sets = {"train.max_steps": 10, "train.checkpoint_every": 3, "train.features": "producers",
            "train.producers.lease_timeout_s": 3, "train.producers.budget_bytes": 4_000_000}
    prof = tmp_path / "resume.yaml"
    import yaml

    doc = yaml.safe_load(Path(profile).read_text())
    for k, v in sets.items():
        node = doc
        *path, last = k.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = v
    prof.write_text(yaml.safe_dump(doc))
    cmd = loopback_only([sys.executable, str(HERE / "feature_drivers.py"), "resume", str(prof), str(run), str(b)])
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-5000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["objects_left_after_kill"] > 0 and r["removed_at_resume"] > 0  # the next run cleaned them up
    assert r["store_keys_at_end"] == 0 and r["store_bytes_at_end"] == 0
    loss_a = {x["step"]: x["loss"] for x in r["log_a"]}
    assert len(loss_a) == 10 and r["killed_at_step"] < 10
    for x in r["log_b"]:  # steps logged before the kill and again after the resume: all equal the reference
        assert x["loss"] == pytest.approx(loss_a[x["step"]], rel=1e-6, abs=1e-7), x["step"]


def test_follow_mode_producers_take_rows_as_render_writes_them(tiny_target, tmp_path):
    from train_helpers import ShardWriter, make_rows, write_profile

    profile = write_profile(tmp_path / "tiny.yaml", tiny_target, max_steps=6, follow_poll_s=0.2)
    follow_run, ref_run = tmp_path / "follow", tmp_path / "ref"
    w = ShardWriter(follow_run)
    proc = regen_train(profile, follow_run, PRODUCERS, background=True, extra=("--follow",))
    try:
        for k in range(3):  # the trainer and its producers start before any shard exists
            time.sleep(3 if k == 0 else 1.5)
            w.add(make_rows(20, seed=k), complete=(k == 2))
        out, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    ref = ShardWriter(ref_run)
    for k in range(3):
        ref.add(make_rows(20, seed=k), complete=(k == 2))
    cfg = load_profile(str(profile), ["train.log_samples=true"]).train
    inproc = run_train(cfg, RunDir.at(ref_run))
    assert samples(follow_run) == samples(ref_run)
    assert [h["loss"] for h in logged_steps(follow_run)] == pytest.approx([h["loss"] for h in inproc["history"]],
                                                                           rel=1e-6)
