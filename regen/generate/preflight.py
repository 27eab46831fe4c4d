"""The generate stage's check before a run: the endpoints `run_generate` will ask can serve it.

    check(cfg, run, rep, network=True)   endpoints: `${VARS}` set and URLs well formed (`stage.resolve_endpoints`);
                                         the API key variable set; with `network`, every endpoint answers
                                         `GET {base}/models` within `generate.timeouts.connect`, accepts the key
                                         (401/403 = key rejected) and lists `generate.model`
    check_started(base_url, model)       the same question of one server started by the caller (the embedded
                                         target), once it is up; raises PreflightError

A run directory whose generation is complete for this request config (`stage.complete`) needs no endpoint: the
stage returns its manifest without a request. Problems go to `rep` (a `regen.errors.CheckReport`), one line each
naming the field and the fix. No chat request is sent here; `GET /models` is the only network call
(`regen.generate.endpoints`).
"""
from __future__ import annotations

from regen.config.generate import GenerateConfig
from regen.errors import CheckReport, InputError, PreflightError
from regen.generate.endpoints import endpoint_problems, models_problem
from regen.generate.stage import api_key_from_env, complete, resolve_endpoints
from regen.rundir import RunDir


def check(cfg: GenerateConfig, run: RunDir, rep: CheckReport, *, network: bool = True) -> None:
    """Check the endpoints and the API key of `cfg` (module docstring); never raises for a problem."""
    if run.manifest(run.prompts) and complete(cfg, run):
        rep.ok("generate: complete on this run directory; no endpoint needed")
        return
    try:
        urls = resolve_endpoints(cfg, None)
    except InputError as exc:
        rep.bad(str(exc))
        urls = []
    try:
        key = api_key_from_env(cfg)
    except InputError as exc:
        rep.bad(str(exc))
        return  # asking /models without the key would only repeat the problem as a 401
    if network and urls:
        problems = endpoint_problems(urls, cfg.model, key, cfg.timeouts.connect)
        for problem in problems:
            rep.bad(problem)
        if not problems:
            rep.ok(f"generate: {len(urls)} endpoint(s) list {cfg.model!r} and accept the key")


def check_started(base_url: str, model: str, api_key: str | None = None, timeout_s: float = 10.0) -> None:
    """Ask a server the caller started (`GET {base_url}/models`, `timeout_s` seconds) whether it serves `model`.
    Raises PreflightError (an InputError) naming the problem; returns when it does."""
    problem = models_problem(base_url, model, api_key, timeout_s)
    if problem:
        raise PreflightError([problem])
