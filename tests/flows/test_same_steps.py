"""`regen run`, the data loop's rounds and the Prefect flow run the same steps (`regen.pipeline.STEPS`).

Each path runs its real orchestration with what it calls replaced by recorders: `regen run` (`run_pipeline`)
with the pipeline's step functions recording their name, the flow (`regen.fn`, called directly: no Prefect
server, no task engine) with its tasks recording theirs. The recorded orders must be equal for every bundled
profile, and for each with training, evaluation or serving switched off, with the evaluation measuring or finding
no held-out prompt. A step condition written into one path only (the flow once nested the engine round trip
under `train.eval_prompts > 0` while `regen run` did not) makes them differ here.
"""
from __future__ import annotations

import pytest

from flows import regen_flow
from regen import pipeline
from regen.config import PROFILE_DIR, load_profile
from regen.rundir import RunDir

PROFILES = sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))
VARIANTS = {
    "as bundled": {},
    "training off": {"train.enabled": False},
    "evaluation off": {"train.eval_prompts": 0},
    "serving off": {"serve.engine_eval": False},
    "embedded target off": {"serve.enabled": False},
    "everything on": {"train.enabled": True, "train.eval_prompts": 4, "serve.enabled": True,
                      "serve.engine_eval": True},
    "everything on, evaluation off": {"train.enabled": True, "train.eval_prompts": 0, "serve.enabled": True,
                                      "serve.engine_eval": True},
}
# what a step function / task returns: an evaluation that measured, or one that found no held-out prompt
EVAL = {"measured": {"trained": {"acc_len": 2.0}, "untrained": {"acc_len": 1.0}, "num_prompts": 4},
        "no held-out prompt": {"skipped": "no held-out prompt among the shards"}}
# the pipeline's step function behind each step of STEPS
STEP_FUNCTIONS = {"select": "step_select", "generate": "step_generate", "filter": "step_filter",
                  "render": "step_render", "train": "step_train", "eval": "step_eval", "serve": "step_engine_eval"}
TASKS = {"select": "select_task", "generate": "generate_task", "filter": "filter_task", "render": "render_task",
         "train": "train_task", "eval": "eval_task", "serve": "engine_eval_task"}


def recorder(calls: list, name: str, eval_result: dict):
    def record(*args, **kwargs):
        calls.append(name)
        return dict(eval_result) if name == "eval" else {"steps": 2} if name == "train" else {}
    return record


def cli_steps(monkeypatch, profile, tmp_path, eval_result) -> list[str]:
    calls: list[str] = []
    for step, fn in STEP_FUNCTIONS.items():
        monkeypatch.setattr(pipeline, fn, recorder(calls, step, eval_result))
    pipeline.run_pipeline(profile, RunDir.at(tmp_path / "cli"), progress=False, log=lambda *_: None, check=False)
    return calls


def flow_steps(monkeypatch, name, overrides, tmp_path, eval_result) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(regen_flow, "preflight_task", lambda *a, **k: {"checks": 0})
    for step, task in TASKS.items():
        monkeypatch.setattr(regen_flow, task, recorder(calls, step, eval_result))
    regen_flow.regen.fn(profile=name, run_dir=str(tmp_path / "flow"), overrides=overrides)
    return calls


def test_every_step_has_a_function_and_a_task():
    assert [s.name for s in pipeline.STEPS] == list(STEP_FUNCTIONS) == list(TASKS)
    for step, task in TASKS.items():  # the flow's tasks carry the step's name (the Prefect UI, the artifacts)
        assert getattr(regen_flow, task).name == step


@pytest.mark.parametrize("outcome", sorted(EVAL))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", PROFILES)
def test_the_cli_and_the_flow_run_the_same_steps(name, variant, outcome, monkeypatch, tmp_path):
    overrides = VARIANTS[variant]
    profile = load_profile(name, overrides)
    cli = cli_steps(monkeypatch, profile, tmp_path, EVAL[outcome])
    flow = flow_steps(monkeypatch, name, overrides, tmp_path, EVAL[outcome])
    assert cli == flow, f"{name} ({variant}, eval {outcome}): regen run {cli}, the flow {flow}"
    assert cli[:4] == ["select", "generate", "filter", "render"]
    assert ("train" in cli) == profile.train.enabled
    assert ("eval" in cli) == (profile.train.enabled and profile.train.eval_prompts > 0)


def test_what_each_switch_turns_off():
    """The conditions themselves, on the local profile (trains, evaluates, serves the draft through llama.cpp)."""
    def names(overrides: dict, eval_result: dict = EVAL["measured"]) -> list[str]:
        return [s.name for s in pipeline.steps(load_profile("local", overrides), {"eval": eval_result})]

    everything = ["select", "generate", "filter", "render", "train", "eval", "serve"]
    assert names({}) == everything
    assert names({"train.enabled": False}) == everything[:4]
    # no held-out measurement asked: no engine round trip either (it measures on the same held-out prompts)
    assert names({"train.eval_prompts": 0}) == everything[:5]
    assert names({"serve.engine_eval": False}) == everything[:6]
    assert names({"serve.enabled": False}) == everything[:6]  # the round trip serves the embedded target
    assert names({}, EVAL["no held-out prompt"]) == everything[:6]


def test_a_loop_round_runs_the_same_list_with_training_and_evaluation_on(monkeypatch, tmp_path):
    """A round: the round's selection, generate, filter, render, train on from the last draft, eval; the
    engine round trip stays the main job's. Training and evaluation run even where the profile has them off."""
    from regen.select import aim

    calls: list[str] = []
    rec = {"round": 1, "init_from": "runs/x/train/checkpoints/step-2", "status": "selected"}
    monkeypatch.setattr(pipeline, "step_next_selection", lambda *a, **k: calls.append("select") or dict(rec))
    for step in ("generate", "filter", "render"):
        monkeypatch.setattr(pipeline, STEP_FUNCTIONS[step], recorder(calls, step, {}))
    trained = {}

    def train(cfg, run, *, train_dir=None):
        calls.append("train")
        trained.update(cfg=cfg, train_dir=train_dir)
        return {"steps": 3}

    monkeypatch.setattr(pipeline, "step_train", train)
    monkeypatch.setattr(pipeline, "step_eval_round", lambda cfg, run, name: calls.append("eval") or
                        {"trained": {"acc_len": 2.5}, "num_prompts": cfg.eval_prompts, "round_name": name})
    monkeypatch.setattr(aim, "update_round", lambda run, n, **fields: {**rec, **fields})
    profile = load_profile("local", {"train.eval_prompts": 0, "train.enabled": False})
    run = RunDir.at(tmp_path / "run")
    out = pipeline.loop_round(profile, run, budget_units=8, train_steps=3, progress=False, log=lambda *_: None)
    assert calls == ["select", "generate", "filter", "render", "train", "eval"]
    assert trained["train_dir"] == run.root / "train-loop-01" and trained["cfg"].max_steps == 3
    assert trained["cfg"].init_from == rec["init_from"]
    assert out["status"] == "done" and out["acc_len"] == 2.5 and out["steps"] == 3
