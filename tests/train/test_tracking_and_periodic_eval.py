"""Points 3 and 6 on the tiny target: the held-out estimate every N steps (labelled an estimate), the
best checkpoint beside the latest, the curve in the training summary; TensorBoard event files with the training
and evaluation figures and the run's configuration; the progress line; `regen eval` to TensorBoard."""
from __future__ import annotations

import io
import json

import pytest
from safetensors.torch import load_file

from regen.config import load_profile
from regen.errors import InputError
from regen.rundir import RunDir
from regen.train.loop import run_train


def train_cfg(profile, **overrides):
    return load_profile(str(profile), {f"train.{k}": v for k, v in overrides.items()}).train


def scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} of every scalar in the TensorBoard event files under `logdir` (TensorBoard's own
    reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.integration
def test_estimates_every_n_steps_keep_the_best_and_track_to_tensorboard(tiny_run, capsys):
    profile, run_dir = tiny_run
    cfg = train_cfg(profile, max_steps=6, heldout_fraction=0.3, eval_every=2, eval_rows=4, progress_interval_s=0.0001,
                    checkpoint_every=0)
    s = run_train(cfg, RunDir.at(run_dir))
    train = run_dir / "train"
    curve = [json.loads(x) for x in (train / "periodic_eval.jsonl").read_text().splitlines()]
    assert [c["step"] for c in curve] == [2, 4, 6]
    assert all(c["method"].startswith("estimate: teacher-forced") and c["num_rows"] == 4 for c in curve)
    assert all(1.0 <= c["acc_len_estimate"] <= 8.0 and len(c["accept_rate"]) == 7 for c in curve)
    best = max(curve, key=lambda c: c["acc_len_estimate"])
    meta = json.loads((train / "best" / "best.json").read_text())
    assert meta["step"] == best["step"] and meta["acc_len_estimate"] == best["acc_len_estimate"]
    assert (train / "checkpoints" / "step-000006").is_dir()  # the latest beside the best
    during = s["eval_during_training"]
    assert during["best"]["step"] == best["step"] and [c["step"] for c in during["curve"]] == [2, 4, 6]
    assert "estimate" in during["method"]
    # the best folder is a servable draft: it loads, and it is the draft of that step, not the last one
    from transformers import AutoModelForCausalLM

    from regen.train.model import load_draft

    target = AutoModelForCausalLM.from_pretrained(cfg.target)
    load_draft(train / "best", target_model=target)
    if best["step"] != 6:
        last = load_file(str(train / "checkpoints" / "step-000006" / "model.safetensors"))
        mine = load_file(str(train / "best" / "model.safetensors"))
        assert any(not (last[k] == mine[k]).all() for k in mine)
    # TensorBoard: the training figures per logged step, the estimates, the configuration and the HParams
    tags = scalars(train / "tensorboard")
    assert [st for st, _ in tags["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert tags["train/loss"][-1][1] == pytest.approx(s["loss_last"], rel=1e-5)
    assert [st for st, _ in tags["eval_during_training/acc_len_estimate"]] == [2, 4, 6]
    assert s["tracking"]["tensorboard"] == str(train / "tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(train / "tensorboard"))
    acc.Reload()
    text = str(acc.Tensors("run_config/text_summary")[0].tensor_proto.string_val[0])
    assert '"eval_every": 2' in text and '"heldout_fraction": 0.3' in text
    out = capsys.readouterr().out
    assert "train: step 6/6 (100%)" in out and "loss" in out and "steps/min" in out
    # the run's report plots this run's training (loss and tau per logged step) and its estimates, with their cost
    import base64

    from regen.report.acceptance import curve_plot, training_plot

    png, caption = training_plot(run_dir)["training"]
    assert base64.b64decode(png).startswith(b"\x89PNG") and f"loss {s['loss_last']:.4f}" in caption
    assert f"tau {s['tau_probabilistic_last']:.3f}" in caption and "step 6:" in caption
    assert all(c["seconds"] > 0 for c in curve)
    png, caption = curve_plot(run_dir)["eval_curve"]
    assert png and f"the 3 estimates took {sum(c['seconds'] for c in curve):.1f} s" in caption


@pytest.mark.integration
def test_tracking_refuses_a_backend_that_is_not_installed(tiny_run):
    profile, run_dir = tiny_run
    import importlib.util

    missing = [b for b in ("wandb", "mlflow") if importlib.util.find_spec(b) is None]
    if not missing:
        pytest.skip("wandb and mlflow are both installed here")
    with pytest.raises(InputError, match=f"train.tracking asks for \\['{missing[0]}'\\], not installed"):
        run_train(train_cfg(profile, max_steps=1, tracking=[missing[0]]), RunDir.at(run_dir))
    assert not (run_dir / "train" / "checkpoints").exists()  # refused before the first step


@pytest.mark.integration
def test_periodic_eval_needs_held_out_rows_and_in_process_features(tiny_run, caplog):
    """No held-out row: refused before the first step. Producers (no features of held-out rows): the estimate is
    skipped with its reason, logged and in the summary, and never runs."""
    profile, run_dir = tiny_run
    with pytest.raises(InputError, match="no held-out rows"):
        run_train(train_cfg(profile, max_steps=2, heldout_fraction=0.0, eval_every=1), RunDir.at(run_dir))
    from regen.train.periodic_eval import PeriodicEval

    cfg = train_cfg(profile, eval_every=5, features="producers")
    with caplog.at_level("WARNING", logger="regen.train.periodic_eval"):
        p = PeriodicEval(cfg, RunDir.at(run_dir), run_dir / "train", None, is_main=True)
    assert "train.features: in_process" in caplog.text
    assert not p.due(5) and not p.due(7, final=True) and p.maybe(5, None) is None
    assert p.summary() == {"skipped": p.skipped} and "no estimate during training" in p.skipped


def test_progress_line_at_its_interval_only():
    from regen.train.tracking import Tracker

    cfg = load_profile("local", {"train.tracking": [], "train.progress_interval_s": 3600}).train
    out = io.StringIO()
    t = Tracker(cfg, "/nonexistent", None, total_steps=10, out=out)
    t.log({"step": 1, "loss": 2.5, "tau_probabilistic": 1.1})
    t.progress(1)
    assert out.getvalue() == ""  # the interval has not passed
    t.progress(5, force=True)
    assert out.getvalue().startswith("train: step 5/10 (50%), loss 2.5000 (step 1), tau_p 1.100")


def test_regen_eval_figures_go_to_the_drafts_tensorboard(tmp_path):
    from regen.train.eval import Round
    from regen.train.eval_cells import breakdown
    from regen.train.tracking import track_eval

    step_dir = tmp_path / "run" / "train" / "checkpoints" / "step-000040"
    step_dir.mkdir(parents=True)
    reqs = [({"category": "coding", "length_band": "0-128", "mode": None}, [Round(2, 3, 4, False)])]
    out = {"drafts": {"trained": {}, "untrained": {}}, "trained": {"acc_len": 3.0, "acc_len_per_request": 3.0,
                                                                    "breakdown": breakdown(reqs, 4)},
           "untrained": {"acc_len": 1.0, "acc_len_per_request": 1.0}}
    cfg = load_profile("local").train
    where = track_eval(out, step_dir, RunDir.at(tmp_path / "run"), cfg)
    assert where == tmp_path / "run" / "train"
    tags = scalars(where / "tensorboard")
    assert tags["eval/trained/acc_len"] == [(40, 3.0)] and tags["eval/untrained/acc_len"] == [(40, 1.0)]
    assert tags["eval/cell/coding/0-128/-/acc_len_per_round"] == [(40, 3.0)]
