"""Acceptance length of the demo draft on the main job's shards: trained vs untrained vs `markov_rank=0`.

    .venv/bin/python bench/acc_len.py --run runs/local                  # after the README's first command
    .venv/bin/python bench/acc_len.py --run runs/local --seeds 0,1      # seed-to-seed spread
    .venv/bin/python bench/acc_len.py --run runs/local --set train.max_steps=500

For each seed, trains the profile's draft (`regen.train.loop.run_train`, the profile's bounded budget) and the same
draft with `markov_rank=0` (DFlash-like, spec §3) on the run's shards, into `<run>/bench-acc-len/seed-<s>/`,
then measures both with `regen.train.eval.run_eval` (spec §7: greedy verification against the target, bonus token
counted) on the same held-out prompts beside an untrained draft of the same config: the baseline, measured in
the same run. Prints each figure and the ratios trained/untrained and trained/markov_rank_0; writes
`<run>/bench-acc-len/seed-<s>/eval.json`. Existing checkpoints of a finished budget are reused (delete the
folder to retrain). The run's own `train/` and `eval.json` are not touched.
"""
from __future__ import annotations

import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
import _preamble  # noqa: E402, F401 - bench/ off sys.path, the repository root first, HF offline

import argparse
import json
import time
from pathlib import Path


def train_once(cfg, run, out: Path) -> dict:
    from regen.train.loop import run_train

    t0 = time.perf_counter()
    summary = run_train(cfg, run, train_dir=out)
    return {"steps": summary["steps"], "train_s": round(time.perf_counter() - t0, 1),
            "tau_probabilistic_last": summary.get("tau_probabilistic_last"), "draft_vocab": summary.get("draft_vocab")}


def main(argv=None) -> int:
    from regen.config import load_profile
    from regen.errors import InputError
    from regen.rundir import RunDir
    from regen.train.eval import run_eval

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a run directory with shards (the main job's, e.g. runs/local)")
    p.add_argument("--profile", default="local")
    p.add_argument("--seeds", default="0", help="comma-separated training seeds (default 0)")
    p.add_argument("--num-prompts", type=int, default=32, help="held-out prompts (default 32)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="generated tokens per prompt (default 64)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)

    run = RunDir.at(args.run)
    if not (run.shards / "manifest.json").exists():
        raise InputError(f"{run.shards}/manifest.json not found: run the main job first "
                         f"(regen run --profile {args.profile} --run {args.run})")
    overrides = dict(kv.split("=", 1) for kv in args.overrides)
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        base = load_profile(args.profile, {**overrides, "train.seed": str(seed)}).train
        if base.markov_rank == 0:
            raise InputError("the profile's draft already has markov_rank=0: nothing to ablate")
        out = run.root / "bench-acc-len" / f"seed-{seed}"
        main_train = train_once(base, run, out / "train")
        ablation = train_once(base.model_copy(update={"markov_rank": 0}), run, out / "train-markov0")
        ev = run_eval(base, run, draft_dir=out / "train", seed=seed, num_prompts=args.num_prompts,
                      max_new_tokens=args.max_new_tokens, compare={"markov_rank_0": out / "train-markov0"},
                      progress=False, out_path=out / "eval.json")
        row = {"seed": seed, "num_prompts": ev["num_prompts"], "max_new_tokens": args.max_new_tokens,
               "train": main_train, "train_markov0": ablation,
               **{k: {"acc_len": ev[k]["acc_len"], "num_rounds": ev[k]["num_rounds"],
                      "accept_rate@0": ev[k]["accept_rate"]["0"], "accept_rate@1": ev[k]["accept_rate"]["1"]}
                  for k in ("trained", "untrained", "markov_rank_0")}}
        row["ratio_trained_vs_untrained"] = ev["trained"]["acc_len"] / ev["untrained"]["acc_len"]
        row["ratio_trained_vs_markov_rank_0"] = ev["trained"]["acc_len"] / ev["markov_rank_0"]["acc_len"]
        results.append(row)
        print(json.dumps(row, indent=2), flush=True)
    print(f"{'seed':>4} {'trained':>8} {'untrained':>9} {'markov0':>8} {'x untrained':>11} {'x markov0':>9}")
    for r in results:
        print(f"{r['seed']:>4} {r['trained']['acc_len']:8.3f} {r['untrained']['acc_len']:9.3f} "
              f"{r['markov_rank_0']['acc_len']:8.3f} {r['ratio_trained_vs_untrained']:11.3f} "
              f"{r['ratio_trained_vs_markov_rank_0']:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
