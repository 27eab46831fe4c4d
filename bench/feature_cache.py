"""The in-process target's feature cache (`train.feature_cache_gib`): training seconds per step over many epochs of
few rows, with the cache against without it (the baseline), measured in the same process.

    .venv/bin/python bench/feature_cache.py                  # the local profile (embedded SmolLM2), 16 rows, 8 epochs
    .venv/bin/python bench/feature_cache.py --quick          # a tiny random target built here (seconds)
    .venv/bin/python bench/feature_cache.py --rows 8 --epochs 50 --set train.dtype=float32

Runs `regen.train.loop.run_train` unchanged on `--rows` synthetic rows of train.max_len tokens for `--epochs` passes,
once with train.feature_cache_gib=0 and once with 1 GiB. Prints each run's seconds per step after its first epoch
(the cache's first epoch computes every row, as the baseline does), its target share, the cache's hits and misses,
the ratio baseline / cached, and the two runs' last losses (close, not equal: a cached row is its own unbatched
forward, the baseline's rows are batched).
"""
from __future__ import annotations

import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
from _preamble import sibling  # noqa: E402 - bench/ off sys.path, the repository root first, HF offline

import argparse
import json
import shutil
import tempfile
from pathlib import Path

_train = sibling("train")  # bench/train.py: synthetic_shards, quick_overrides


def timed_run(cfg, work: Path, name: str, rows: int, steps_per_epoch: int) -> dict:
    from transformers import AutoConfig

    from regen.config import resolve_path
    from regen.rundir import RunDir
    from regen.train.loop import run_train

    run = RunDir.at(work / name)
    vocab = AutoConfig.from_pretrained(str(resolve_path(cfg.target)), local_files_only=True).vocab_size
    _train.synthetic_shards(run.root, num_rows=rows, length=cfg.max_len, vocab=vocab)
    s = run_train(cfg, run)
    later = s["history"][steps_per_epoch:]  # log_every 1: the steps after the first epoch
    step_s = sum(h["step_s"] for h in later) / len(later)
    return {"steps": s["steps"], "s_per_step_after_first_epoch": round(step_s, 4),
            "target_share_after_first_epoch": round(sum(h["target_s"] for h in later) /
                                                    sum(h["step_s"] for h in later), 4),
            "loss_last": s["loss_last"], "feature_cache": s.get("feature_cache")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny random target")
    p.add_argument("--profile", default="local")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)

    from regen.config import load_profile

    work = Path(tempfile.mkdtemp(prefix="bench-feature-cache-"))
    try:
        base = ["train.epochs=0", "train.checkpoint_every=0", "train.log_every=1", "train.heldout_fraction=0",
                "train.eval_every=0", "train.shuffle_buffer=1"]
        if args.quick:
            base += _train.quick_overrides(work)
        cfg0 = load_profile(args.profile, base + args.overrides).train
        steps_per_epoch = -(-args.rows // cfg0.max_batch)
        steps = ["train.max_steps=%d" % (steps_per_epoch * args.epochs)]
        runs = {}
        for name, gib in (("baseline", 0.0), ("cached", 1.0)):
            cfg = load_profile(args.profile, base + steps + args.overrides + [f"train.feature_cache_gib={gib}"]).train
            runs[name] = timed_run(cfg, work, name, args.rows, steps_per_epoch)
        out = {"target": "tiny random (quick)" if args.quick else cfg0.target, "rows": args.rows,
               "epochs": args.epochs, "max_len": cfg0.max_len, "max_batch": cfg0.max_batch, "dtype": cfg0.dtype,
               **runs, "ratio_baseline_to_cached_s_per_step": round(
                   runs["baseline"]["s_per_step_after_first_epoch"] / runs["cached"]["s_per_step_after_first_epoch"],
                   3)}
        print(json.dumps(out, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
