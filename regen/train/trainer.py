"""The trainer: its state declared as attributes, each component built from its own sub-config, `build` then
`train` (the way torchtitan's `Trainer` reads). `regen.train.loop.run_train` makes the process group, takes the
training directory's lease and runs `Trainer(...).build().train()`.

    build:  target (frozen; `FeaturesConfig`) -> shards' contract -> feed (`FeedConfig`) and held-out split ->
            resume point and warm start -> draft (`DSparkConfig`, `build_draft_config`), sharded (FSDP2) ->
            optimizer and schedule (`OptimizerConfig`) -> resume -> features (in process, or a producer pool) ->
            hooks (tracking, held-out estimate, best checkpoint)
    train:  per step: take the feed's step, prepare its micro-batches (`regen.train.step.prepare_microbatch`), fetch
            features, `train_step`, log, hooks, checkpoint; then the final checkpoint and summary.json

Loss normalisation (spec §5): each micro-batch's loss from `regen.train.loss.dspark_loss` is
Σ w·term / Σ_ranks w · world_size; with `train.loss_normalization: step` (default) it is rescaled by
(Σ_ranks w of that micro-batch) / (Σ_ranks w of the whole step) so an optimizer step over A micro-batches on W
ranks equals one step over the same global batch at any (W, A); with `micro_batch` it is divided by A (the
reference's weighting, DS trainer). Anchors are drawn from a generator seeded by (seed, epoch, global micro-batch
index): the same sample gets the same anchors at any world size and after a resume.

Outputs in the training directory: checkpoints/step-*/ (servable draft + resumable state), latest.json,
heldout.json, log.jsonl (one line per logged step), summary.json (what `train` returns).
Spec: shared/docs/dspark.md §5 (objective), §6 (recipe), §8 (config).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from regen.errors import InputError
from regen.train import warm_start
from regen.train.build import build_draft
from regen.train.checkpoint import agreed_resume, load_checkpoint, save_checkpoint
from regen.train.collectives import control_all_reduce_sum
from regen.train.draft_config import build_draft_config, check_rope_theta
from regen.train.draft_vocab import draft_vocabulary
from regen.train.feature_cache import CachedFeatures, feature_cache_bytes
from regen.train.feed import FeedConfig, ShardFeed
from regen.train.guard import DivergenceMonitor, raise_nonfinite
from regen.train.heldout import heldout_split
from regen.train.lookahead import StepLookahead
from regen.train.parallel import raise_if_any_rank_failed, shard_model
from regen.train.periodic_eval import TrainHooks
from regen.train.resume import check_resume, resume_key
from regen.train.step import (
    make_objective,
    prepare_microbatch,
    reduce_metrics,
    share_frozen_with_target,
    train_step,
    zero_loss,
)
from regen.train.target import TargetContract, TargetFeatures, declared_contract

log = logging.getLogger(__name__)


def native_bf16(cpuinfo: str | None = None) -> bool:
    """True when this CPU computes bf16 matmuls natively: x86 `avx512_bf16` or `amx_bf16`, Arm `bf16` (the flags
    of /proc/cpuinfo). Without them torch emulates bf16 on CPU, about 10x slower than fp32 (2-core AVX2 EPYC:
    14.7 s against 1.4 s per step of the local profile; docs/benchmarks.md)."""
    if cpuinfo is None:
        try:
            cpuinfo = open("/proc/cpuinfo").read()
        except OSError:
            return False
    flags = {f for line in cpuinfo.splitlines() if line.split(":")[0].strip() in ("flags", "Features")
             for f in line.split(":", 1)[1].split()}
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`train.dtype` / `train.target_dtype` on `device`: `auto` is bf16 on CUDA and on a CPU with native bf16
    (`native_bf16`), else fp32; `float32` / `bfloat16` as named."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or (device.type == "cpu" and native_bf16()) else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def lr_lambda(total_steps: int, warmup_frac: float, min_lr_frac: float):
    """Multiplier of the base lr at step s: linear warmup over warmup_frac·total, then cosine to min_lr_frac."""
    warmup = max(1, int(round(warmup_frac * total_steps))) if warmup_frac > 0 else 0

    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        t = min(1.0, (s - warmup) / max(1, total_steps - warmup))
        return min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t))

    return f


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW, linear warmup then cosine, gradient-norm clip, and the step's loss weighting (spec §6)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    warmup_frac: float
    min_lr_frac: float
    grad_clip: float
    loss_weights: tuple[float, ...]  # CE, L1, confidence
    loss_normalization: str  # step | micro_batch

    @classmethod
    def from_train(cls, cfg) -> "OptimizerConfig":
        return cls(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                   warmup_frac=cfg.warmup_frac, min_lr_frac=cfg.min_lr_frac, grad_clip=cfg.grad_clip,
                   loss_weights=tuple(cfg.loss_weights), loss_normalization=cfg.loss_normalization)

    def build(self, model, total_steps: int):
        """(AdamW over `model`'s trainable parameters, its LambdaLR schedule of `total_steps` steps)."""
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=self.lr, betas=self.betas,
                                eps=self.eps, weight_decay=self.weight_decay)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total_steps, self.warmup_frac, self.min_lr_frac))


@dataclass(frozen=True)
class FeaturesConfig:
    """Where the tap features come from: the whole target in this rank (`in_process`), or only its head here and
    the features from a producer pool (`producers`, `regen.train.features.pool`)."""

    source: str  # in_process | producers
    target_dtype: str  # auto | float32 | bfloat16
    head_keys: dict  # tensor names of the target head (regen.train.target_head), empty = the architecture's
    cache_bytes: int  # host bytes of the in-process features kept per row (regen.train.feature_cache), 0 = off

    @classmethod
    def from_train(cls, cfg) -> "FeaturesConfig":
        return cls(source=cfg.features, target_dtype=cfg.target_dtype, head_keys=dict(cfg.target_head_keys),
                   cache_bytes=feature_cache_bytes(cfg.feature_cache_gib))

    def build_target(self, target_path: Path, contract: TargetContract, dtype: torch.dtype, device):
        """(the frozen target, the contract it serves): a `TargetFeatures` (the whole model), or a `TargetHead`
        (embeddings, final norm, LM head) whose contract is read from the model's config."""
        if self.source == "producers":
            from regen.train.target_head import TargetHead

            head = TargetHead.from_pretrained(target_path, dtype=dtype, device=device, keys=self.head_keys or None)
            return head, contract.for_model(head.config)
        return TargetFeatures.from_pretrained(target_path, contract, dtype=dtype, device=device), contract


class Trainer:
    """One `regen train` run in the process group `info`: `Trainer(cfg, run, info, target_path, train_dir,
    follow=...).build().train(stop_after_steps)` -> the summary dict (also `<train_dir>/summary.json` on rank 0).
    `close()` stops the producer pool when there is one. Raises InputError for shards that do not match the target,
    a schedule with no step, or `--follow` without train.max_steps; resume refusals from `regen.train.resume`."""

    # -- settings, resolved once ------------------------------------------------------------------------------
    cfg: object  # the TrainConfig (the hooks and the pool read it whole)
    seed: int
    dtype: torch.dtype  # the draft's compute dtype (train.dtype resolved on this device)
    target_dtype: torch.dtype
    optim: OptimizerConfig
    features: FeaturesConfig
    feed_cfg: FeedConfig
    draft_cfg: object  # DSparkConfig
    # -- components -------------------------------------------------------------------------------------------
    target: object  # TargetFeatures | TargetHead
    contract: TargetContract
    feed: ShardFeed
    model: torch.nn.Module  # the FSDP2-sharded objective (regen.train.step.make_objective); .draft is the draft
    t2d: torch.Tensor | None  # bool[V] of a reduced draft vocabulary (host)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    pool: object | None  # the FeaturePool (train.features: producers)
    source: object  # what train_step reads features from: the target, its CachedFeatures, or the pool's features
    hooks: TrainHooks
    # -- position and records ---------------------------------------------------------------------------------
    step: int
    total_steps: int
    num_epochs: int | None
    resume_from: Path | None
    training_meta: dict  # training.json of every checkpoint
    vocab_report: dict

    def __init__(self, cfg, run, info, target_path: Path, train_dir: Path, *, follow: bool = False):
        if cfg.seed is None:  # a bare TrainConfig (a profile fills train.seed with its own seed on load)
            cfg = cfg.model_copy(update={"seed": 0})
        self.cfg, self.run, self.info, self.seed = cfg, run, info, cfg.seed
        self.target_path, self.train_dir, self.follow = Path(target_path), Path(train_dir), follow
        self.dtype = resolve_dtype(cfg.dtype, info.device)
        self.target_dtype = resolve_dtype(cfg.target_dtype, info.device)
        self.optim = OptimizerConfig.from_train(cfg)
        self.features = FeaturesConfig.from_train(cfg)
        self.pool = None

    # -- build ----------------------------------------------------------------------------------------------------
    def build(self) -> "Trainer":
        """Every component, in the module docstring's order (collective: every rank builds the same)."""
        cfg, info = self.cfg, self.info
        torch.manual_seed(self.seed)  # identical draft init on every rank
        self.draft_cfg = build_draft_config(cfg, AutoConfig.from_pretrained(str(self.target_path),
                                                                            local_files_only=True))
        self.target, self.contract = self.features.build_target(
            self.target_path, TargetContract.from_draft_config(self.draft_cfg), self.target_dtype, info.device)
        if info.is_main:
            log.info("target in each rank (train.features=%s): %.1f MiB", self.features.source,
                     self.target.memory_bytes / 2**20)
        self._check_shards()
        self._build_feed()
        self.resume_from, fallback = agreed_resume(self.train_dir, info)
        init = warm_start.prepare(cfg, self.draft_cfg, self.resume_from, info.is_main)  # train.init_from
        self.vocab_ids, self.vocab_report = (
            warm_start.vocabulary(init) if init is not None and init.d2t is not None
            else draft_vocabulary(self.draft_cfg, self.feed, self.resume_from, follow=self.follow))
        warm = self._build_model(init)
        self.total_steps = self._schedule_length()
        self.optimizer, self.scheduler = self.optim.build(self.model, self.total_steps)
        key, changes = self._resume()
        self._record(key, warm, fallback, changes)
        self.num_epochs = cfg.epochs if cfg.epochs > 0 else None  # ends at the first of max_steps and epochs
        return self

    def _check_shards(self) -> None:
        """The shards' declared contract against the target's (before anything is read)."""
        self.manifest_path = Path(self.run.shards) / "manifest.json"
        self.shards_manifest = None
        if self.manifest_path.exists():
            self.shards_manifest = json.loads(self.manifest_path.read_text())
            self.contract.check(declared_contract(self.shards_manifest), str(self.manifest_path))
            if (self.shards_manifest.get("contract") or {}).get("test_vocabulary"):
                raise InputError(f"{self.manifest_path}: the shards were rendered with the project's test vocabulary, "
                                 "not the target's tokenizer; set render.tokenizer to the target's and re-render")

    def _build_feed(self) -> None:
        """This rank's feed over the shards, leaving out the held-out split (the same on every rank)."""
        cfg, info = self.cfg, self.info
        self.held = heldout_split(self.run, cfg.heldout_fraction, cfg.heldout_per_cell)
        self.feed_cfg = dataclasses.replace(FeedConfig.from_train(cfg), seed=self.seed,
                                            heldout_picks=self.held.picks_sha256 if self.held.picks else "")
        self.feed = ShardFeed(self.run.shards, self.feed_cfg, rank=info.rank, world_size=info.world_size,
                              grad_accum=cfg.grad_accum, follow=self.follow,
                              heldout=self.held if self.held.fraction > 0 or self.held.picks else None)

    def _build_model(self, init):
        """The draft on the meta device, materialised on the rank's device, warm-started, its frozen head shared
        with the target's, wrapped as the objective and sharded (FSDP2). Returns the warm start's record."""
        from regen.train.attention import training_impl

        draft = build_draft(self.target.model, self.draft_cfg, self.info.device, draft_vocab=self.vocab_ids,
                            frozen_dtype=self.dtype)
        draft.attention_impl = training_impl(self.cfg.attention, self.info.device)
        warm = warm_start.load_into(draft, init) if init is not None else None
        share_frozen_with_target(draft, self.target.model, self.dtype)
        self.t2d = draft.t2d.cpu() if self.draft_cfg.draft_vocab_size else None
        self.model = shard_model(make_objective(draft), self.info, blocks=draft.layers,
                                 param_dtype=None if self.dtype == torch.float32 else self.dtype)
        return warm

    def _schedule_length(self) -> int:
        cfg = self.cfg
        if cfg.max_steps > 0:
            return cfg.max_steps
        if self.follow:
            raise InputError("--follow needs train.max_steps (the schedule's length): e.g. --max-steps 2000")
        if cfg.epochs <= 0:
            raise InputError("train.epochs=0 (repeat the data) needs train.max_steps > 0")
        steps = self.feed.count_steps(cfg.epochs)
        if steps == 0:
            raise InputError(f"{self.manifest_path}: no full optimizer step of training data (after held-out and "
                             "length filters); render more shards or lower train.grad_accum")
        return steps

    def _resume(self) -> tuple[dict, list]:
        """(the resume key, the settings a resume changes): the checkpoint checked against this run before any load,
        then model, optimizer, schedule, feed position and RNG restored; `self.step` is where training goes on."""
        from regen.train.model import CONFIG_NAME, DSparkConfig

        self.step, changes = 0, []
        key = resume_key(self.cfg, shards_manifest=self.shards_manifest, target_path=self.target_path,
                         world_size=self.info.world_size, total_steps=self.total_steps)
        if self.resume_from is None:
            return key, changes
        where = Path(self.resume_from) / CONFIG_NAME
        check_rope_theta(DSparkConfig.from_json(where), self.draft_cfg.rope_theta, checkpoint=str(where),
                         expected_from="this run's draft config")
        changes = check_resume(self.resume_from, key, shards_manifest=self.shards_manifest, follow=self.follow,
                               lr_lambda=lr_lambda)
        if self.info.is_main:
            for c in changes:
                log.warning("resume changes %s: %s -> %s %s", c["setting"], c["old"], c["new"], c["note"])
        self.step = load_checkpoint(self.resume_from, self.model, self.optimizer, self.scheduler, self.feed)
        if self.info.is_main:
            log.info("resumed from %s at step %d", self.resume_from, self.step)
        return key, changes

    def _record(self, key: dict, warm, fallback, changes: list) -> None:
        """training.json's content (every checkpoint's), and heldout.json (the split `regen eval` keeps to)."""
        cfg = self.cfg
        dtypes = {"draft": str(self.dtype).removeprefix("torch."),
                  "target": str(self.target.model.dtype).removeprefix("torch."),
                  "asked": [cfg.dtype, cfg.target_dtype], "cpu_native_bf16": native_bf16()}
        if self.info.is_main:
            log.info("dtype: draft %s, target %s (train.dtype %s, train.target_dtype %s; CPU native bf16: %s)",
                     dtypes["draft"], dtypes["target"], cfg.dtype, cfg.target_dtype, dtypes["cpu_native_bf16"])
        self.key = key
        self.training_meta = {
            "profile_train": cfg.model_dump(), "target": str(self.target_path), "world_size": self.info.world_size,
            "shards_manifest": str(self.manifest_path), "draft_vocab": self.vocab_report, "dtype": dtypes,
            "init_from": warm, "resume_key": key, "heldout": self.held.record(),
            "resume": {"from": str(self.resume_from) if self.resume_from else None, "fallback": fallback,
                       "changes": changes}}
        if self.info.is_main:
            from schemas.io import write_json_atomic

            self.train_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic({**self.held.record(), "shards": key["shards"], "num_shards": key["num_shards"]},
                              self.train_dir / "heldout.json")

    def _start_features(self, stop_after_steps: int | None) -> None:
        """The features' source: the in-process target (its features kept per row with `train.feature_cache_gib`),
        or a producer pool started for this run's steps."""
        self.source = self.target
        if self.features.source != "producers":
            if self.features.cache_bytes > 0:
                self.source = CachedFeatures(self.target, self.features.cache_bytes)
            return
        if self.features.cache_bytes > 0 and self.info.is_main:
            log.info("train.feature_cache_gib is for in-process features: not used with features: producers")
        from regen.train.features.pool import FeaturePool

        left = self.total_steps - self.step
        self.pool = FeaturePool.for_training(
            self.cfg, info=self.info, run=self.run, follow=self.follow, feed_cfg=self.feed_cfg,
            heldout=self.feed.heldout, feed_state=self.feed.state_dict(),
            dtype=str(self.target_dtype).removeprefix("torch."), head=self.target, contract=self.contract,
            train_dir=self.train_dir, target_path=str(self.target_path), num_epochs=self.num_epochs,
            num_steps=min(left, stop_after_steps) if stop_after_steps else left)
        self.source = self.pool.features

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    # -- train ----------------------------------------------------------------------------------------------------
    def train(self, stop_after_steps: int | None = None) -> dict:
        """Steps until the schedule's end, the feed's end or `stop_after_steps` steps of this invocation (a
        preemption: the next run resumes); then the final checkpoint and the summary."""
        self._start_features(stop_after_steps)
        self.hooks = TrainHooks(self.cfg, self.run, self.train_dir, self.target, self.info, self.total_steps,
                                self.step)  # tracking, estimates, best
        cfg, info, pool, train_dir = self.cfg, self.info, self.pool, self.train_dir
        history, t_start, cpu_start = [], time.perf_counter(), time.process_time()
        totals = torch.zeros(5, dtype=torch.float64)  # tokens, target s, step s, feature fetch s, rows (this rank)
        ckpt, steps_here = self.resume_from, 0
        train_dir.mkdir(parents=True, exist_ok=True)
        if info.is_main and (train_dir / "stopped.json").exists():  # the last run's stop (regen.train.guard)
            log.info("the previous run stopped: %s", json.loads((train_dir / "stopped.json").read_text())["message"])
            (train_dir / "stopped.json").unlink()
        # the feed's steps; with read-ahead the next one is pulled while this one trains, the position stays exact
        steps = StepLookahead(self.feed, self.num_epochs)
        read_ahead = pool is not None and pool.read_ahead > 0
        divergence = DivergenceMonitor()
        more = lambda n: stop_after_steps is None or steps_here + n < stop_after_steps  # noqa: E731
        while self.step < self.total_steps and more(0):
            t0, error, mbs = time.perf_counter(), None, []
            try:  # a bad shard or row on one rank stops every rank now, not at the process-group timeout
                batch_step = steps.take()  # the position (steps.state_dict(), checkpointed) advances here
                if batch_step is not None:
                    mbs = [prepare_microbatch(mb, self.seed, self.draft_cfg, info.device, self.t2d)
                           for mb in batch_step.microbatches]
            except Exception as exc:  # noqa: BLE001 - agreed on by every rank, then raised on every rank
                error = exc
            raise_if_any_rank_failed(error)
            if batch_step is None:
                break
            t1 = time.perf_counter()
            zero = pool.fetch_step(batch_step.microbatches) if pool is not None else set()  # agreed the same way
            stall0 = pool.features.stats["stall_s"] if pool is not None else 0.0
            if read_ahead and self.step + 1 < self.total_steps and more(1):
                steps.pull_next(lambda s: pool.submit(s.microbatches, ahead=True))  # read while this one computes
            fetch_s = time.perf_counter() - t1
            for b, _, _ in mbs:
                if b["key"] in zero:  # its features failed on every attempt: trained with zero weight, ranks in step
                    zero_loss(b)
            m = train_step(self.model, self.source, self.optimizer, mbs, loss_weights=self.optim.loss_weights,
                           grad_clip=self.optim.grad_clip, loss_normalization=self.optim.loss_normalization)
            if read_ahead:  # the wait for features inside the step: the reader was behind
                fetch_s += pool.features.stats["stall_s"] - stall0
            if not m["finite"]:  # every rank agreed (train_step): stop before anything is saved
                if pool is not None:  # a feature failure or read error of the step: raised as itself on every rank
                    pool.raise_if_failed()
                raise_nonfinite(self.step + 1, m, batch_step, ckpt, info, train_dir)  # regen.train.guard
            self.scheduler.step()
            self.step, steps_here = self.step + 1, steps_here + 1
            step, step_s = self.step, time.perf_counter() - t0
            rows = sum(len(mb.sample_ids) for mb in batch_step.microbatches)
            totals += torch.tensor([m["tokens"], m["target_s"], step_s, fetch_s, rows], dtype=torch.float64)
            if cfg.log_samples:
                with open(train_dir / f"samples-rank{info.rank}.jsonl", "a", encoding="utf-8") as f:
                    ids = [sid for mb in batch_step.microbatches for sid in mb.sample_ids]
                    f.write(json.dumps({"step": step, "sample_ids": ids}) + "\n")
            if step % cfg.log_every == 0 or step == self.total_steps or step == 1:
                history.append(self._log(step, batch_step.epoch, m, step_s, fetch_s, divergence))
            self.hooks.after_step(step, self.model)
            if cfg.checkpoint_every > 0 and step % cfg.checkpoint_every == 0 and step < self.total_steps:
                ckpt = self._save(steps)
        # -- the final checkpoint ------------------------------------------------------------------------------------
        self.hooks.after_step(self.step, self.model, final=True)  # the last step's estimate (and best) before it
        loop_s = time.perf_counter() - t_start
        if ckpt is None or not ckpt.name.endswith(f"{self.step:06d}"):
            ckpt = self._save(steps)
        totals = control_all_reduce_sum(totals, "the run's totals")
        summary = self._summary(totals, loop_s, t_start, cpu_start, history, ckpt, steps, divergence)
        if info.is_main:
            from schemas.io import write_json_atomic

            write_json_atomic(summary, train_dir / "summary.json")
        self.target.close()
        return summary

    def _log(self, step: int, epoch: int, m: dict, step_s: float, fetch_s: float, divergence) -> dict:
        """A logged step's record (collective: the metrics are reduced over ranks), to log.jsonl and the hooks."""
        rec = {"step": step, "epoch": epoch, **reduce_metrics(m), "lr": self.scheduler.get_last_lr()[0],
               "step_s": round(step_s, 4), "target_s": round(m["target_s"], 4)}
        if self.pool is not None:
            rec["data_wait_s"] = round(fetch_s, 4)
        if self.info.is_main:
            with open(self.train_dir / "log.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
            log.info("step %d loss %.4f tau_p %.3f", step, rec["loss"], rec["tau_probabilistic"])
        warning = divergence.observe(step, rec["loss"])
        if warning and self.info.is_main:
            log.warning(warning)
        self.hooks.log(rec)
        return rec

    def _save(self, steps: StepLookahead) -> Path:
        return save_checkpoint(self.train_dir, self.step, self.model, self.optimizer, self.scheduler, steps,
                               training=self.training_meta, keep=self.cfg.keep_checkpoints)

    def _summary(self, totals, loop_s: float, t_start: float, cpu_start: float, history: list, ckpt: Path,
                 steps: StepLookahead, divergence) -> dict:
        """What `train` returns: totals over ranks (`totals`, already reduced), the last losses, the checkpoint, the
        feed, and with producers the features' waits and rates (collective)."""
        info = self.info
        summary = {
            "rank": info.rank, "world_size": info.world_size, "device": str(info.device), "steps": self.step,
            "total_steps": self.total_steps, "tokens": int(totals[0]),
            "tokens_per_s": float(totals[0]) / max(1e-9, loop_s), "loop_s": loop_s,
            "target_share": float(totals[1] / totals[2]) if totals[2] > 0 else 0.0,
            "elapsed_s": time.perf_counter() - t_start,
            "loss_first": history[0]["loss"] if history else None,
            "loss_last": history[-1]["loss"] if history else None,
            "tau_probabilistic_last": history[-1]["tau_probabilistic"] if history else None,
            "checkpoint": str(ckpt), "feed": steps.state_dict(), "feed_stats": self.feed.stats, "seed": self.seed,
            "draft_vocab": self.vocab_report, "dtype": self.training_meta["dtype"],
            "features_from": self.features.source, "divergence_warnings": divergence.warnings,
            "resume": self.training_meta["resume"], "target_memory_bytes_per_rank": self.target.memory_bytes,
            "history": history,
        }
        summary.update(self.hooks.close(summary))
        if self.pool is not None:
            summary["features"] = self._feature_report(totals, cpu_start)
        if isinstance(self.source, CachedFeatures):  # every rank has one (the same config): summed over ranks
            summary["feature_cache"] = self.source.stats(reduce=lambda t: control_all_reduce_sum(
                t, "the feature cache's counts"))
        return summary

    def _feature_report(self, totals, cpu_start: float) -> dict:
        """Per rank means; rows/s of the whole job (collective)."""
        world = self.info.world_size
        step_s, fetch_s, rows = float(totals[2]) / world, float(totals[3]) / world, float(totals[4])
        report = self.pool.report(step_s)
        busy = step_s - report["wait_s"]  # the loop without waiting for producers: features read, draft trained
        cpu = control_all_reduce_sum(torch.tensor([time.process_time() - cpu_start], dtype=torch.float64),
                                     "CPU seconds")
        steady = step_s - report["first_wait_s"]  # after the first feature object: the producers are up
        f = {**report, "fetch_s": fetch_s,
             "data_wait_fraction": report["wait_s"] / step_s if step_s > 0 else 0.0,
             "data_wait_fraction_after_first": (report["wait_s"] - report["first_wait_s"]) / steady
             if steady > 0 else 0.0,
             "trainer_rows_per_s": rows / busy if busy > 0 else None,
             "trainer_cpu_s_per_row": float(cpu) / rows if rows else None}
        if self.info.is_main:
            log.info("features: data wait %.1f%% of the loop (%.1f%% after the first object), %.2f MiB/s; rows/s "
                     "the trainer can take %s, the producers give %s", 100 * f["data_wait_fraction"],
                     100 * f["data_wait_fraction_after_first"], f["feature_bytes_per_s"] / 2**20,
                     _fmt(f["trainer_rows_per_s"]), _fmt(f.get("producer_rows_per_s")))
        return f


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"
