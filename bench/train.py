"""Draft training throughput: tokens per second of `regen train` and the share of step time in the target.

    .venv/bin/python bench/train.py                 # the local profile's demo configuration (embedded target)
    .venv/bin/python bench/train.py --quick         # a tiny random target built here (seconds)
    .venv/bin/python bench/train.py --run runs/local --steps 20   # on a run's real shards

Runs `regen.train.loop.run_train` unchanged (device auto: CUDA when present, else CPU; one process) on shards of
the configured length (synthetic random tokens unless --run is given), then measures the baseline in the same
process: the target's forward pass alone (`TargetFeatures.features`) over the same number of tokens. Prints
training tokens/s, target-forward tokens/s, their ratio, and the share of training step time spent in the
target's forward pass.
"""
from __future__ import annotations

import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
import _preamble  # noqa: E402, F401 - bench/ off sys.path, the repository root first, HF offline

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path


def synthetic_shards(run_root: Path, *, num_rows: int, length: int, vocab: int, seed: int = 0,
                     distinct: int = 3000) -> None:
    """Random-token rows of `length` tokens, the second half supervised, in one complete shard. Tokens come from
    `distinct` ids (the main job's shards hold 2,929 distinct supervised tokens), so a reduced draft vocabulary
    covers them as it covers real data."""
    from schemas.io import write_json_atomic, write_rows_atomic
    from schemas.shard import SHARD_SCHEMA

    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        ids = [rng.randrange(5, min(vocab, 5 + distinct)) for _ in range(length)]
        rows.append({"sample_id": f"bench-{i}", "prompt_id": f"bench-p{i}", "turn": 0, "category": "bench",
                     "language": "en", "input_ids": ids, "loss_spans": [{"start": length // 2, "end": length}],
                     "num_tokens": length, "num_loss_tokens": length - length // 2})
    info = write_rows_atomic(rows, run_root / "shards" / "shard-00000.parquet", SHARD_SCHEMA)
    write_json_atomic({"schema": "regen.render.shards", "shards": [info], "complete": True, "status": "complete"},
                      run_root / "shards" / "manifest.json")


def tiny_target(path: Path) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


def quick_overrides(work: Path) -> list[str]:
    """`--set` values of a `--quick` run: the tiny random target built under `work`, sized to train in seconds."""
    return [f"train.target={tiny_target(work / 'target')}", "train.target_layer_ids=[0,1,2]",
            "train.mask_token_id=null", "train.max_len=128", "train.max_tokens=512", "train.max_batch=4",
            "train.draft_vocab_size=256"]


def target_forward_baseline(cfg, run, steps: int) -> float:
    """Tokens/s of the target's forward pass alone over the feed's first `steps` steps (same batches)."""
    import torch
    from transformers import AutoConfig

    from regen.config import resolve_path
    from regen.train.draft_config import build_draft_config
    from regen.train.feed import FeedConfig, ShardFeed
    from regen.train.parallel import resolve_device
    from regen.train.target import TargetContract, TargetFeatures
    from regen.train.trainer import resolve_dtype

    device = resolve_device(cfg.device)
    path = resolve_path(cfg.target)
    dcfg = build_draft_config(cfg, AutoConfig.from_pretrained(str(path), local_files_only=True))
    target = TargetFeatures.from_pretrained(path, TargetContract.from_draft_config(dcfg),
                                            dtype=resolve_dtype(cfg.target_dtype, device), device=device)
    feed = ShardFeed(run.shards, FeedConfig.from_train(cfg), grad_accum=cfg.grad_accum)
    batches = [mb for _, step in zip(range(steps), feed.steps(num_epochs=None)) for mb in step.microbatches]
    target.features(batches[0].input_ids.to(device), batches[0].attention_mask.to(device))  # warm-up
    tokens, t0 = 0, time.perf_counter()
    for mb in batches:
        target.features(mb.input_ids.to(device), mb.attention_mask.to(device))
        tokens += int(mb.attention_mask.sum())
    if device.type == "cuda":
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny random target and few steps")
    p.add_argument("--profile", default="local")
    p.add_argument("--run", default=None, help="train on this run's shards (a copy; the run is not modified)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps to time (default 12, quick 6)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)

    from regen.config import load_profile
    from regen.rundir import RunDir
    from regen.train.loop import run_train

    steps = args.steps or (6 if args.quick else 12)
    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    try:
        overrides = [f"train.max_steps={steps + 1}", "train.epochs=0", "train.checkpoint_every=0",
                     "train.log_every=1", "train.heldout_fraction=0", "train.eval_every=0"] + args.overrides
        if args.quick:
            overrides += quick_overrides(work)
        cfg = load_profile(args.profile, overrides).train
        run = RunDir.at(work / "run")
        if args.run:
            shutil.copytree(Path(args.run) / "shards", run.shards)
        else:
            from transformers import AutoConfig

            from regen.config import resolve_path

            vocab = AutoConfig.from_pretrained(str(resolve_path(cfg.target)), local_files_only=True).vocab_size
            synthetic_shards(run.root, num_rows=max(16, 2 * cfg.max_batch * (steps + 1)), length=cfg.max_len,
                             vocab=vocab)
        summary = run_train(cfg, run)
        hist = summary["history"][1:]  # step 1 is warm-up
        loop_s = summary["loop_s"] - summary["history"][0]["step_s"]
        tokens = sum(h["tokens"] for h in hist)
        train_tps = tokens / max(1e-9, loop_s)
        base_tps = target_forward_baseline(cfg, run, steps)
        out = {
            "device": summary["device"], "target": cfg.target if not args.quick else "tiny random (quick)",
            "steps_timed": len(hist), "tokens": tokens, "max_len": cfg.max_len, "max_batch": cfg.max_batch,
            "num_anchors": cfg.num_anchors, "num_draft_layers": cfg.num_draft_layers,
            "draft_vocab_size": cfg.draft_vocab_size, "dtype": cfg.dtype, "target_dtype": cfg.target_dtype,
            "train_tokens_per_s": round(train_tps, 1), "target_forward_tokens_per_s": round(base_tps, 1),
            "ratio_train_to_target_forward": round(train_tps / base_tps, 4),
            "target_share_of_step_time": round(sum(h["target_s"] for h in hist) / max(1e-9, sum(h["step_s"] for h in hist)), 4),
            "loss_first": summary["loss_first"], "loss_last": summary["loss_last"],
        }
        print(json.dumps(out, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
