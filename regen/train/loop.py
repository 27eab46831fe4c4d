"""`regen train`: the bundled online trainer. Target hidden states on the fly -> DSpark draft checkpoints.

    regen train --profile local --run runs/local [--follow] [--max-steps N] [--out DIR]
    torchrun --nnodes 2 --nproc_per_node 4 --rdzv_endpoint TRAIN0:29500 -m regen.train -- --profile kimi-k3 \
        --run runs/k3 --follow    # GB200: 4 GPUs per tray (docs/cluster.md)

(torchrun needs the `--`: otherwise it reads `--run` as an ambiguous abbreviation of its own `--run-path`.)

This module is the command line and `run_train`: the profile, the process group (`regen.train.parallel`), the
training directory's lease (`regen.train.guard`), then `regen.train.trainer.Trainer`, which builds the target,
feed, draft, optimizer and features and trains (its docstring has the objective's normalisation and the outputs).
It stays light to import: the CLI reads its arguments without loading torch.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from regen.config import add_profile_arguments, load_profile_from_args
from regen.errors import InputError

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
    updates = {}
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
    from regen.train.trainer import Trainer

    # -- config ---------------------------------------------------------------------------------------------
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
    lease = trainer = None
    try:
        lease = take_train_lease(train_dir, info)  # regen.train.guard: one trainer per training directory
        trainer = Trainer(cfg, run, info, target_path, train_dir, follow=follow)
        return trainer.build().train(stop_after_steps)
    finally:
        if trainer is not None:
            trainer.close()
        if lease is not None:
            lease.release()
        if owns_group:
            destroy_distributed()


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
