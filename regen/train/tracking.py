"""Experiment tracking of `regen train` and `regen eval`: figures to TensorBoard beside
`log.jsonl`, W&B or MLflow where installed and asked for, and a progress line for logs nobody watches.

    <train>/tensorboard/   TensorBoard event files: train/<metric> per logged step (loss, ce, l1, conf,
                           tau_probabilistic, lr, grad_norm, step_s, ...), eval_during_training/<figure> per
                           estimate (`regen.train.periodic_eval`), eval/<draft>/<figure> and per cell
                           eval/cell/<category>/<band>/<mode> from `regen eval`, the run's configuration as
                           text at the start and as HParams with the final figures at the end

`train.tracking` lists the backends (default `[tensorboard]`): `wandb` (project `train.tracking_project`, its
files under <train>/wandb, offline unless WANDB_MODE says otherwise) and `mlflow` (experiment
`train.tracking_project`, MLFLOW_TRACKING_URI or ./mlruns) are used only when asked; asking for one that is not
installed is an InputError before training starts. Only rank 0 writes.

The hyperparameters are the run's own configuration as its files record it (`run_config`): the train section,
the selection's `select` config (prompts/manifest.json), the generation request config
(generations/request_config.json) and the shards' training contract (shards/manifest.json), flattened to dotted
keys (`train.lr`, `select.mix.coding`, ...); lists and null become JSON text, as TensorBoard's HParams wants
scalars and strings.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from regen.errors import InputError

BACKENDS = ("tensorboard", "wandb", "mlflow")
_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def check_backends(names: list[str]) -> None:
    """InputError naming each asked backend that is not installed (before any step is trained)."""
    import importlib.util

    missing = [n for n in names if importlib.util.find_spec(_MODULES[n]) is None]
    if missing:
        raise InputError(f"train.tracking asks for {missing}, not installed in this environment: install them "
                         f"(pip install {' '.join(missing)}) or remove them from train.tracking (tensorboard is a "
                         "dependency of regen: `bash scripts/setup.sh` installs it)")


def flatten(tree, prefix: str = "") -> dict:
    """Nested dicts -> {dotted key: int | float | str | bool}; lists and None as JSON text."""
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(tree, (bool, int, float, str)):
        out[prefix] = tree
    else:
        out[prefix] = json.dumps(tree, sort_keys=True, default=str)
    return out


def run_config(train_cfg, run) -> dict:
    """The run's configuration from its own files (module docstring), nested by section."""
    from schemas.io import read_json

    out = {"train": train_cfg.model_dump()}
    if run is not None:
        prompts = read_json(Path(run.prompts) / "manifest.json") or {}
        if prompts.get("config"):
            out["select"] = {**prompts["config"], "seed": prompts.get("seed")}
        stamp = read_json(Path(run.generations) / "request_config.json") or {}
        if stamp:
            out["generate"] = stamp.get("request_config") or stamp
        shards = read_json(Path(run.shards) / "manifest.json") or {}
        if shards.get("contract"):
            out["render"] = shards["contract"]
    return out


def _numbers(rec: dict) -> dict[str, float]:
    return {k: float(v) for k, v in rec.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}


class Tracker:
    """Rank 0's writer of the figures (module docstring); every method is a no-op on other ranks.

    `log(rec)`: one logged training step (a `log.jsonl` line); `log_eval(step, figures, prefix)`: evaluation
    figures at a step; `progress(step)`: the progress line when `interval_s` has passed; `close(final)`: the
    HParams with the final figures, then the writers are closed.
    """

    def __init__(self, cfg, train_dir: Path, run=None, *, is_main: bool = True, total_steps: int = 0,
                 start_step: int = 0, out=None):
        self.enabled = is_main
        self.names = list(cfg.tracking)
        self.interval_s = cfg.progress_interval_s
        self.total, self.start = total_steps, start_step
        self.t0 = self.last_print = time.monotonic()
        self.last: dict = {}
        self.out = out or sys.stdout
        self.tb = self.wandb = self.mlflow = None
        if not self.enabled:
            return
        check_backends(self.names)
        self.hparams = flatten(run_config(cfg, run))
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(Path(train_dir) / "tensorboard"))
            self.tb.add_text("run_config", "```json\n" + json.dumps(run_config(cfg, run), indent=1, default=str)
                             + "\n```", global_step=start_step)
        if "wandb" in self.names:
            import os

            import wandb

            os.environ.setdefault("WANDB_MODE", "offline")
            self.wandb = wandb.init(project=cfg.tracking_project, dir=str(train_dir), config=self.hparams,
                                    resume="allow")
        if "mlflow" in self.names:
            import mlflow

            mlflow.set_experiment(cfg.tracking_project)
            self.mlflow = mlflow.start_run(run_name=Path(train_dir).resolve().parent.name)
            mlflow.log_params({k[:250]: str(v)[:500] for k, v in self.hparams.items()})

    def log(self, rec: dict) -> None:
        if not self.enabled:
            return
        step = int(rec["step"])
        nums = {k: v for k, v in _numbers(rec).items() if k != "step"}
        self.last = {**nums, "step": step}
        self._scalars("train", nums, step)

    def log_eval(self, step: int, figures: dict, prefix: str) -> None:
        if self.enabled:
            self._scalars(prefix, _numbers(figures), step)

    def _scalars(self, prefix: str, values: dict, step: int) -> None:
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(f"{prefix}/{k}", v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({f"{prefix}/{k}": v for k, v in values.items()}, step=step)
        if self.mlflow is not None:
            import mlflow

            mlflow.log_metrics({f"{prefix}.{k}": v for k, v in values.items()}, step=step)

    def progress(self, step: int, force: bool = False) -> None:
        """Print `train: step S/T (P%), loss L, tau_p X, R steps/s, ETA` when `interval_s` has passed."""
        now = time.monotonic()
        if not self.enabled or self.interval_s <= 0 or (not force and now - self.last_print < self.interval_s):
            return
        self.last_print = now
        rate = (step - self.start) / max(1e-9, now - self.t0)
        eta = (self.total - step) / rate if rate > 0 and self.total else None
        loss = self.last.get("loss")
        parts = [f"train: step {step:,}/{self.total:,} ({step / max(1, self.total):.0%})"]
        if loss is not None:
            parts.append(f"loss {loss:.4f} (step {self.last['step']:,})")
        if self.last.get("tau_probabilistic") is not None:
            parts.append(f"tau_p {self.last['tau_probabilistic']:.3f}")
        parts.append(f"{rate * 60:.1f} steps/min")
        if eta is not None:
            parts.append(f"ETA {eta / 60:.1f} min")
        print(", ".join(parts), file=self.out, flush=True)

    def close(self, final: dict | None = None) -> None:
        if not self.enabled:
            return
        metrics = {f"final/{k}": v for k, v in _numbers(final or {}).items()}
        if self.tb is not None:
            if metrics:
                self.tb.add_hparams({k: v for k, v in self.hparams.items()}, metrics, run_name=".")
            self.tb.close()
        if self.wandb is not None:
            self.wandb.summary.update(metrics)
            self.wandb.finish()
        if self.mlflow is not None:
            import mlflow

            mlflow.log_metrics({k.replace("/", "."): v for k, v in metrics.items()})
            mlflow.end_run()


def eval_figures(out: dict) -> tuple[dict[str, float], dict[str, float]]:
    """(per-draft figures, per-cell figures) of an eval.json dict as flat {tag: value} for the trackers."""
    drafts, cells = {}, {}
    for name in out.get("drafts", {}):
        res = out.get(name) or {}
        for k in ("acc_len", "acc_len_per_request"):
            if isinstance(res.get(k), (int, float)):
                drafts[f"{name}/{k}"] = float(res[k])
        if name == "trained":
            for c in (res.get("breakdown") or {}).get("cells", []):
                tag = "/".join(str(x) for x in (c["category"], c.get("length_band") or "-", c.get("mode") or "-"))
                if c.get("acc_len_per_round") is not None:
                    cells[f"{tag}/acc_len_per_round"] = float(c["acc_len_per_round"])
                if c.get("acc_len_per_request") is not None:
                    cells[f"{tag}/acc_len_per_request"] = float(c["acc_len_per_request"])
    return drafts, cells


def track_eval(out: dict, draft_dir: Path, run, train_cfg) -> Path | None:
    """`regen eval`'s figures to the trackers of the draft's training directory (`<train>/tensorboard` when the
    draft is `<train>/checkpoints/step-N`, else `<run>/train`), at the draft's step. Returns the training
    directory written to, or None when `train.tracking` is empty."""
    if not train_cfg.tracking:
        return None
    d = Path(draft_dir)
    train_dir = d.parents[1] if d.parent.name == "checkpoints" else Path(run.train)
    step = int(d.name.split("-")[-1]) if d.name.startswith("step-") and d.name.split("-")[-1].isdigit() else 0
    quiet = train_cfg.model_copy(update={"progress_interval_s": 0})
    tracker = Tracker(quiet, train_dir, run, total_steps=step, start_step=step)
    drafts, cells = eval_figures(out)
    tracker.log_eval(step, drafts, "eval")
    tracker.log_eval(step, cells, "eval/cell")
    tracker.close()
    return train_dir

