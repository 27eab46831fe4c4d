"""The Prefect 3 flow `regen`: the main job's stages as tasks, each calling one stage entry with paths and its
sub-config (the same step functions as `regen run`, `regen.pipeline`). No stage imports Prefect.

    flow regen(profile="local", run_dir="runs/local", overrides={}, train=None,
               retry_errors=False, retry_classes=None, repair=False)
      preflight (every stage's configuration, `regen.preflight`), then the job's steps as `regen run` runs
      them (`regen.pipeline.STEPS`, iterated through `pipeline.steps`): select -> generate (inside the embedded
      target when serve.enabled) -> filter -> render -> train (when train.enabled) -> eval (and train.eval_prompts
      > 0) -> serve (and serve.engine_eval: regen engine-eval), one task each

Resume is the stages' own (exactly-once by request key, manifests and cursors), not Prefect's result cache:
tasks have no cache policy and persist no results, so rerunning the flow on the same `run_dir` finishes what
an interrupted run left. Each task publishes one Markdown artifact (key `regen-<step>`): the mix table, counts
and reject reasons, throughput and error classes. Artifacts hold counts only: never endpoints' credentials,
API keys, or prompt text.

Deployments (`flows/deploy.py`): `regen/local` and `regen/kimi-k3`; parameters are overridable per run, e.g.
`prefect deployment run regen/local --param run_dir=runs/demo --param overrides='{"select.total": 48}'`.
A rerun that re-sends failed units (`regen generate --retry-errors`): `--param retry_errors=true` (classes:
`--param retry_classes='["server_error", "timeout"]'`, default as the CLI's); `--param repair=true` is
`regen generate --repair` (damaged generations parts); `--param recheck=true` is `regen generate --recheck`.
"""
from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from regen import pipeline
from regen.config import load_profile, resolve_path
from regen.config.generate import GenerateConfig
from regen.config.render import RenderConfig, effective_render_config
from regen.config.select import SelectConfig
from regen.config.serve import ServeConfig
from regen.config.train import TrainConfig
from regen.generate import stage
from regen.report import summary
from regen.rundir import RunDir

TASK_OPTIONS = dict(cache_policy=NO_CACHE, persist_result=False, retries=0)


def _run(run_dir: str) -> RunDir:
    return RunDir.at(resolve_path(run_dir))


def _publish(step: str, markdown: str, description: str) -> None:
    create_markdown_artifact(markdown=markdown, key=f"regen-{step}", description=description)


def _rejects(run: RunDir, stage: str) -> summary.Table:
    cols, rows = summary.reject_table(summary.connect(run.root))
    return cols, [r for r in rows if r[0] == stage]


@task(name="preflight", **TASK_OPTIONS)
def preflight_task(profile, run_dir: str) -> dict:
    """`regen.preflight.preflight`: every stage's configuration, before any request; fails the flow run with
    one error listing every problem."""
    report = pipeline.preflight(profile, _run(run_dir), log=get_run_logger().info)
    return {"checks": len(report.checks)}


@task(name="select", **TASK_OPTIONS)
def select_task(select: SelectConfig, seed: int, run_dir: str, render: RenderConfig | None = None) -> dict:
    run = _run(run_dir)
    pipeline.step_select(select, run, seed=seed, progress=False, render=render)
    con = summary.connect(run.root)
    md = summary.markdown_table(summary.mix_table(con), "Mix (prompts per category)")
    md += "\n" + summary.markdown_table(summary.language_table(con), "Languages")
    md += "\n" + summary.markdown_table(_rejects(run, "select"), "Rejected by the prompt filters")
    _publish("select", md, "selected prompt mix and prompt-filter rejects")
    return summary.stage_counts(run.root).get("select", {})


@task(name="generate", **TASK_OPTIONS)
def generate_task(generate: GenerateConfig, serve: ServeConfig, run_dir: str, retry_classes: list[str] | None = None,
                  repair: bool = False, recheck: bool = False) -> dict:
    run = _run(run_dir)
    logger = get_run_logger()
    if repair or retry_classes is not None or recheck:  # the stage's own recheck / repair / retry, then generate
        cfg = generate
        if serve.enabled:  # the identity is checked with the served model id and engine, as the generate step will
            from regen.target.server import served_generate

            cfg = served_generate(generate, serve)
        if recheck and any(run.generations.glob("ledger-*.jsonl")):  # rows to judge
            logger.info(stage.format_recheck(stage.recheck_run(cfg, run)["recheck"]))
        if repair or retry_classes is not None:
            logger.info("generate: %s", stage.prepare(cfg, run, repair=repair, retry_classes=retry_classes))
    manifest = pipeline.step_generate(generate, serve, run, progress=False, log=logger.info)
    if manifest.get("last_retry"):
        logger.info(stage.format_retry(manifest["last_retry"], tuple(manifest["last_retry"]["classes"])))
    counts = summary.stage_counts(run.root).get("generate", {})
    plain = {k: v for k, v in counts.items() if not isinstance(v, dict)}
    md = summary.dict_markdown(plain, "Generations: accounting and throughput")
    for key, title in (("error_rows_by_class", "Error rows by class"), ("failures_by_class", "Failed attempts by class")):
        md += "\n" + summary.markdown_table((["class", "count"], sorted((counts.get(key) or {}).items())), title)
    md += "\n" + summary.markdown_table(summary.generation_table(summary.connect(run.root)), "Rows by outcome")
    _publish("generate", md, "generation counts, throughput and error classes")
    logger.info("generate: %s", plain)
    return plain


@task(name="filter", **TASK_OPTIONS)
def filter_task(render: RenderConfig, run_dir: str) -> dict:
    run = _run(run_dir)
    pipeline.step_filter(render, run, progress=False)
    counts = summary.stage_counts(run.root).get("filter", {})
    md = summary.dict_markdown({k: v for k, v in counts.items() if not isinstance(v, dict)}, "Response filters")
    md += "\n" + summary.markdown_table(_rejects(run, "render"), "Rejected rows by filter (render stage)")
    _publish("filter", md, "response-filter counts and reject reasons")
    return counts


@task(name="render", **TASK_OPTIONS)
def render_task(render: RenderConfig, run_dir: str) -> dict:
    run = _run(run_dir)
    pipeline.step_render(render, run, progress=False)
    counts = summary.stage_counts(run.root).get("render", {})
    md = summary.dict_markdown(counts, "Shards")
    md += "\n" + summary.markdown_table(summary.mix_table(summary.connect(run.root)), "Mix (prompts and samples)")
    _publish("render", md, "shards written, drift rate and the final mix")
    return counts


@task(name="train", **TASK_OPTIONS)
def train_task(train: TrainConfig, run_dir: str) -> dict:
    result = pipeline.step_train(train, _run(run_dir))
    plain = {k: v for k, v in (result or {}).items() if isinstance(v, (int, float, str, bool))}
    _publish("train", summary.dict_markdown(plain, "Training"), "draft training summary")
    return plain


@task(name="eval", **TASK_OPTIONS)
def eval_task(train: TrainConfig, run_dir: str) -> dict:
    result = pipeline.step_eval(train, _run(run_dir))
    print(pipeline.eval_line(result))
    if "skipped" in result:
        _publish("eval", f"# Acceptance length\n\n{result['skipped']}\n", "acc_len not measured")
        return result
    rows = {name: result[name]["acc_len"] for name in result.get("drafts", {}) if name in result}
    plain = {**{f"acc_len_{k}": v for k, v in rows.items()}, "num_prompts": result.get("num_prompts"),
             "max_new_tokens": result.get("max_new_tokens"), "seed": result.get("seed")}
    _publish("eval", summary.dict_markdown(plain, "Acceptance length (held-out prompts)"),
             "acc_len of the trained draft vs an untrained one")
    return plain


@task(name="serve", **TASK_OPTIONS)
def engine_eval_task(prof, run_dir: str) -> dict:
    """The trained draft served by llama.cpp beside the embedded target (regen engine-eval, docs/serve.md)."""
    result = pipeline.step_engine_eval(prof, _run(run_dir))
    counts = {k: v for k, v in summary.stage_counts(_run(run_dir).root).items() if k.startswith("serve")}
    _publish("serve", "\n".join(summary.dict_markdown(v, k) for k, v in counts.items()),
             "the draft served by llama.cpp: acc_len and speedup")
    return {"by_gguf_type": sorted(result.get("by_gguf_type", {}))}


@flow(name="regen", log_prints=True, persist_result=False)
def regen(profile: str = "local", run_dir: str = "runs/local", overrides: dict[str, Any] | None = None,
          train: bool | None = None, retry_errors: bool = False, retry_classes: list[str] | None = None,
          repair: bool = False, recheck: bool = False) -> dict:
    """Run a profile's stages on `run_dir` (relative to the repository root unless absolute).

    overrides: dotted profile keys -> values, as `--set` on the command line (e.g. {"select.total": 48}).
    train: force `train.enabled` on or off (None = the profile's).
    retry_errors / retry_classes: as `regen generate --retry-errors --classes ...` (None: the transient classes).
    repair: as `regen generate --repair`. recheck: as `regen generate --recheck` (judge the ok rows already held
    by the current checks first; with retry_errors the faulty ones are re-sent in the same run).
    """
    prof = load_profile(profile, dict(overrides or {}))
    if train is not None:
        prof = prof.model_copy(update={"train": prof.train.model_copy(update={"enabled": train})})
    render = effective_render_config(prof.render, prof.serve)
    classes = (retry_classes or []) if retry_errors else None
    out = {"preflight": preflight_task(prof, run_dir)}
    tasks = {  # each step of `regen.pipeline.STEPS` as this flow's task (the same step function inside)
        "select": lambda: select_task(prof.select, prof.seed, run_dir, render),
        "generate": lambda: generate_task(prof.generate, prof.serve, run_dir, classes, repair, recheck),
        "filter": lambda: filter_task(render, run_dir),
        "render": lambda: render_task(render, run_dir),
        "train": lambda: train_task(prof.train, run_dir),
        "eval": lambda: eval_task(prof.train, run_dir),
        "serve": lambda: engine_eval_task(prof, run_dir),
    }
    for step in pipeline.steps(prof, out):  # the job's steps and conditions, as `regen run` iterates them
        out[step.name] = tasks[step.name]()
    return out


if __name__ == "__main__":
    regen()
