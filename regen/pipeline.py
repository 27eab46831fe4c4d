"""`regen run`: the main job. Every stage of a profile in order, resumable, on one run directory.

    regen run --profile local --run runs/local [--set select.total=24 --set generate.max_tokens=16] [--no-progress]

Steps (each calls one stage entry with its sub-config), after `regen.preflight.preflight` has checked them all:
  select    regen.select.stage.run_select(profile.select, run, seed=profile.seed)
  generate  regen.generate.stage.run_generate(profile.generate, run, endpoints=...) -- when `serve.enabled`, inside
            `regen.serve.server.EmbeddedTarget(profile.serve)`, with `model` and `endpoints` set to the served ones
  filter    regen.render.stage.filter_responses(profile.render, run)
  render    regen.render.stage.run_render(profile.render, run)            (rendered, assistant-masked shards)
  train     regen.train.loop.run_train(profile.train, run)               (only when `train.enabled`)
  eval      regen.train.eval.run_eval(profile.train, run, draft_dir=run.train) (when `train.eval_prompts` > 0:
            acc_len of the trained draft and of an untrained one on held-out prompts -> <run>/eval.json)
then prints the stage counts and runs the DuckDB mix query (`regen.report.summary.MIX_SQL`) over the run's views.

Resume: each stage resumes from its own outputs (select: same config hash + seed returns its manifest; generate:
the request ledger never asks for a recorded (prompt, turn) again; render: its cursor). Rerunning the command on
the same run directory finishes an interrupted run. Stage wall times are appended to `<run>/pipeline.json`.
The same step functions back the Prefect flow (`flows/regen_flow.py`).
"""
from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

from regen.config import Profile
from regen.config.generate import GenerateConfig
from regen.config.render import RenderConfig
from regen.config.select import SelectConfig
from regen.config.serve import ServeConfig
from regen.config.train import TrainConfig
from regen.preflight import effective_render_config, generation_complete, preflight  # noqa: F401 (re-exported)
from regen.rundir import RunDir
from schemas.io import read_json, sha256_file, write_json_atomic

STEPS = ("select", "generate", "filter", "render", "train", "eval")


def step_select(select: SelectConfig, run: RunDir, *, seed: int, progress: bool = True,
                render: RenderConfig | None = None) -> dict:
    """Select; with `render` (the effective render config), prompts holding strings its renderer would parse as
    control tokens are rejected here, before any request (`regen.render.stage.prompt_control_tokens`)."""
    from regen.select.stage import run_select

    tokens = ()
    if render is not None:
        from regen.render.stage import prompt_control_tokens

        tokens = prompt_control_tokens(render)
    return run_select(select, run, seed=seed, progress=progress, control_tokens=tokens)


def step_generate(generate: GenerateConfig, serve: ServeConfig, run: RunDir, *, progress: bool = True,
                  log=print) -> dict:
    """Generate; with `serve.enabled`, against the embedded target started here and stopped after.

    The served model id and URL replace `generate.model` and `generate.endpoints`. The server's log (one access
    line per request) goes to `<run>/serve/server.log`, appended across sessions.
    """
    from regen.generate.stage import run_generate

    if not serve.enabled:
        return run_generate(generate, run, progress=progress)
    from regen.serve.server import EmbeddedTarget, sampling

    served = generate.model_copy(update={"model": EmbeddedTarget(serve).model})
    if generation_complete(served, run):  # nothing left to ask: no server start (a rerun of a finished run)
        return run_generate(served, run, progress=progress)

    # the warm-up request fixes the server's sampling for every request (regen.serve.server: module docstring)
    with EmbeddedTarget(serve, log_path=run.root / "serve" / "server.log", sampling=sampling(generate)) as target:
        log(f"embedded target {target.model} ready at {target.base_url} in {target.ready_s:.0f}s (pid {target.pid})")
        from regen.preflight import check_started_endpoint

        check_started_endpoint(target.base_url, target.model)  # preflight's endpoint check, now that it is up
        cfg = generate.model_copy(update={"model": target.model, "endpoints": [target.base_url]})
        return run_generate(cfg, run, endpoints=[target.base_url], progress=progress)


def step_filter(render: RenderConfig, run: RunDir, *, progress: bool = True) -> dict:
    from regen.render.stage import filter_responses

    return filter_responses(render, run, progress=progress)


def step_render(render: RenderConfig, run: RunDir, *, progress: bool = True) -> dict:
    from regen.render.stage import run_render

    return run_render(render, run, progress=progress)


def step_train(train: TrainConfig, run: RunDir) -> dict:
    """`regen.train.loop.run_train`; a local producer pool trains in a private network namespace (only
    loopback: `regen.train.features.netns`) where the machine allows."""
    import json

    from regen.errors import InputError
    from regen.train.features.netns import run_train_isolated, should_isolate
    from regen.train.loop import run_train

    if should_isolate(train):
        status = run_train_isolated(train, run)
        if status == 0:
            return json.loads((run.train / "summary.json").read_text())
        if status is not None:
            raise InputError(f"the trainer exited with status {status}; its error is above")
    return run_train(train, run)


def step_eval(train: TrainConfig, run: RunDir) -> dict:
    """acc_len of the run's latest draft vs an untrained one (`regen.train.eval.run_eval`); a rerun whose eval.json
    already measured that checkpoint with the same settings returns it without measuring again. Returns
    {"skipped": reason} when no shard row is held out (a run of a few prompts)."""
    from regen.train.eval import heldout_prompts, resolve_draft_dir, run_eval

    if not heldout_prompts(run, train.heldout_fraction, 1):
        return {"skipped": f"no held-out prompt among the shards at train.heldout_fraction={train.heldout_fraction}"}
    draft = resolve_draft_dir(run.train)
    done = read_json(run.root / "eval.json")
    same = dict(draft=str(draft), draft_sha256=sha256_file(draft / "model.safetensors"), target=str(train.target),
                num_prompts_asked=train.eval_prompts, max_new_tokens=train.eval_max_new_tokens,
                heldout_fraction=train.heldout_fraction, seed=train.seed if train.seed is not None else 0,
                confidence_threshold=0.0)
    if done and all(done.get(k) == v for k, v in same.items()):
        return done
    out = run_eval(train, run, draft_dir=draft, seed=same["seed"], num_prompts=train.eval_prompts,
                   max_new_tokens=train.eval_max_new_tokens, progress=False)
    return out


@contextmanager
def _timed(record: dict, name: str, log):
    t0 = time.time()
    log(f"== {name}")
    status = "failed"
    try:
        yield
        status = "done"
    finally:
        record[name] = {"started": t0, "wall_s": round(time.time() - t0, 3), "status": status}
        log(f"== {name} {status} in {record[name]['wall_s']:.1f}s")


def run_pipeline(profile: Profile, run: RunDir, *, progress: bool = True, log=print, check: bool = True) -> dict:
    """Run every enabled step of `profile` on `run`; returns {step: manifest or summary}.

    First `regen.preflight.preflight` (unless `check=False`): one PreflightError (an InputError) listing every
    configuration problem of every step, before any request. Raises the stages' InputError on bad input; any
    stage error stops the pipeline (outputs written so far stay, and a rerun resumes).
    """
    render = effective_render_config(profile.render, profile.serve)
    if check:
        preflight(profile, run, log=log)  # every stage's configuration, before the first request
    timings: dict = {}
    results: dict = {}
    session = {"profile": profile.name, "started": time.time(), "steps": timings}
    try:
        with _timed(timings, "select", log):
            results["select"] = step_select(profile.select, run, seed=profile.seed, progress=progress, render=render)
        with _timed(timings, "generate", log):
            results["generate"] = step_generate(profile.generate, profile.serve, run, progress=progress, log=log)
        with _timed(timings, "filter", log):
            results["filter"] = step_filter(render, run, progress=progress)
        with _timed(timings, "render", log):
            results["render"] = step_render(render, run, progress=progress)
        if profile.train.enabled:
            with _timed(timings, "train", log):
                results["train"] = step_train(profile.train, run)
            if profile.train.eval_prompts > 0:
                with _timed(timings, "eval", log):
                    results["eval"] = step_eval(profile.train, run)
                    log(eval_line(results["eval"]))
        session["status"] = "completed"
    except BaseException as exc:
        session["status"] = f"failed: {type(exc).__name__}"
        raise
    finally:
        path = run.root / "pipeline.json"
        state = read_json(path) or {"sessions": []}
        state["sessions"].append(session)
        write_json_atomic(state, path)
    return results


def eval_line(ev: dict) -> str:
    """One line: acc_len trained vs untrained (and any compared drafts) on n held-out prompts."""
    if "skipped" in ev:
        return f"eval skipped: {ev['skipped']}"
    names = [n for n in ev.get("drafts", {"trained": 0, "untrained": 0})]
    parts = ", ".join(f"{n} {ev[n]['acc_len']:.3f}" for n in names if ev.get(n, {}).get("acc_len") is not None)
    return (f"acc_len on {ev.get('num_prompts')} held-out prompts ({ev.get('max_new_tokens')} new tokens, "
            f"greedy, spec §7): {parts}")


def print_summary(run: RunDir) -> None:
    """Stage counts, the finish-reason mix, generation outcomes, rejects and the mix (with the SQL that makes it)."""
    from regen.report import summary
    from regen.report.query import print_table

    stages = summary.stage_table(summary.stage_counts(run.root))
    if stages[1]:
        print_table(*stages, title="stages")
    con = summary.connect(run.root)
    if line := summary.finish_line(con):
        print(line)
    for title, table in (("generations", summary.generation_table(con)), ("rejected", summary.reject_table(con))):
        if table[1]:
            print_table(*table, title=title)
    print(f"\nThe mix (DuckDB over {run.root}/views.sql):")
    print(f'  regen query --run {run.root} "{summary.MIX_SQL}"')
    print_table(*summary.mix_table(con), title="mix")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from regen.config import add_profile_arguments

    add_profile_arguments(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def main(args) -> int:
    from regen.config import load_profile_from_args

    profile, run = load_profile_from_args(args)
    print(f"regen run: profile {profile.name}, run directory {run.root}", flush=True)
    t0 = time.time()
    results = run_pipeline(profile, run, progress=not args.no_progress)
    print(f"\nregen run: finished in {time.time() - t0:.0f}s: {run.root}")
    print_summary(run)
    gen = results.get("generate") or {}
    return 0 if (gen.get("accounting") or {}).get("balanced", True) else 1

