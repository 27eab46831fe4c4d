"""`regen train`: the bundled online trainer. Target hidden states on the fly -> DSpark draft checkpoints.

    regen train --profile local --run runs/local [--follow] [--max-steps N] [--out DIR]
    torchrun --nnodes 2 --nproc_per_node 4 --rdzv_endpoint TRAIN0:29500 -m regen.train -- --profile kimi-k3 \
        --run runs/k3 --follow    # GB200: 4 GPUs per tray (docs/cluster.md)

(torchrun needs the `--`: otherwise it reads `--run` as an ambiguous abbreviation of its own `--run-path`.)

Reads top to bottom like nanoGPT's train.py: config, process group, target (frozen, local path,
`regen.train.target`), draft (`regen.train.model`), shard (`regen.train.parallel`, FSDP2), optimizer (AdamW, warmup + cosine,
grad clip), data (`regen.train.feed`: shards of `<run>/shards/manifest.json`, checksummed, per rank, resumable),
loop, checkpoint (`regen.train.checkpoint`). Spec: shared/docs/dspark.md §5 (objective), §6 (recipe), §8 (config).

Loss normalisation (spec §5): each micro-batch's loss from `regen.train.loss.dspark_loss` is
Σ w·term / Σ_ranks w · world_size; with `train.loss_normalization: step` (default) it is rescaled by
(Σ_ranks w of that micro-batch) / (Σ_ranks w of the whole step) so an optimizer step over A micro-batches on W
ranks equals one step over the same global batch at any (W, A); with `micro_batch` it is divided by A (the
reference's weighting, DS trainer). Anchors are drawn from a generator seeded by (seed, epoch, global micro-batch index): the same sample
gets the same anchors at any world size and after a resume.

Outputs in <run>/train/: checkpoints/step-*/ (servable draft + resumable state), latest.json, log.jsonl (one
line per logged step), summary.json (what `run_train` returns).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import time
from pathlib import Path

from regen.config import add_profile_arguments, load_profile_from_args
from regen.errors import InputError
from regen.train import warm_start
from regen.train.draft_config import build_draft_config
from regen.train.periodic_eval import TrainHooks
from regen.train.step import reduce_metrics, train_step, zero_loss  # noqa: F401 - the loop's step, importable here

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from regen.config import add_responses_argument

    add_profile_arguments(parser)
    add_responses_argument(parser, "the shards to train on (original: into <run>/train-original by default)")
    parser.add_argument("--follow", action="store_true",
                        help="train while `regen render` writes shards; end when its manifest is marked complete")
    parser.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides train.max_steps)")
    parser.add_argument("--init-from", default=None, help="start from this draft (train.init_from): a step folder, "
                        "a training directory, or an exported K3DSparkModel / Qwen3DSparkModel folder")
    parser.add_argument("--out", default=None,
                        help="training directory (default <run>/train), e.g. runs/local/train-markov0 for an "
                             "ablation trained on the same shards beside the main draft")


def main(args) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    profile, run = load_profile_from_args(args)
    cfg = profile.train
    updates = {"seed": cfg.seed if cfg.seed is not None else profile.seed}
    if args.max_steps is not None:
        updates["max_steps"] = args.max_steps
    if args.init_from is not None:
        updates["init_from"] = args.init_from
    cfg = cfg.model_copy(update=updates)
    from regen.train.features.netns import run_train_isolated, should_isolate

    if should_isolate(cfg):  # a local producer pool: only loopback (regen.train.features.netns)
        status = run_train_isolated(cfg, run, follow=args.follow, train_dir=args.out)
        if status is not None:
            return status
    summary = run_train(cfg, run, follow=args.follow, train_dir=args.out)
    if summary.get("rank", 0) == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=2))
    return 0


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


def _dtype(name: str, device):
    """`auto`: bf16 on CUDA and on a CPU with native bf16 (native_bf16), else fp32; or the named dtype."""
    import torch

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


def feed_config(cfg):
    from regen.train.feed import FeedConfig

    return FeedConfig(seed=cfg.seed or 0, max_len=cfg.max_len, truncate=cfg.truncate, max_tokens=cfg.max_tokens, max_batch=cfg.max_batch,
                      shuffle_buffer=cfg.shuffle_buffer, bucket_window=cfg.bucket_window,
                      min_loss_tokens=cfg.min_loss_tokens, heldout_fraction=cfg.heldout_fraction,
                      on_bad_shard=cfg.on_bad_shard, poll_s=cfg.follow_poll_s, follow_timeout_s=cfg.follow_timeout_s)


def make_objective(draft):
    """Wrap `draft` in a module whose forward is the DSpark loss, so FSDP2's root (this wrapper) unshards every
    parameter the loss touches (lm_head, Markov and confidence heads are used outside `draft.forward`)."""
    from torch import nn

    from regen.train.loss import dspark_loss

    class Objective(nn.Module):
        def __init__(self, draft):
            super().__init__()
            self.draft = draft

        @property
        def config(self):
            return self.draft.config

        def forward(self, batch, features, anchors, keep, weights=(0.1, 0.9, 1.0), denominator=None):
            return dspark_loss(self.draft, batch, features, anchors, keep, weights=weights,
                               denominator=denominator, metrics_on_device=denominator is not None,
                               layout=batch.get("slot_layout"))

    return Objective(draft)


def share_frozen_with_target(draft, target_model, dtype) -> None:
    """Point the draft's frozen embed_tokens/lm_head at the target's tensors when they match in shape, dtype and
    device (one copy in memory instead of two: 2 x 262K x 640 floats for Gemma); else cast them to `dtype`."""
    import torch

    for mine, theirs in ((draft.embed_tokens, target_model.get_input_embeddings()),
                         (draft.lm_head, target_model.get_output_embeddings())):
        w = theirs.weight
        if w.shape == mine.weight.shape and w.dtype == dtype and w.device == mine.weight.device:
            mine.weight = w if not w.requires_grad else torch.nn.Parameter(w.detach(), requires_grad=False)
        elif mine.weight.dtype != dtype:  # (already in dtype: nothing to convert, nor to swap on fake tensors)
            mine.to(dtype)


def prepare_microbatch(mb, seed: int, draft_cfg, device, t2d=None):
    """(batch dict on `device`, anchors int64[B, N], keep bool[B, N]) for a feed MicroBatch.

    Anchors come from a generator seeded by (seed, epoch, global micro-batch index): identical for the same
    sample at any world size and after a resume (spec §5 sampling: uniform without replacement, sorted).
    t2d: bool[V] of a reduced draft vocabulary (`DSparkDraft.t2d`): tokens outside it leave the loss mask after
    the anchors are drawn, so no supervised slot has one as its target (EAGLE-3's position mask; the
    evaluation mask's cumulative product ends a block there).
    """
    import torch

    from regen.train.loss import sample_anchors, slot_layout
    from regen.train.feed import stable_hash

    top = int(mb.input_ids.max())
    if top >= draft_cfg.vocab_size:
        raise InputError(f"sample {mb.sample_ids} has token id {top} >= the target's vocab_size "
                         f"{draft_cfg.vocab_size}: the shards were rendered with another tokenizer than the target's")
    gen = torch.Generator().manual_seed(stable_hash(seed, mb.epoch, mb.index, "anchors") & ((1 << 62) - 1))
    anchors, keep = sample_anchors(mb.loss_mask, draft_cfg.num_anchors, gen)  # an anchor token is only an input
    loss_mask = mb.loss_mask if t2d is None else mb.loss_mask & t2d.cpu()[mb.input_ids]
    # the supervised slots' index plan, from the host copies: the loss reads nothing back from the device
    layout = slot_layout(anchors, keep, loss_mask, draft_cfg.block_size, draft_cfg.loss_decay_gamma,
                         input_ids=mb.input_ids, t2d=None if t2d is None else t2d.cpu())
    batch = {"input_ids": mb.input_ids.to(device), "loss_mask": loss_mask.to(device),
             "attention_mask": mb.attention_mask.to(device), "key": (mb.epoch, mb.index),
             "num_tokens": int(mb.attention_mask.sum()),  # counted on the host copy: no device read
             "slot_layout": layout.to(device)}
    return batch, anchors.to(device), keep.to(device)


def run_train(cfg, run, *, follow: bool = False, stop_after_steps: int | None = None,
              train_dir: str | Path | None = None) -> dict:
    """Train a DSpark draft on `run.shards` with online target features; write checkpoints to `train_dir`
    (default `run.train`).

    Resumes from `<train_dir>/latest.json` when present. Returns (and on rank 0 writes to summary.json):
    steps, tokens, tokens_per_s, target_share (fraction of step time in the target forward), first/last
    losses, checkpoint path, feed stats, history (logged metrics). Raises InputError for a missing target
    or shards, a contract mismatch, or `--follow` without train.max_steps. `stop_after_steps` ends this
    invocation early without shortening the schedule (a preemption; the next call resumes).
    """
    import torch.distributed as dist

    from regen.config import resolve_path
    from regen.train.guard import take_train_lease
    from regen.train.parallel import destroy_distributed, init_distributed

    # -- config ---------------------------------------------------------------------------------------------
    seed = cfg.seed if cfg.seed is not None else 0
    cfg = cfg.model_copy(update={"seed": seed})
    if not cfg.target:
        raise InputError("train.target is not set: give the local path of the target model "
                         "(e.g. --set train.target=data/models/gemma3-270m)")
    target_path = resolve_path(cfg.target)
    if not (Path(target_path) / "config.json").exists():
        raise InputError(f"train.target={cfg.target!r}: no config.json in {target_path}; give a local "
                         "transformers model directory (the embedded one appears after `bash scripts/setup.sh`)")

    # -- process group --------------------------------------------------------------------------------------
    owns_group = not dist.is_initialized()
    from regen.train.collectives import collective_timeouts

    control_s, hot_s = collective_timeouts(cfg)  # the control plane outwaits the producers, NCCL outwaits it
    info = init_distributed(cfg.device, timeout_s=hot_s, control_timeout_s=control_s)
    train_dir = Path(train_dir) if train_dir else Path(run.train)
    lease = None
    try:
        lease = take_train_lease(train_dir, info)  # regen.train.guard: one trainer per training directory
        return _train(cfg, run, info, target_path, train_dir, follow=follow, stop_after_steps=stop_after_steps)
    finally:
        if lease is not None:
            lease.release()
        if owns_group:
            destroy_distributed()


def _train(cfg, run, info, target_path: Path, train_dir: Path, *, follow: bool,
           stop_after_steps: int | None) -> dict:
    """run_train's body, in the process group `info` (see run_train)."""
    import torch

    from regen.train.checkpoint import agreed_resume, load_checkpoint
    from regen.train.draft_vocab import draft_vocabulary
    from regen.train.feed import ShardFeed
    from regen.train.parallel import shard_model
    from regen.train.heldout import heldout_split
    from regen.train.resume import check_resume, resume_key
    from regen.train.target import TargetContract, TargetFeatures, declared_contract
    from transformers import AutoConfig

    seed = cfg.seed
    torch.manual_seed(seed)  # identical draft init on every rank

    # -- target (frozen) ------------------------------------------------------------------------------------
    draft_cfg = build_draft_config(cfg, AutoConfig.from_pretrained(str(target_path), local_files_only=True))
    contract = TargetContract.from_draft_config(draft_cfg)
    target_dtype = _dtype(cfg.target_dtype, info.device)
    if cfg.features == "producers":  # only embeddings, final norm and LM head: features come from producers
        from regen.train.target_head import TargetHead

        target = TargetHead.from_pretrained(target_path, dtype=target_dtype, device=info.device,
                                            keys=cfg.target_head_keys or None)
        contract = contract.for_model(target.config)
    else:
        target = TargetFeatures.from_pretrained(target_path, contract, dtype=target_dtype, device=info.device)
    if info.is_main:
        log.info("target in each rank (train.features=%s): %.1f MiB", cfg.features, target.memory_bytes / 2**20)
    manifest_path = Path(run.shards) / "manifest.json"
    shards_manifest = None
    if manifest_path.exists():
        shards_manifest = json.loads(manifest_path.read_text())
        contract.check(declared_contract(shards_manifest), str(manifest_path))
        if (shards_manifest.get("contract") or {}).get("test_vocabulary"):
            raise InputError(f"{manifest_path}: the shards were rendered with the project's test vocabulary, not "
                             "the target's tokenizer; set render.tokenizer to the target's and re-render")

    # -- data -----------------------------------------------------------------------------------------------
    held = heldout_split(run, cfg.heldout_fraction, cfg.heldout_per_cell)  # same on every rank: from the selection
    fc = dataclasses.replace(feed_config(cfg), heldout_picks=held.picks_sha256 if held.picks else "")
    feed = ShardFeed(run.shards, fc, rank=info.rank, world_size=info.world_size,
                     grad_accum=cfg.grad_accum, follow=follow,
                     heldout=held if held.fraction > 0 or held.picks else None)
    resume_from, fallback = agreed_resume(train_dir, info)
    init = warm_start.prepare(cfg, draft_cfg, resume_from, info.is_main)  # train.init_from (regen.train.warm_start)
    vocab_ids, vocab_report = (warm_start.vocabulary(init) if init is not None and init.d2t is not None
                               else draft_vocabulary(draft_cfg, feed, resume_from, follow=follow))

    # -- draft, sharded -------------------------------------------------------------------------------------
    from regen.train.build import build_draft  # on the meta device, materialised on info.device

    draft = build_draft(target.model, draft_cfg, info.device, draft_vocab=vocab_ids,
                        frozen_dtype=_dtype(cfg.dtype, info.device))
    from regen.train.attention import training_impl

    draft.attention_impl = training_impl(cfg.attention, info.device)
    warm = warm_start.load_into(draft, init) if init is not None else None
    compute_dtype = _dtype(cfg.dtype, info.device)
    share_frozen_with_target(draft, target.model, compute_dtype)
    t2d = draft.t2d.cpu() if draft_cfg.draft_vocab_size else None
    model = shard_model(make_objective(draft), info, blocks=draft.layers,
                        param_dtype=None if compute_dtype == torch.float32 else compute_dtype)
    if cfg.max_steps > 0:
        total_steps = cfg.max_steps
    elif follow:
        raise InputError("--follow needs train.max_steps (the schedule's length): e.g. --max-steps 2000")
    elif cfg.epochs <= 0:
        raise InputError("train.epochs=0 (repeat the data) needs train.max_steps > 0")
    else:
        total_steps = feed.count_steps(cfg.epochs)
        if total_steps == 0:
            raise InputError(f"{manifest_path}: no full optimizer step of training data (after held-out and "
                             "length filters); render more shards or lower train.grad_accum")

    # -- optimizer ------------------------------------------------------------------------------------------
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                            betas=tuple(cfg.betas), eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total_steps, cfg.warmup_frac, cfg.min_lr_frac))
    step, changes = 0, []
    key = resume_key(cfg, shards_manifest=shards_manifest, target_path=Path(target_path),
                     world_size=info.world_size, total_steps=total_steps)
    if resume_from is not None:
        from regen.train.draft_config import check_rope_theta
        from regen.train.model import CONFIG_NAME, DSparkConfig

        check_rope_theta(DSparkConfig.from_json(Path(resume_from) / CONFIG_NAME), draft_cfg.rope_theta,
                         checkpoint=str(Path(resume_from) / CONFIG_NAME), expected_from="this run's draft config")
        changes = check_resume(resume_from, key, shards_manifest=shards_manifest, follow=follow,  # before
                               lr_lambda=lr_lambda)  # any load
        if info.is_main:
            for c in changes:
                log.warning("resume changes %s: %s -> %s %s", c["setting"], c["old"], c["new"], c["note"])
        step = load_checkpoint(resume_from, model, opt, sched, feed)
        if info.is_main:
            log.info("resumed from %s at step %d", resume_from, step)
    dtypes = {"draft": str(compute_dtype).removeprefix("torch."), "target": str(target.model.dtype).removeprefix(
        "torch."), "asked": [cfg.dtype, cfg.target_dtype], "cpu_native_bf16": native_bf16()}
    if info.is_main:
        log.info("dtype: draft %s, target %s (train.dtype %s, train.target_dtype %s; CPU native bf16: %s)",
                 dtypes["draft"], dtypes["target"], cfg.dtype, cfg.target_dtype, dtypes["cpu_native_bf16"])
    training_meta = {"profile_train": cfg.model_dump(), "target": str(target_path), "world_size": info.world_size,
                     "shards_manifest": str(manifest_path), "draft_vocab": vocab_report, "dtype": dtypes,
                     "init_from": warm, "resume_key": key,
                     "heldout": held.record(),
                     "resume": {"from": str(resume_from) if resume_from else None, "fallback": fallback,
                                "changes": changes}}
    if info.is_main:  # the held-out split `regen eval` must keep to (regen.train.heldout.eval_heldout_split)
        from schemas.io import write_json_atomic

        train_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic({**held.record(), "shards": key["shards"],
                           "num_shards": key["num_shards"]}, train_dir / "heldout.json")
    num_epochs = cfg.epochs if cfg.epochs > 0 else None  # ends at the first of max_steps and epochs
    pool, source = None, target
    if cfg.features == "producers":
        from regen.train.features.pool import FeaturePool

        pool = FeaturePool.for_training(
            cfg, info=info, run=run, follow=follow, feed_cfg=fc, heldout=feed.heldout, feed_state=feed.state_dict(),
            dtype=str(target_dtype).removeprefix("torch."), head=target, contract=contract, train_dir=train_dir,
            target_path=str(target_path), num_epochs=num_epochs,
            num_steps=min(total_steps - step, stop_after_steps) if stop_after_steps else total_steps - step)
        source = pool.features
    try:
        hooks = TrainHooks(cfg, run, train_dir, target, info, total_steps, step)  # tracking, estimates, best
        return _loop(cfg, info, train_dir, model, source, pool, opt, sched, feed, draft_cfg, t2d, step, total_steps,
                     num_epochs, resume_from, training_meta, vocab_report, stop_after_steps, target, hooks)
    finally:
        if pool is not None:
            pool.close()


def _loop(cfg, info, train_dir, model, source, pool, opt, sched, feed, draft_cfg, t2d, step, total_steps, num_epochs,
          resume_from, training_meta, vocab_report, stop_after_steps, target, hooks) -> dict:
    """The loop and the final checkpoint of `_train` (features from `source`: in process or `pool`'s)."""
    import torch

    from regen.train.checkpoint import save_checkpoint
    from regen.train.collectives import control_all_reduce_sum
    from regen.train.guard import DivergenceMonitor, raise_nonfinite
    from regen.train.parallel import raise_if_any_rank_failed

    seed = cfg.seed

    # -- loop -----------------------------------------------------------------------------------------------
    history, t_start, cpu_start = [], time.perf_counter(), time.process_time()
    totals = torch.zeros(5, dtype=torch.float64)  # tokens, target s, step s, feature fetch s, rows (this rank)
    ckpt, steps_here = resume_from, 0
    train_dir.mkdir(parents=True, exist_ok=True)
    if info.is_main and (train_dir / "stopped.json").exists():  # the last run's stop (regen.train.guard): said, gone
        log.info("the previous run stopped: %s", json.loads((train_dir / "stopped.json").read_text())["message"])
        (train_dir / "stopped.json").unlink()
    from regen.train.lookahead import StepLookahead

    # the feed's steps; with read-ahead the next one is pulled while this one trains, the position stays exact
    steps = StepLookahead(feed, num_epochs)
    read_ahead = pool is not None and pool.read_ahead > 0
    divergence = DivergenceMonitor()
    while step < total_steps and (stop_after_steps is None or steps_here < stop_after_steps):
        t0, error, mbs = time.perf_counter(), None, []
        try:  # a bad shard or row on one rank stops every rank now, not at the process-group timeout
            batch_step = steps.take()  # the position (steps.state_dict(), checkpointed) advances here
            if batch_step is not None:
                mbs = [prepare_microbatch(mb, seed, draft_cfg, info.device, t2d) for mb in batch_step.microbatches]
        except Exception as exc:  # noqa: BLE001 - agreed on by every rank, then raised on every rank
            error = exc
        raise_if_any_rank_failed(error)
        if batch_step is None:
            break
        t1 = time.perf_counter()
        zero = pool.fetch_step(batch_step.microbatches) if pool is not None else set()  # agreed the same way
        stall0 = pool.features.stats["stall_s"] if pool is not None else 0.0
        if read_ahead and step + 1 < total_steps and (stop_after_steps is None or steps_here + 1 < stop_after_steps):
            steps.pull_next(lambda s: pool.submit(s.microbatches, ahead=True))  # read while this one computes
        fetch_s = time.perf_counter() - t1
        for b, _, _ in mbs:
            if b["key"] in zero:  # its features failed on every attempt: trained with zero weight, ranks in step
                zero_loss(b)
        m = train_step(model, source, opt, mbs, loss_weights=tuple(cfg.loss_weights), grad_clip=cfg.grad_clip,
                       loss_normalization=cfg.loss_normalization)
        if read_ahead:  # the wait for features inside the step: the reader was behind
            fetch_s += pool.features.stats["stall_s"] - stall0
        if not m["finite"]:  # every rank agreed (train_step): stop before anything is saved
            if pool is not None:  # a feature failure or read error of the step: raised as itself on every rank
                pool.raise_if_failed()
            raise_nonfinite(step + 1, m, batch_step, ckpt, info, train_dir)  # regen.train.guard
        sched.step()
        step, steps_here = step + 1, steps_here + 1
        step_s = time.perf_counter() - t0
        rows = sum(len(mb.sample_ids) for mb in batch_step.microbatches)
        totals += torch.tensor([m["tokens"], m["target_s"], step_s, fetch_s, rows], dtype=torch.float64)
        if cfg.log_samples:
            with open(train_dir / f"samples-rank{info.rank}.jsonl", "a", encoding="utf-8") as f:
                ids = [sid for mb in batch_step.microbatches for sid in mb.sample_ids]
                f.write(json.dumps({"step": step, "sample_ids": ids}) + "\n")
        if step % cfg.log_every == 0 or step == total_steps or step == 1:
            rec = {"step": step, "epoch": batch_step.epoch, **reduce_metrics(m), "lr": sched.get_last_lr()[0],
                   "step_s": round(step_s, 4), "target_s": round(m["target_s"], 4)}
            if pool is not None:
                rec["data_wait_s"] = round(fetch_s, 4)
            history.append(rec)
            if info.is_main:
                with open(train_dir / "log.jsonl", "a", encoding="utf-8") as f:
                    f.write(json.dumps(rec) + "\n")
                log.info("step %d loss %.4f tau_p %.3f", step, rec["loss"], rec["tau_probabilistic"])
            warning = divergence.observe(step, rec["loss"])
            if warning and info.is_main:
                log.warning(warning)
            hooks.log(rec)
        hooks.after_step(step, model)
        if cfg.checkpoint_every > 0 and step % cfg.checkpoint_every == 0 and step < total_steps:
            ckpt = save_checkpoint(train_dir, step, model, opt, sched, steps, training=training_meta,
                                   keep=cfg.keep_checkpoints)

    # -- checkpoint -----------------------------------------------------------------------------------------
    hooks.after_step(step, model, final=True)  # the last step's estimate (and best) before the final checkpoint
    loop_s = time.perf_counter() - t_start
    if ckpt is None or not ckpt.name.endswith(f"{step:06d}"):
        ckpt = save_checkpoint(train_dir, step, model, opt, sched, steps, training=training_meta,
                               keep=cfg.keep_checkpoints)
    totals = control_all_reduce_sum(totals, "the run's totals")
    summary = {
        "rank": info.rank, "world_size": info.world_size, "device": str(info.device), "steps": step,
        "total_steps": total_steps, "tokens": int(totals[0]), "tokens_per_s": float(totals[0]) / max(1e-9, loop_s),
        "loop_s": loop_s,
        "target_share": float(totals[1] / totals[2]) if totals[2] > 0 else 0.0,
        "elapsed_s": time.perf_counter() - t_start,
        "loss_first": history[0]["loss"] if history else None, "loss_last": history[-1]["loss"] if history else None,
        "tau_probabilistic_last": history[-1]["tau_probabilistic"] if history else None,
        "checkpoint": str(ckpt), "feed": steps.state_dict(), "feed_stats": feed.stats, "seed": seed,
        "draft_vocab": vocab_report, "dtype": training_meta["dtype"], "features_from": cfg.features,
        "divergence_warnings": divergence.warnings, "resume": training_meta["resume"],
        "target_memory_bytes_per_rank": target.memory_bytes,
        "history": history,
    }
    summary.update(hooks.close(summary))
    if pool is not None:  # per rank means; rows/s of the whole job
        step_s, fetch_s, rows = float(totals[2]) / info.world_size, float(totals[3]) / info.world_size, float(totals[4])
        report = pool.report(step_s)
        busy = step_s - report["wait_s"]  # the loop without waiting for producers: features read, draft trained
        cpu = control_all_reduce_sum(torch.tensor([time.process_time() - cpu_start], dtype=torch.float64),
                                     "CPU seconds")
        steady = step_s - report["first_wait_s"]  # after the first feature object: the producers are up
        summary["features"] = {**report, "fetch_s": fetch_s,
                               "data_wait_fraction": report["wait_s"] / step_s if step_s > 0 else 0.0,
                               "data_wait_fraction_after_first": (report["wait_s"] - report["first_wait_s"]) / steady
                               if steady > 0 else 0.0,
                               "trainer_rows_per_s": rows / busy if busy > 0 else None,
                               "trainer_cpu_s_per_row": float(cpu) / rows if rows else None}
        if info.is_main:
            f = summary["features"]
            log.info("features: data wait %.1f%% of the loop (%.1f%% after the first object), %.2f MiB/s; rows/s "
                     "the trainer can take %s, the producers give %s", 100 * f["data_wait_fraction"],
                     100 * f["data_wait_fraction_after_first"], f["feature_bytes_per_s"] / 2**20,
                     _fmt(f["trainer_rows_per_s"]), _fmt(f.get("producer_rows_per_s")))
    if info.is_main:
        from schemas.io import write_json_atomic

        write_json_atomic(summary, train_dir / "summary.json")
    target.close()
    return summary


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def script_parser() -> argparse.ArgumentParser:
    """The command line of `python -m regen.train` / `torchrun ... -m regen.train -- ...` (`regen train`'s)."""
    p = argparse.ArgumentParser(prog="regen train")
    add_arguments(p)
    return p


def script_main(argv: list[str] | None = None) -> int:
    """`python -m regen.train` / `torchrun -m regen.train -- ...` (see `regen.train.__main__`)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    p = script_parser()
    from regen.errors import exit_code

    return exit_code(lambda: main(p.parse_args(argv)), "regen train")
