"""Warm start: `regen train` starts from an existing draft (a regen step folder, or the
folder an engine loads: K3DSparkModel for TokenSpeed/vLLM, Qwen3DSparkModel for vLLM/SGLang), checked against the
profile with one line per mismatch; the run's own checkpoint wins over init_from on resume."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from regen.config import load_profile
from regen.errors import InputError
from regen.rundir import RunDir
from regen.train.loop import run_train


def train_cfg(profile, **overrides):
    return load_profile(str(profile), {f"train.{k}": v for k, v in overrides.items()}).train


def last_weights(train_dir) -> dict[str, torch.Tensor]:
    latest = json.loads((train_dir / "latest.json").read_text())
    return load_file(str(train_dir / latest["path"] / "model.safetensors"))


def _second_run(tmp_path):
    from train_helpers import ShardWriter, make_rows

    writer = ShardWriter(tmp_path / "run2")
    writer.add(make_rows(20, seed=7), complete=True)
    return tmp_path / "run2"


@pytest.mark.integration
@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_training_starts_from_a_step_folder_and_from_the_engines_folder(tiny_run, tmp_path, attention):
    from regen.serve.engines import export_draft

    profile, run_dir = tiny_run
    extra = {"attention_type": attention, "checkpoint_every": 0,
             **({"draft": {"q_lora_rank": 32}} if attention == "mla" else {})}  # K3DSparkModel needs q-LoRA
    first = run_train(train_cfg(profile, max_steps=4, **extra), RunDir.at(run_dir))
    step_folder = first["checkpoint"]
    trained = load_file(str(step_folder + "/model.safetensors"))
    engine = "tokenspeed" if attention == "mla" else "vllm"
    exported = tmp_path / f"export-{engine}"
    export_draft(step_folder, engine, exported)
    arch = json.loads((exported / "config.json").read_text())["architectures"][0]
    assert arch == ("K3DSparkModel" if attention == "mla" else "Qwen3DSparkModel")
    run2 = _second_run(tmp_path)
    scratch = run_train(train_cfg(profile, max_steps=1, lr=0.0, **extra), RunDir.at(run2),
                        train_dir=run2 / "scratch")
    for name, source in (("from-step", step_folder), ("from-train-dir", str(run_dir / "train")),
                         (f"from-{engine}", str(exported))):
        # lr 0: one step changes nothing, so the saved draft is exactly the draft it started from
        s = run_train(train_cfg(profile, max_steps=1, lr=0.0, init_from=source, **extra), RunDir.at(run2),
                      train_dir=run2 / name)
        got = last_weights(run2 / name)
        assert set(got) == set(trained)
        assert all(torch.equal(got[k], trained[k]) for k in trained), name
        meta = json.loads((run2 / name / "checkpoints" / "step-000001" / "training.json").read_text())
        assert meta["init_from"]["layout"] == {"from-step": "regen", "from-train-dir": "regen"}.get(name, arch)
        assert meta["init_from"]["tensors"] == len(trained)
        assert s["steps"] == 1
    assert not all(torch.equal(last_weights(run2 / "scratch")[k], trained[k]) for k in trained)
    assert scratch["steps"] == 1


@pytest.mark.integration
def test_every_mismatch_with_the_profile_is_one_line(tiny_run):
    profile, run_dir = tiny_run
    first = run_train(train_cfg(profile, max_steps=1, checkpoint_every=0), RunDir.at(run_dir))
    other = train_cfg(profile, max_steps=1, init_from=first["checkpoint"], target_layer_ids=[0, 2], markov_rank=8,
                      aux_hidden_stream="attn_res", num_draft_layers=2, block_size=5)
    with pytest.raises(InputError) as exc:
        run_train(other, RunDir.at(run_dir), train_dir=run_dir / "other")
    text = str(exc.value)
    for line in ("target_layer_ids: the checkpoint has [0, 1, 2], the profile builds [0, 2] (set "
                 "train.target_layer_ids", "aux_hidden_stream: the checkpoint has 'prefix', the profile builds "
                 "'attn_res'", "markov_rank: the checkpoint has 16, the profile builds 8",
                 "num_hidden_layers: the checkpoint has 1, the profile builds 2 (set train.num_draft_layers",
                 "block_size: the checkpoint has 7, the profile builds 5"):
        assert line in text, text
    assert text.count("\n  - ") == 5
    assert not (run_dir / "other" / "checkpoints").exists()  # refused before a step


@pytest.mark.integration
def test_a_missing_or_foreign_folder_is_a_clear_error(tiny_run, tmp_path):
    profile, run_dir = tiny_run
    with pytest.raises(InputError, match="no draft there"):
        run_train(train_cfg(profile, max_steps=1, init_from=str(tmp_path / "nope")), RunDir.at(run_dir))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(foreign / "model.safetensors"))
    with pytest.raises(InputError, match="warm start reads a regen step folder or an exported K3DSparkModel"):
        run_train(train_cfg(profile, max_steps=1, init_from=str(foreign)), RunDir.at(run_dir))


@pytest.mark.integration
def test_the_runs_own_checkpoint_wins_on_resume(tiny_run, tmp_path, caplog):
    profile, run_dir = tiny_run
    first = run_train(train_cfg(profile, max_steps=2, checkpoint_every=0), RunDir.at(run_dir))
    run2 = _second_run(tmp_path)
    run_train(train_cfg(profile, max_steps=2, checkpoint_every=0), RunDir.at(run2), stop_after_steps=1)
    with caplog.at_level("WARNING"):
        s = run_train(train_cfg(profile, max_steps=2, checkpoint_every=0, init_from=first["checkpoint"]),
                      RunDir.at(run2))
    assert s["steps"] == 2 and "init_from" in caplog.text and "ignored: resuming" in caplog.text


def test_preflight_names_a_missing_warm_start_before_any_request(tmp_path):
    from regen.preflight import check_profile

    profile = load_profile("local", {"train.init_from": str(tmp_path / "nope")})
    rep = check_profile(profile, RunDir.at(tmp_path / "run"), network=False)
    assert any(p.startswith("train.init_from") and "no draft there" in p for p in rep.problems), rep.problems
