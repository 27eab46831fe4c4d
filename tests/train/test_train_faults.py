"""A training run that never lies: divergence stops, checkpoints are verified, resume falls back loudly."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from regen.config import load_profile
from regen.errors import InputError
from regen.rundir import RunDir
from regen.train.checkpoint import CheckpointError, find_resume, step_folders, verify_checkpoint
from regen.train.guard import DivergenceMonitor, NonFiniteStep, nonfinite_tensors
from regen.train.loop import run_train, script_main
from schemas.io import sha256_file


def train_cfg(profile, **overrides):
    return load_profile(str(profile), {f"train.{k}": v for k, v in overrides.items()}).train


def checkpoints(run_dir):
    return [d.name for d in step_folders(run_dir / "train" / "checkpoints")]


def all_finite(folder) -> bool:
    import tempfile

    from regen.train.sharded_state import read_sharded

    with tempfile.TemporaryDirectory() as work:
        resume = read_sharded(folder / "resume", work)
    assert resume["model"] and resume["optimizer"]["state"]
    return not nonfinite_tensors(load_file(str(folder / "model.safetensors"))) and not nonfinite_tensors(resume)


# -- point 1: non-finite and divergent steps --------------------------------------------------------------------

def test_lr_1e30_stops_with_status_3_naming_step_rows_and_last_good_checkpoint(tiny_run, capsys):
    profile, run_dir = tiny_run
    rc = script_main(["--profile", str(profile), "--run", str(run_dir), "--set", "train.lr=1e30",
                      "--set", "train.max_steps=12", "--set", "train.checkpoint_every=1",
                      "--set", "train.keep_checkpoints=2"])
    err = capsys.readouterr().err
    assert rc == 3, err
    assert "non-finite loss or gradient norm" in err and "was not applied" in err
    stopped = json.loads((run_dir / "train" / "stopped.json").read_text())
    step = stopped["step"]
    assert f"step {step}:" in err and step < 12
    rows = stopped["ranks"][0]["sample_ids"]
    assert rows and rows[0][0] in err  # the micro-batch's rows are named
    kept = checkpoints(run_dir)
    assert kept and all(int(k.removeprefix("step-")) < step for k in kept)
    assert all(all_finite(run_dir / "train" / "checkpoints" / k) for k in kept)
    assert stopped["last_good_checkpoint"].endswith(kept[-1]) and kept[-1] in err
    assert not (run_dir / "train" / "summary.json").exists()


@pytest.mark.integration
def test_lr_1e30_without_any_checkpoint_says_so_in_process(tiny_run):
    profile, run_dir = tiny_run
    with pytest.raises(NonFiniteStep, match="no checkpoint was written before it"):
        run_train(train_cfg(profile, lr=1e30, max_steps=8, checkpoint_every=4, keep_checkpoints=2), RunDir.at(run_dir))
    assert checkpoints(run_dir) == []  # nothing non-finite was saved, not even at the end
    assert NonFiniteStep.exit_status == 3 and issubclass(NonFiniteStep, InputError)


def test_nonfinite_tensors_walks_nested_optimizer_state():
    state = {"state": {"w": {"exp_avg": torch.tensor([1.0, float("nan")]), "step": torch.tensor(3)}},
             "param_groups": [{"lr": 1e-3}], "ok": torch.ones(2), "ids": torch.tensor([1, 2])}
    assert nonfinite_tensors(state) == ["state.w.exp_avg"]
    assert nonfinite_tensors({"a": torch.tensor([float("inf")]), "b": torch.zeros(1)}) == ["a"]


def test_divergence_monitor_warns_on_a_loss_far_above_its_recent_median():
    mon = DivergenceMonitor(window=10, factor=4.0, min_history=5)
    assert [mon.observe(s, 2.0 - 0.01 * s) for s in range(1, 7)] == [None] * 6
    msg = mon.observe(7, 50.0)
    assert msg and "step 7" in msg and "median" in msg
    assert mon.warnings[0]["step"] == 7
    assert mon.observe(8, 2.0) is None


@pytest.mark.integration
def test_two_ranks_agree_to_stop_on_a_nonfinite_step(tiny_run, tmp_path):
    from test_parallel import _loopback_only

    profile, run_dir = tiny_run
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "regen.train", "--", "--profile", str(profile), "--run", str(run_dir),
           "--set", "train.lr=1e30", "--set", "train.max_steps=8", "--set", "train.checkpoint_every=1"]
    proc = subprocess.run(_loopback_only(cmd), env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "non-finite loss or gradient norm" in out and "rank 1:" in out, out[-3000:]
    stopped = json.loads((run_dir / "train" / "stopped.json").read_text())
    assert len(stopped["ranks"]) == 2
    assert all(all_finite(run_dir / "train" / "checkpoints" / k) for k in checkpoints(run_dir))


# -- point 2: checkpoints you can trust --------------------------------------------------------------------------

@pytest.mark.integration
def test_each_step_folder_has_a_manifest_that_verifies(tiny_run):
    profile, run_dir = tiny_run
    run_train(train_cfg(profile, max_steps=4, checkpoint_every=2, keep_checkpoints=0), RunDir.at(run_dir))
    folder = run_dir / "train" / "checkpoints" / "step-000004"
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "config.json", "training.json", "train_state.pt",
                                      "resume/.metadata", "resume/__0_0.distcp"}
    shard = manifest["files"]["resume/__0_0.distcp"]
    assert shard["bytes"] == (folder / "resume" / "__0_0.distcp").stat().st_size
    assert shard["sha256"] == sha256_file(folder / "resume" / "__0_0.distcp")
    assert all_finite(folder)
    assert verify_checkpoint(folder) is None
    assert not list((run_dir / "train" / "checkpoints").glob(".tmp-*"))


@pytest.mark.integration
def test_deleting_the_newest_checkpoint_resumes_from_the_previous_one_loudly(tiny_run, caplog):
    profile, run_dir = tiny_run
    cfg = train_cfg(profile, max_steps=6, checkpoint_every=4, keep_checkpoints=0, log_samples=True)
    run_train(cfg, RunDir.at(run_dir))
    assert checkpoints(run_dir) == ["step-000004", "step-000006"]
    shutil.rmtree(run_dir / "train" / "checkpoints" / "step-000006")
    with caplog.at_level(logging.WARNING):
        s = run_train(cfg, RunDir.at(run_dir))
    assert "RESUME FALLBACK" in caplog.text and "step-000004" in caplog.text and "step-000006" in caplog.text
    assert s["steps"] == 6 and s["resume"]["from"].endswith("step-000004") and s["resume"]["fallback"]
    lines = [json.loads(x)["step"] for x in (run_dir / "train" / "samples-rank0.jsonl").read_text().splitlines()]
    assert lines == [1, 2, 3, 4, 5, 6, 5, 6]  # went on from step 4, not from step 1


@pytest.mark.integration
@pytest.mark.parametrize("fault", ["truncate", "flip", "delete"])
def test_a_damaged_newest_checkpoint_is_never_loaded(tiny_run, caplog, fault):
    profile, run_dir = tiny_run
    cfg = train_cfg(profile, max_steps=4, checkpoint_every=2, keep_checkpoints=0)
    run_train(cfg, RunDir.at(run_dir))
    name = {"truncate": "resume/__0_0.distcp", "flip": "model.safetensors", "delete": "train_state.pt"}[fault]
    f = run_dir / "train" / "checkpoints" / "step-000004" / name
    if fault == "truncate":
        f.write_bytes(f.read_bytes()[:100])
    elif fault == "flip":
        data = bytearray(f.read_bytes())
        data[-5] ^= 0xFF
        f.write_bytes(bytes(data))
    else:
        f.unlink()
    folder, warning = find_resume(run_dir / "train")
    assert folder.name == "step-000002" and "damaged" in warning and name in warning
    with caplog.at_level(logging.WARNING):
        s = run_train(train_cfg(profile, max_steps=5, checkpoint_every=2, keep_checkpoints=0), RunDir.at(run_dir))
    assert s["steps"] == 5 and "RESUME FALLBACK" in caplog.text


@pytest.mark.integration
def test_no_intact_checkpoint_stops_listing_the_choices(tiny_run):
    profile, run_dir = tiny_run
    run_train(train_cfg(profile, max_steps=2, checkpoint_every=1, keep_checkpoints=0), RunDir.at(run_dir))
    for k in checkpoints(run_dir):
        (run_dir / "train" / "checkpoints" / k / "resume" / ".metadata").write_bytes(b"")
    (run_dir / "train" / "latest.json").unlink()
    with pytest.raises(CheckpointError, match="no intact checkpoint") as e:
        run_train(train_cfg(profile, max_steps=3), RunDir.at(run_dir))
    assert "step-000001" in str(e.value) and "step-000002" in str(e.value)


@pytest.mark.integration
def test_pruning_follows_step_numbers_and_keeps_the_pointed_one(tiny_run):
    profile, run_dir = tiny_run
    ckpts = run_dir / "train" / "checkpoints"
    run_train(train_cfg(profile, max_steps=3, checkpoint_every=1, keep_checkpoints=2), RunDir.at(run_dir))
    assert checkpoints(run_dir) == ["step-000002", "step-000003"]
    latest = json.loads((run_dir / "train" / "latest.json").read_text())
    assert latest["path"] == "checkpoints/step-000003"
    # a step folder beyond this run's position is never pruned in its favour
    s = run_train(train_cfg(profile, max_steps=12, checkpoint_every=1, keep_checkpoints=2), RunDir.at(run_dir),
                  stop_after_steps=1)
    assert s["steps"] == 4 and (ckpts / "step-000004").is_dir() and (ckpts / "step-000003").is_dir()


@pytest.mark.integration
def test_eval_and_export_refuse_a_damaged_or_nonfinite_checkpoint(tiny_run):
    from safetensors.torch import save_file

    from regen.serve.engines.draft import load_draft_checkpoint

    profile, run_dir = tiny_run
    run_train(train_cfg(profile, max_steps=1), RunDir.at(run_dir))
    folder = run_dir / "train" / "checkpoints" / "step-000001"
    assert load_draft_checkpoint(folder).step == 1
    w = load_file(str(folder / "model.safetensors"))
    k = sorted(w)[0]
    w[k] = torch.full_like(w[k], float("nan"))
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="damaged checkpoint"):  # the manifest catches it first
        load_draft_checkpoint(folder)
    (folder / "MANIFEST.json").unlink()  # a folder without manifest: the finite check still refuses it
    with pytest.raises(InputError, match="non-finite"):
        load_draft_checkpoint(folder)


# -- point 3: resume knows what it resumes -----------------------------------------------------------------------

@pytest.mark.integration
def test_resume_over_shards_rebuilt_from_other_rows_is_refused(tiny_run):
    from train_helpers import ShardWriter, make_rows

    from regen.train.resume import ResumeMismatch

    profile, run_dir = tiny_run
    run_train(train_cfg(profile, max_steps=4, checkpoint_every=4), RunDir.at(run_dir))
    shutil.rmtree(run_dir / "shards")
    writer = ShardWriter(run_dir)  # a re-render from other rows: same count, other content
    for k in range(3):
        writer.add(make_rows(20, seed=10 + k), complete=(k == 2))
    with pytest.raises(ResumeMismatch) as e:
        run_train(train_cfg(profile, max_steps=8, checkpoint_every=4), RunDir.at(run_dir))
    msg = str(e.value)
    assert "shards:" in msg and "restore the shards" in msg and "--init-from" in msg
    assert json.loads((run_dir / "train" / "latest.json").read_text())["step"] == 4  # nothing was trained


@pytest.mark.integration
@pytest.mark.parametrize("setting,value,old", [("lr", 2e-3, "0.001"), ("weight_decay", 0.5, None),
                                               ("grad_accum", 2, None)])
def test_resume_with_another_optimizer_or_batch_setting_is_refused_naming_both(tiny_run, setting, value, old):
    from regen.train.resume import ResumeMismatch

    profile, run_dir = tiny_run
    run_train(train_cfg(profile, max_steps=2, checkpoint_every=2), RunDir.at(run_dir))
    with pytest.raises(ResumeMismatch) as e:
        run_train(train_cfg(profile, max_steps=4, **{setting: value}), RunDir.at(run_dir))
    msg = str(e.value)
    key = "global_batch" if setting == "grad_accum" else setting
    assert f"{key}: checkpoint" in msg and f"now {value if setting != 'grad_accum' else value}" in msg
    if old:
        assert f"--set train.{setting}={old}" in msg


@pytest.mark.integration
def test_resume_extending_max_steps_is_applied_and_reported(tiny_run, caplog):
    profile, run_dir = tiny_run
    run_train(train_cfg(profile, max_steps=3, checkpoint_every=3), RunDir.at(run_dir))
    with caplog.at_level(logging.WARNING):
        s = run_train(train_cfg(profile, max_steps=5), RunDir.at(run_dir))
    assert s["steps"] == 5
    change = {c["setting"]: c for c in s["resume"]["changes"]}["total_steps"]
    assert change["old"] == 3 and change["new"] == 5 and "recomputed" in change["note"]
    assert "resume changes total_steps: 3 -> 5" in caplog.text


@pytest.mark.integration
def test_resume_with_another_target_of_the_same_shape_is_refused(tiny_run, tmp_path):
    from train_helpers import make_tiny_target, write_profile

    from regen.train.resume import ResumeMismatch

    profile, run_dir = tiny_run
    run_train(train_cfg(profile, max_steps=2), RunDir.at(run_dir))
    other = write_profile(tmp_path / "other.yaml", make_tiny_target(tmp_path / "other-target", seed=1))
    with pytest.raises(ResumeMismatch, match="target_revision: checkpoint"):
        run_train(train_cfg(other, max_steps=4), RunDir.at(run_dir))


# -- point 4: evaluation on held-out prompts only ----------------------------------------------------------------

@pytest.mark.integration
def test_eval_keeps_to_the_split_recorded_at_training_time(tiny_run, tmp_path):
    from safetensors.torch import save_file
    from train_helpers import make_rows

    from regen.train.eval import run_eval
    from regen.train.heldout import is_heldout

    profile, run_dir = tiny_run
    run_train(train_cfg(profile, max_steps=1, heldout_fraction=0.3), RunDir.at(run_dir))
    recorded = json.loads((run_dir / "train" / "heldout.json").read_text())
    assert recorded["fraction"] == 0.3 and "sha256(prompt_id)" in recorded["rule"]
    kw = dict(num_prompts=2, max_new_tokens=4, progress=False, out_path=tmp_path / "e.json")
    with pytest.raises(InputError, match=r"heldout_fraction=0.5 asks to evaluate on prompts the draft 'trained' "
                                         r"was trained on: it was trained with heldout_fraction=0.3"):
        run_eval(train_cfg(profile, heldout_fraction=0.5), RunDir.at(run_dir), draft_dir=run_dir, **kw)
    out = run_eval(train_cfg(profile, heldout_fraction=0.0), RunDir.at(run_dir), draft_dir=run_dir, **kw)
    h = out["heldout"]
    assert out["heldout_fraction"] == 0.3 and h["chosen_by"] == "the split recorded at training time"
    pids = {r["prompt_id"] for k in range(3) for r in make_rows(20, seed=k)}
    assert h["num_heldout_prompts"] == sum(is_heldout(p, 0.3) for p in pids) > 2 and h["num_evaluated"] == 2
    assert out["num_prompts"] == 2
    # a diverged draft is refused by eval too (the exports' check)
    folder = run_dir / "train" / "checkpoints" / "step-000001"
    w = load_file(str(folder / "model.safetensors"))
    w[sorted(w)[0]] = torch.full_like(w[sorted(w)[0]], float("inf"))
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError):
        run_eval(train_cfg(profile, heldout_fraction=0.3), RunDir.at(run_dir), draft_dir=folder, **kw)
    (folder / "MANIFEST.json").unlink()
    with pytest.raises(InputError, match="non-finite"):
        run_eval(train_cfg(profile, heldout_fraction=0.3), RunDir.at(run_dir), draft_dir=folder, **kw)


# -- point 6: one failing rank stops every rank --------------------------------------------------------------------

def _torchrun(profile, run_dir, *sets):
    from test_parallel import _loopback_only

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "regen.train", "--", "--profile", str(profile), "--run", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    # a rank left waiting would sit in a collective for the 30-minute process-group timeout: 300 s fails the test
    return subprocess.run(_loopback_only(cmd), env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.integration
def test_rank_0_failing_to_write_a_checkpoint_stops_both_ranks(tiny_run):
    profile, run_dir = tiny_run
    (run_dir / "train").mkdir()
    (run_dir / "train" / "checkpoints").write_text("not a directory")  # rank 0's write fails
    proc = _torchrun(profile, run_dir, "train.max_steps=4", "train.checkpoint_every=2")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "rank 0 could not write" in out, out[-3000:]
    assert "rank 1" not in out or "rank 0: rank 0 could not write" in out
    assert not (run_dir / "train" / "latest.json").exists() and not (run_dir / "train" / "summary.json").exists()


@pytest.mark.integration
def test_a_bad_row_on_one_rank_stops_both_ranks_naming_it(tmp_path, tiny_target):
    from train_helpers import ShardWriter, make_rows, write_profile

    writer = ShardWriter(tmp_path / "run")
    rows = make_rows(24, seed=0)
    rows[5]["input_ids"] = rows[5]["input_ids"][:-1] + [600]  # outside the tiny target's 512 ids
    writer.add(rows, complete=True)
    profile = write_profile(tmp_path / "tiny.yaml", tiny_target, max_steps=8)
    proc = _torchrun(profile, tmp_path / "run")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "token id 600" in out and "s0-5" in out, out[-3000:]
    assert "error: rank " in out  # the other rank stopped too, naming the failing rank and its message


@pytest.mark.integration
def test_a_fresh_start_never_overwrites_another_runs_step_folders(tiny_run, tmp_path):
    """A training directory holding another run's checkpoints (latest.json lost): never a silent fresh start."""
    from train_helpers import ShardWriter, make_rows

    from regen.train.resume import ResumeMismatch

    profile, run_dir = tiny_run
    other = tmp_path / "other"
    writer = ShardWriter(other)
    writer.add(make_rows(40, seed=7), complete=True)
    run_train(train_cfg(profile, max_steps=2, checkpoint_every=1, keep_checkpoints=0), RunDir.at(other))
    shutil.copytree(other / "train" / "checkpoints", run_dir / "train" / "checkpoints")
    before = {p: p.read_bytes() for p in (run_dir / "train" / "checkpoints").rglob("*") if p.is_file()}
    with pytest.raises(ResumeMismatch, match="shards: checkpoint"):
        run_train(train_cfg(profile, max_steps=2, checkpoint_every=1), RunDir.at(run_dir))
    after = {p: p.read_bytes() for p in (run_dir / "train" / "checkpoints").rglob("*") if p.is_file()}
    assert after == before


@pytest.mark.integration
def test_two_ranks_to_one_and_back_to_two_resume_the_sharded_state_exactly(tiny_run, tmp_path):
    """`regen train` resumed 2 ranks -> 1 -> 2 (the same global batch; the sharded state resharded by DCP each
    time) ends where an uninterrupted run on 2 ranks ends: weights and AdamW moments."""
    from train_helpers import one_torch_thread

    from regen.train.resume import ResumeMismatch
    from regen.train.sharded_state import read_sharded

    profile, run_dir = tiny_run
    ref = tmp_path / "ref"
    shutil.copytree(run_dir / "shards", ref / "shards")
    # a constant lr (no warmup, no decay): each segment's max_steps is its own schedule length; fp32 and eps as in
    # tests/train/test_parallel.py's equality of 2 ranks and 1
    common = ["train.adam_eps=1e-4", "train.lr=1e-2", "train.dtype=float32", "train.target_dtype=float32",
              "train.warmup_frac=0", "train.min_lr_frac=1", "train.checkpoint_every=1", "train.keep_checkpoints=0"]
    ckpts = run_dir / "train" / "checkpoints"
    proc = _torchrun(profile, run_dir, *common, "train.max_steps=2", "train.grad_accum=1")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert sorted(f.name for f in (ckpts / "step-000002" / "resume").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own shards
    assert "resume/__1_0.distcp" in json.loads((ckpts / "step-000002" / "MANIFEST.json").read_text())["files"]

    with one_torch_thread():  # with CI's 2 threads this segment ended 1.7e-5 from the ranks' run (measured)
        s = run_train(load_profile(str(profile), common + ["train.max_steps=3", "train.grad_accum=2"]).train,
                      RunDir.at(run_dir))  # 1 x 2 = 2 x 1
    changes = {c["setting"]: (c["old"], c["new"]) for c in s["resume"]["changes"]}
    assert changes["world_size"] == (2, 1) and changes["grad_accum"] == (1, 2) and s["steps"] == 3
    assert s["resume"]["from"].endswith("step-000002")
    with pytest.raises(ResumeMismatch, match=r"global_batch: checkpoint 2, now 1 .*world size x train.grad_accum = 2"):
        run_train(train_cfg(profile, max_steps=4, grad_accum=1), RunDir.at(run_dir))

    proc = _torchrun(profile, run_dir, *common, "train.max_steps=4", "train.grad_accum=1")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = json.loads((run_dir / "train" / "summary.json").read_text())
    changes = {c["setting"]: (c["old"], c["new"]) for c in summary["resume"]["changes"]}
    assert changes["world_size"] == (1, 2) and summary["steps"] == 4
    assert summary["resume"]["from"].endswith("step-000003")

    proc = _torchrun(profile, ref, *common, "train.max_steps=4", "train.grad_accum=1")  # uninterrupted, 2 ranks
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    got, want = (r / "train" / "checkpoints" / "step-000004" for r in (run_dir, ref))
    a, b = load_file(str(got / "model.safetensors")), load_file(str(want / "model.safetensors"))
    assert a.keys() == b.keys() and a
    for k in a:  # measured up to 1.2e-7 (the one step on 1 rank reduces in another order); 1 rank throughout
        # differs from 2 by up to 3e-5 after 4 steps, and a lost optimizer state by about the lr (1e-2)
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
    sa, sb = read_sharded(got / "resume", tmp_path / "a"), read_sharded(want / "resume", tmp_path / "b")
    assert sa["optimizer"]["state"].keys() == sb["optimizer"]["state"].keys()
    for name, st in sa["optimizer"]["state"].items():
        assert int(st["step"]) == 4, name
        for m in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(st[m], sb["optimizer"]["state"][name][m], rtol=1e-4, atol=1e-7,
                                       msg=f"{name}.{m}")


@pytest.mark.integration
def test_resume_with_another_tokenizer_of_the_same_vocabulary_is_refused(tiny_run, tiny_target, tmp_path):
    from train_helpers import write_profile

    from regen.train.resume import ResumeMismatch

    _, run_dir = tiny_run
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    (target / "tokenizer.json").write_text('{"model": {"vocab": {"a": 3}}}')
    profile = write_profile(tmp_path / "t.yaml", target)
    run_train(train_cfg(profile, max_steps=1), RunDir.at(run_dir))
    (target / "tokenizer.json").write_text('{"model": {"vocab": {"b": 3}}}')  # same size, other ids
    with pytest.raises(ResumeMismatch, match="target_tokenizer: checkpoint .* point train.target at the checkpoint"):
        run_train(train_cfg(profile, max_steps=2), RunDir.at(run_dir))
