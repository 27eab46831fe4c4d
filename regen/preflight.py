"""Preflight: check the configuration of every stage a run will use before its first request.

    preflight(profile, run)       -> the report; raises one PreflightError listing every problem found
    check_profile(profile, run)   -> the report, problems included (`regen plan` prints them)

Each stage owns its check, beside its entry; this module only says which of them a profile's run needs and in
what order (CHECKS), and adds the run directory's own:

  select    `regen.select.preflight.check`: sources and contamination files exist
  serve     (`serve.enabled`) `regen.target.server.check`: the embedded target's model directory loads; the
            pipeline starts the target, and asks its `/models` once it is up (`regen.pipeline.step_generate`)
  generate  (not `serve.enabled`) `regen.generate.preflight.check`: endpoints, API key, `GET /models` (with
            `network`); a generation already complete on this run directory needs no endpoint
  render    `regen.render.preflight.check`: the renderer and its tokenizer load
  train     (`train.enabled`) `regen.train.preflight.check`: target, draft, features, warm start, tracking;
            then `regen.serve.engines.check`: the draft it will train against every serving engine
  output    the run directory is writable (a probe file is written, fsynced and removed) and its file system
            has at least `plan.free_space_factor` x the planned shard bytes free (`planned_shard_bytes`)

A stage already finished on this run directory is still checked for its inputs. No chat request is ever sent
here; `GET /models` is the only network call.
"""
from __future__ import annotations

import os
import shutil
from typing import Callable, NamedTuple

from regen.config import Profile
from regen.config.render import effective_render_config
from regen.errors import CheckReport, PreflightError
from regen.generate import preflight as generate_check
from regen.render import preflight as render_check
from regen.rundir import RunDir
from regen.select import preflight as select_check
from regen.serve import engines
from regen.target import server
from regen.train import preflight as train_check


def check_train(profile: Profile, rep: CheckReport) -> None:
    """The train stage's check, then the serving engines' check of the draft it returns."""
    draft = train_check.check(profile.train, rep)
    if draft is not None:
        engines.check(draft, profile.train.serve_engines, rep)


def planned_shard_bytes(profile: Profile) -> int:
    """Shard bytes the profile implies before any selection, from its `plan` assumptions:
    select.total x units_per_prompt x keep_fraction x (prompt_tokens + output_tokens) x shard_bytes_per_token."""
    a = profile.plan
    tokens = a.prompt_tokens + a.output_tokens.get("default", 0)
    return int(profile.select.total * a.units_per_prompt * a.keep_fraction * tokens * a.shard_bytes_per_token)


def check_output(profile: Profile, run: RunDir, rep: CheckReport) -> None:
    probe = run.root / f".preflight-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"preflight")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as exc:
        rep.bad(f"run directory {run.root} is not writable ({exc}); choose another --run")
        return
    need = int(planned_shard_bytes(profile) * profile.plan.free_space_factor)
    free = shutil.disk_usage(run.root).free
    if free < need:
        rep.bad(f"run directory {run.root}: {free / 1e9:.1f} GB free, the plan needs {need / 1e9:.1f} GB "
                f"({profile.plan.free_space_factor} x the planned shards; `regen plan` gives the figure); free "
                "space or choose another --run")
        return
    rep.ok(f"output: {run.root} writable, {free / 1e9:.1f} GB free (planned need {need / 1e9:.2f} GB)")


class Check(NamedTuple):
    """One check of a run: its name, whether the profile's run needs it, and the call (profile, run, report,
    network) -> None."""

    name: str
    needed: Callable[[Profile], bool]
    run: Callable[[Profile, RunDir, CheckReport, bool], None]


CHECKS: tuple[Check, ...] = (
    Check("select", lambda p: True, lambda p, run, rep, net: select_check.check(p.select, rep)),
    Check("serve", lambda p: p.serve.enabled, lambda p, run, rep, net: server.check(p.serve, rep)),
    Check("generate", lambda p: not p.serve.enabled,
          lambda p, run, rep, net: generate_check.check(p.generate, run, rep, network=net)),
    Check("render", lambda p: True,
          lambda p, run, rep, net: render_check.check(effective_render_config(p.render, p.serve), rep)),
    Check("train", lambda p: p.train.enabled, lambda p, run, rep, net: check_train(p, rep)),
    Check("output", lambda p: True, lambda p, run, rep, net: check_output(p, run, rep)),
)


def check_profile(profile: Profile, run: RunDir, *, network: bool = True) -> CheckReport:
    """Run every check the run of `profile` on `run` needs (CHECKS, in order); never raises for a problem,
    returns them all. `network`: ask the endpoints' `/models` (False: only what needs no network)."""
    rep = CheckReport()
    for check in CHECKS:
        if check.needed(profile):
            check.run(profile, run, rep, network)
    return rep


def preflight(profile: Profile, run: RunDir, *, log=print) -> CheckReport:
    """Check everything before the first request; raises PreflightError (an InputError) listing every problem."""
    rep = check_profile(profile, run)
    if rep.problems:
        raise PreflightError(rep.problems)
    log(f"preflight: {len(rep.checks)} checks passed")
    return rep
