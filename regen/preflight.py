"""Preflight: check the configuration of every stage a run will use before its first request.

    preflight(profile, run)   -> the report; raises one InputError listing every problem found

What is checked, per stage the run will execute (a stage already finished on this run directory is still
checked for its inputs, except the endpoints of a generate stage with nothing left to ask):

  select    every `select.sources` path and `select.contamination_files` entry: environment variables set,
            the path exists and holds data files (`regen.select.sources.source_files`)
  serve     (`serve.enabled`) the embedded target's `model_dir` holds a `config.json` that parses
  generate  endpoints: `${VARS}` set and URLs well formed (`regen.generate.stage.resolve_endpoints`); the API
            key variable set; every endpoint answers `GET {base}/models` within `generate.timeouts.connect`,
            accepts the key (401/403 = key rejected) and lists `generate.model`
  render    the renderer loads: `render.tokenizer` set and its directory loads (`regen.render.stage.make_renderer`)
  train     (`train.enabled`) `train.target` set, a directory whose `config.json` parses, with the taps inside
            its layer count
  output    the run directory is writable (a probe file is written, fsynced and removed) and its file system
            has at least `plan.free_space_factor` x the planned shard bytes free (`planned_shard_bytes`)

The embedded target (`serve.enabled`, local profile) is started by the pipeline itself, so its endpoint cannot
be asked before the run: preflight checks its model directory, and `check_started_endpoint` asks the started
server's `/models` (with the served id) right after it is ready and before the first generate request
(`regen.pipeline.step_generate`). The server's own warm-up request (`serve.warmup`) precedes that check.

No chat request is ever sent here; `GET /models` is the only network call.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from regen.config import Profile, resolve_path
from regen.config.generate import GenerateConfig
from regen.config.render import effective_render_config  # noqa: F401 (re-exported: pipeline, plan, flows)
from regen.errors import InputError
from regen.generate.endpoints import endpoint_problems, models_problem
from regen.rundir import RunDir


class PreflightError(InputError):
    """Every problem preflight found, one per line (`problems`), each naming the field and the fix."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"preflight found {len(problems)} problem(s); nothing was requested:\n"
                         + "\n".join(f"  - {p}" for p in problems))


@dataclass
class Report:
    """What preflight checked (`checks`: short lines) and what is wrong (`problems`: one line each)."""

    checks: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def ok(self, line: str) -> None:
        self.checks.append(line)

    def bad(self, line: str) -> None:
        self.problems.append(line)

    def to_dict(self) -> dict:
        return {"checks": self.checks, "problems": self.problems}


# ---------------------------------------------------------------------------------------------- per stage


def generation_complete(generate: GenerateConfig, run: RunDir) -> bool:
    """True when `run_generate(generate, run)` would return its manifest without sending a request (the same
    test it makes: a complete manifest with this request config, no journal, balanced accounting)."""
    from regen.generate.stage import accounting, config_hash, prompt_files

    old = run.manifest(run.generations)
    if not (old and old.get("complete") and old.get("config_hash") == config_hash(generate)):
        return False
    if list(run.generations.glob("journal-*.jsonl")):
        return False
    acc = accounting(run.generations, prompt_files(run))
    return bool(acc["balanced"] and acc["rows"] == old["accounting"]["rows"])




def check_select(profile: Profile, rep: Report) -> None:
    from regen.select.sources import source_files

    for src in profile.select.sources:
        try:
            files = source_files(src)
            rep.ok(f"select.sources {src.name}: {len(files)} file(s)")
        except InputError as exc:
            rep.bad(str(exc))
    if "contamination" in profile.select.filters:
        for raw in profile.select.contamination_files:
            path = resolve_path(raw)
            if "$" in str(path):
                rep.bad(f"select.contamination_files {raw!r}: an environment variable is not set; export it")
            elif not path.exists():
                rep.bad(f"select.contamination_files {raw!r}: {path} does not exist; fix the path or remove the entry")


def _config_json(path: Path, field_name: str, raw: str) -> dict | None:
    cfg = path / "config.json"
    if not cfg.is_file():
        return None
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"{field_name} {raw!r}: {cfg} does not parse as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InputError(f"{field_name} {raw!r}: {cfg} is not a JSON object")
    return data


def _local_dir(raw: str | None, field_name: str, rep: Report, what: str) -> Path | None:
    if not raw:
        rep.bad(f"{field_name} is not set: give the local path of the {what}")
        return None
    path = resolve_path(raw)
    if "$" in str(path):
        rep.bad(f"{field_name} {raw!r}: the environment variable is not set; export it or pass "
                f"--set {field_name}=/path/to/{what.replace(' ', '_')}")
        return None
    if not path.is_dir():
        rep.bad(f"{field_name} {raw!r}: {path} is not a directory; give the local path of the {what}")
        return None
    return path


def check_serve(profile: Profile, rep: Report) -> None:
    path = _local_dir(profile.serve.model_dir, "serve.model_dir", rep, "embedded target model")
    if path is None:
        return
    try:
        if _config_json(path, "serve.model_dir", profile.serve.model_dir) is None:
            rep.bad(f"serve.model_dir {profile.serve.model_dir!r}: no config.json in {path}; run `bash scripts/setup.sh`")
            return
        rep.ok(f"serve.model_dir {path}: config.json loads")
    except InputError as exc:
        rep.bad(str(exc))


def check_render(profile: Profile, rep: Report):
    """Returns the renderer (reused by `regen plan`) or None when it does not load."""
    from regen.render.stage import make_renderer

    cfg = effective_render_config(profile.render, profile.serve)
    try:
        renderer = make_renderer(cfg)
    except InputError as exc:
        rep.bad(str(exc))
        return None
    except Exception as exc:  # a tokenizer directory that exists but does not load
        rep.bad(f"render.tokenizer {cfg.tokenizer!r}: the {cfg.renderer} renderer does not load: "
                f"{type(exc).__name__}: {exc}")
        return None
    rep.ok(f"render: {renderer.name} renderer, tokenizer {renderer.tokenizer_name}")
    return renderer


def check_train(profile: Profile, rep: Report) -> None:
    t = profile.train
    path = _local_dir(t.target, "train.target", rep, "target model")
    if path is None:
        return
    try:
        cfg = _config_json(path, "train.target", t.target)
    except InputError as exc:
        rep.bad(str(exc))
        return
    if cfg is None:
        rep.bad(f"train.target {t.target!r}: no config.json in {path}; give a transformers model directory")
        return
    text = cfg.get("text_config") or cfg
    layers = text.get("num_hidden_layers")
    if isinstance(layers, int) and t.target_layer_ids and max(t.target_layer_ids) >= layers:
        rep.bad(f"train.target_layer_ids {t.target_layer_ids}: the target {path} has {layers} layers (ids 0..{layers - 1})")
        return
    rep.ok(f"train.target {path}: config.json loads ({layers} layers)")
    check_serving(t, text, rep)
    if t.features == "producers":
        check_features(t, text, rep)
    if t.init_from:  # the warm start's draft is read (and checked against the draft) when training starts
        from regen.train.warm_start import read_init

        try:
            init = read_init(resolve_path(t.init_from))
            rep.ok(f"train.init_from {t.init_from}: a {init.layout} draft, {len(init.tensors)} tensors")
        except InputError as exc:
            rep.bad(str(exc))
    if t.tracking:
        from regen.train.tracking import check_backends

        try:
            check_backends(list(t.tracking))
        except InputError as exc:
            rep.bad(str(exc))


def check_serving(t, target_config: dict, rep: Report) -> None:
    """The draft this profile will train, against every serving engine's contract (regen.serve.engines): a problem
    when an engine of `train.serve_engines` refuses it, or when no engine can serve it at all."""
    from types import SimpleNamespace

    from regen.serve.engines import support
    from regen.train.loop import build_draft_config

    try:
        cfg = build_draft_config(t, SimpleNamespace(**target_config))
    except (InputError, ValueError, TypeError) as exc:
        rep.bad(f"train: the draft config does not build: {exc}")
        return
    refused = support(cfg)
    serves = [name for name, r in refused.items() if not r]
    for name in t.serve_engines:
        if refused[name]:
            rep.bad(f"train.serve_engines lists {name}, which cannot serve the draft this profile trains: "
                    + "; ".join(r.line() for r in refused[name]))
    if not serves:
        rep.bad("train: no serving engine can load the draft this profile trains (docs/serve.md): "
                + "; ".join(r.line() for rs in refused.values() for r in rs))
    elif not any(refused[name] for name in t.serve_engines):
        rep.ok(f"train: the draft will load in {', '.join(serves)}"
               + (f" (not in {', '.join(n for n in refused if n not in serves)})" if len(serves) < len(refused) else ""))


def check_features(t, target_config: dict, rep: Report) -> None:
    """`train.features: producers`: the Mooncake store imports, the pool's addresses name no unset variable, and
    the byte budget, segments and buffers hold one feature object (regen.train.features.pool.sizes_for)."""
    from regen.train.features.pool import expanded, sizes_for

    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        from regen.train.features.store import INSTALL_HINT

        rep.bad(f"train.features=producers: the Mooncake store does not import ({exc}): {INSTALL_HINT}")
    p = t.producers
    try:
        for field, value in (("store.master", p.store.master), ("store.metrics_url", p.store.metrics_url),
                             ("store.hostname", p.store.hostname), ("dispatcher_host", p.dispatcher_host)):
            expanded(value, field)
        taps = len(t.target_layer_ids) or 3
        dtype = "bfloat16" if t.target_dtype == "bfloat16" else "float32"  # `auto` checked at its largest, fp32
        sizes = sizes_for(p, taps, int(target_config.get("hidden_size") or 0), dtype, 1, t.max_tokens, t.max_batch)
    except InputError as exc:
        rep.bad(str(exc))
        return
    rep.ok(f"train.features=producers: budget {sizes['budget_bytes']:,} B holds the largest feature object "
           f"({sizes['largest_object_bytes']:,} B)")


def check_endpoints(urls: list[str], model: str, api_key: str | None, timeout_s: float, rep: Report) -> None:
    """Ask every endpoint's /models (`regen.generate.endpoints`); one problem line per failing endpoint."""
    problems = endpoint_problems(urls, model, api_key, timeout_s)
    for problem in problems:
        rep.bad(problem)
    if urls and not problems:
        rep.ok(f"generate: {len(urls)} endpoint(s) list {model!r} and accept the key")


def check_generate(profile: Profile, run: RunDir, rep: Report, *, network: bool = True) -> None:
    from regen.generate.stage import api_key_from_env, resolve_endpoints

    g = profile.generate
    if profile.serve.enabled:
        rep.ok("generate: the embedded target is started by the pipeline; its /models is checked once it is up")
        return
    if run.manifest(run.prompts) and generation_complete(g, run):
        rep.ok("generate: complete on this run directory; no endpoint needed")
        return
    try:
        urls = resolve_endpoints(g, None)
    except InputError as exc:
        rep.bad(str(exc))
        urls = []
    try:
        key = api_key_from_env(g)
    except InputError as exc:
        rep.bad(str(exc))
        return  # asking /models without the key would only repeat the problem as a 401
    if network and urls:
        check_endpoints(urls, g.model, key, g.timeouts.connect, rep)


def check_started_endpoint(base_url: str, model: str, api_key: str | None = None, timeout_s: float = 10.0) -> None:
    """The embedded target's check, once the pipeline has started it. Raises PreflightError on a problem."""
    problem = models_problem(base_url, model, api_key, timeout_s)
    if problem:
        raise PreflightError([problem])


def planned_shard_bytes(profile: Profile) -> int:
    """Shard bytes the profile implies before any selection, from its `plan` assumptions:
    select.total x units_per_prompt x keep_fraction x (prompt_tokens + output_tokens) x shard_bytes_per_token."""
    a = profile.plan
    tokens = a.prompt_tokens + a.output_tokens.get("default", 0)
    return int(profile.select.total * a.units_per_prompt * a.keep_fraction * tokens * a.shard_bytes_per_token)


def check_output(profile: Profile, run: RunDir, rep: Report) -> None:
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


# ---------------------------------------------------------------------------------------------- entry


def check_profile(profile: Profile, run: RunDir, *, network: bool = True) -> Report:
    """Run every check of the stages `profile` will run on `run`; never raises for a problem, returns them all."""
    rep = Report()
    check_select(profile, rep)
    if profile.serve.enabled:
        check_serve(profile, rep)
    check_generate(profile, run, rep, network=network)
    check_render(profile, rep)
    if profile.train.enabled:
        check_train(profile, rep)
    check_output(profile, run, rep)
    return rep


def preflight(profile: Profile, run: RunDir, *, log=print) -> Report:
    """Check everything before the first request; raises PreflightError (an InputError) listing every problem."""
    rep = check_profile(profile, run)
    if rep.problems:
        raise PreflightError(rep.problems)
    log(f"preflight: {len(rep.checks)} checks passed")
    return rep
