"""The trainer on a tiny random target (world size 1, in process): checkpoints, accumulation, resume, follow."""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from regen.config import load_profile
from regen.rundir import RunDir
from regen.train.loop import run_train

SERVING_FIELDS = ("target_layer_ids", "fc_norm", "aux_hidden_stream", "mask_token_id", "block_size", "markov_rank",
                  "num_target_layers", "target_hidden_size", "target_num_hidden_layers", "markov_head_type",
                  "enable_confidence_head", "confidence_head_with_markov", "norm_convention", "model_type",
                  "num_hidden_layers", "hidden_size", "vocab_size", "rope_theta", "rope_parameters", "rope_interleave")


def train_cfg(profile, **overrides):
    return load_profile(str(profile), {f"train.{k}": v for k, v in overrides.items()}).train


def samples(run_dir) -> list[list[str]]:
    lines = (run_dir / "train" / "samples-rank0.jsonl").read_text().splitlines()
    return [json.loads(x)["sample_ids"] for x in lines]


def weights(run_dir) -> dict[str, torch.Tensor]:
    latest = json.loads((run_dir / "train" / "latest.json").read_text())
    return load_file(str(run_dir / "train" / latest["path"] / "model.safetensors"))


@pytest.mark.integration
def test_train_writes_a_servable_checkpoint(tiny_run, tiny_target):
    from transformers import AutoModelForCausalLM

    from regen.train.model import load_draft

    profile, run_dir = tiny_run
    s = run_train(train_cfg(profile, max_steps=6), RunDir.at(run_dir))
    assert s["steps"] == 6 and s["tokens"] > 0 and 0 < s["target_share"] < 1
    assert s["loss_last"] < s["loss_first"]
    ckpt = run_dir / "train" / "checkpoints" / "step-000006"
    assert s["checkpoint"] == str(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    missing = [k for k in SERVING_FIELDS if k not in config]
    assert not missing
    assert config["target_layer_ids"] == [0, 1, 2] and config["num_target_layers"] == 3
    assert config["aux_hidden_stream"] == "prefix" and config["markov_rank"] == 16 and config["block_size"] == 7
    assert not any(k.startswith(("embed_tokens.", "lm_head.")) for k in load_file(str(ckpt / "model.safetensors")))
    target = AutoModelForCausalLM.from_pretrained(str(tiny_target))
    draft = load_draft(ckpt, target_model=target)
    assert torch.equal(draft.context_proj.weight, weights(run_dir)["context_proj.weight"])
    log = [json.loads(x) for x in (run_dir / "train" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]


@pytest.mark.integration
def test_resume_sees_exactly_the_remaining_samples_and_ends_where_uninterrupted_does(tiny_run, tmp_path):
    profile, run_dir = tiny_run
    cfg = train_cfg(profile, max_steps=7, log_samples=True)
    other = tmp_path / "other"
    import shutil

    shutil.copytree(run_dir / "shards", other / "shards")
    run_train(cfg, RunDir.at(run_dir))  # uninterrupted
    first = run_train(cfg, RunDir.at(other), stop_after_steps=3)  # preempted after 3 steps
    assert first["steps"] == 3
    second = run_train(cfg, RunDir.at(other))  # resumes from step 3
    assert second["steps"] == 7
    assert samples(other) == samples(run_dir)  # same samples, same order, none repeated, none lost
    assert len(samples(run_dir)) == 7
    a, b = weights(run_dir), weights(other)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.integration
def test_follow_trains_on_shards_appended_while_running(tmp_path, tiny_target):
    from train_helpers import ShardWriter, make_rows, write_profile

    writer = ShardWriter(tmp_path / "run")
    writer.add(make_rows(16, seed=0))
    cfg = load_profile(str(write_profile(tmp_path / "p.yaml", tiny_target, max_steps=1000, epochs=1, log_samples=True,
                                         follow_poll_s=0.1, follow_timeout_s=60))).train

    def produce():
        for k in (1, 2):
            time.sleep(1.0)
            writer.add(make_rows(16, seed=k, prefix="late"))
        time.sleep(0.5)
        writer.write_manifest(True)

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    s = run_train(cfg, RunDir.at(tmp_path / "run"), follow=True)
    t.join()
    seen = {sid for step in samples(tmp_path / "run") for sid in step}
    assert seen == {r["sample_id"] for r in writer.rows}  # every sample, including the late shards
    assert s["steps"] < 1000  # ended on the finished marker, not the step budget


@pytest.mark.integration
def test_follow_needs_a_step_budget(tiny_run):
    from regen.errors import InputError

    profile, run_dir = tiny_run
    with pytest.raises(InputError, match="max_steps"):
        run_train(train_cfg(profile, max_steps=0), RunDir.at(run_dir), follow=True)


def test_cli_reports_a_missing_target_without_a_traceback(tiny_run, capsys):
    from regen.cli import main

    profile, run_dir = tiny_run
    rc = main(["train", "--profile", str(profile), "--run", str(run_dir), "--set", "train.target=/nonexistent/model"])
    assert rc == 2
    assert "train.target" in capsys.readouterr().err


def test_kimi_k3_profile_builds_the_full_size_draft_on_meta():
    from types import SimpleNamespace

    from regen.train.draft_config import build_draft_config
    from regen.train.model import build_meta, count_parameters

    cfg = load_profile("kimi-k3").train
    k3 = SimpleNamespace(hidden_size=7168, num_hidden_layers=93, vocab_size=163840, model_type="kimi_k3")
    dcfg = build_draft_config(cfg, k3)
    assert dcfg.target_layer_ids == (7, 31, 47, 63, 87) and dcfg.fc_norm and dcfg.aux_hidden_stream == "attn_res"
    assert dcfg.num_hidden_layers == 5 and dcfg.mask_token_id == 163837 and dcfg.markov_rank == 256
    counts = count_parameters(build_meta(dcfg))
    assert abs(counts["serving_without_embed"] - 3.56e9) < 0.01e9  # the 3.56B of the K3 MLA checkpoint (spec §2)


@pytest.mark.integration
def test_resume_with_another_rope_theta_is_an_input_error_naming_both(tiny_run):
    from regen.errors import InputError

    profile, run_dir = tiny_run
    run_train(train_cfg(profile, max_steps=1), RunDir.at(run_dir))
    config = json.loads(next((run_dir / "train" / "checkpoints").glob("step-*/config.json")).read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 10000.0
    with pytest.raises(InputError, match=r"rope_theta is 10000, this run's draft config expects 50000"):
        run_train(train_cfg(profile, max_steps=2, rope_theta=50000.0), RunDir.at(run_dir))
