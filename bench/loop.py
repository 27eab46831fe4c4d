"""Benchmark: one round of the data loop aimed at the weakest cells against the same extra units spread by the fixed
mix, on held-out prompts of every cell, for each seed.

    .venv/bin/python bench/loop.py --run runs/local --budget-units 120 [--seeds 0,1] [--train-steps 750]
                                   [--profile local] [--out bench/out/loop]

For each seed and arm (`weakest`, `mix`) the finished main-job run `--run` is copied to `<out>/<arm>-s<seed>/` and
one loop round is run there (`regen.pipeline.loop_round`: the next selection, its generation, render, training
from the run's evaluated draft for `--train-steps` steps at `train.seed` = seed, its evaluation on the run's
held-out prompts). Both arms start from the same draft, add at most the same units, train the same steps and are
measured on the same prompts: the held-out split of `train.heldout_per_cell` gives every cell of the selection
held-out prompts (`regen.train.heldout`), and each line says how many cells were measured. Prints per arm and seed:
units added, acc_len (per round and per request) before and after, per category; then the ratio weakest / mix of
the after-round acc_len with its mean over seeds, a table per cell (before, after each arm, units each arm put
there), and writes `<out>/loop.json`. Generation goes through the profile's target (the embedded llama.cpp engine for
`local`): a round costs its units' generation plus a training run; the other work on the machine is printed.
"""
from __future__ import annotations

import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
from _preamble import ROOT  # noqa: E402 - bench/ off sys.path, the repository root first, HF offline

import argparse
import json
import shutil
import time
from pathlib import Path


def arm(profile_name: str, overrides: list[str], base: Path, out: Path, *, policy: str, seed: int, budget: int,
        train_steps: int | None) -> dict:
    from regen.config import load_profile
    from regen.pipeline import loop_round
    from regen.rundir import RunDir
    from schemas.io import read_json

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(base, out, ignore=shutil.ignore_patterns("report.html"))
    profile = load_profile(profile_name, [*overrides, f"train.seed={seed}"])
    t0 = time.time()
    rec = loop_round(profile, RunDir.at(out), budget_units=budget, policy=policy, train_steps=train_steps,
                     progress=False, log=lambda *_: None)
    before = read_json(out / "eval.json")["trained"]
    ev = read_json(out / f"eval-loop-{rec['round']:02d}.json")
    after, held = ev["trained"], ev.get("heldout") or {}
    aimed = read_json(out / "loop" / f"round-{rec['round']:02d}.json")["cells"]
    return {"policy": policy, "seed": seed, "units_added": rec["units_added"], "prompts_added": rec["prompts_added"],
            "acc_len_before": before["acc_len"], "acc_len_after": after["acc_len"],
            "acc_len_per_request_after": after.get("acc_len_per_request"),
            "per_category_after": {c: v["acc_len"] for c, v in after["per_category"].items()},
            "num_prompts": ev.get("num_prompts"), "cells_selected": held.get("cells_selected"),
            "cells_measured": held.get("cells_measured"), "cells_not_measured": held.get("cells_not_measured"),
            "per_cell_before": {cell_key(c): (c["acc_len_per_round"], c["num_requests"])
                                for c in before.get("breakdown", {}).get("cells", [])},
            "per_cell_after": {cell_key(c): (c["acc_len_per_round"], c["num_requests"])
                               for c in after.get("breakdown", {}).get("cells", [])},
            "units_per_cell": {cell_key(c): c.get("units_added", 0) for c in aimed if c.get("units_added")},
            "wall_s": round(time.time() - t0, 1), "dir": str(out)}


def cell_key(c: dict) -> str:
    return " / ".join(str(c.get(k) or "-") for k in ("category", "length_band", "mode"))


def cell_table(results: list[dict]) -> list[str]:
    """Per cell: acc_len before, after each arm (mean over seeds), units each arm added there (summed over seeds)."""
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    def num(x):
        return "-" if x is None else f"{x:.3f}"

    keys = sorted({k for r in results for k in (*r["per_cell_after"], *r["per_cell_before"])})
    lines = ["| cell | held-out requests | before | weakest after | mix after | units weakest | units mix |",
             "|---|---|---|---|---|---|---|"]
    for k in keys:
        arms = {p: [r for r in results if r["policy"] == p] for p in ("weakest", "mix")}
        n = max((r["per_cell_after"].get(k, (None, 0))[1] for r in results), default=0)
        before = mean([r["per_cell_before"].get(k, (None, 0))[0] for r in results])
        after = {p: mean([r["per_cell_after"].get(k, (None, 0))[0] for r in rs]) for p, rs in arms.items()}
        units = {p: sum(r["units_per_cell"].get(k, 0) for r in rs) for p, rs in arms.items()}
        lines.append(f"| {k} | {n} | {num(before)} | {num(after['weakest'])} | {num(after['mix'])} | "
                     f"{units['weakest']} | {units['mix']} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a finished main-job run directory with eval.json")
    p.add_argument("--profile", default="local")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--budget-units", type=int, required=True)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--train-steps", type=int, default=None)
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "loop"))
    args = p.parse_args(argv)
    base, out = Path(args.run), Path(args.out)
    if not (base / "eval.json").exists():
        print(f"{base}/eval.json: missing; run the main job with train.eval_prompts > 0 first", file=sys.stderr)
        return 2
    if (json.loads((base / "prompts" / "manifest.json").read_text()).get("loop")):
        print(f"{base}: has loop rounds already; give the main job's run before any round (both arms must start "
              "from the same selection and draft)", file=sys.stderr)
        return 2
    print(f"cpu: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} (other work on the machine counts)")
    results = []
    for seed in [int(s) for s in args.seeds.split(",") if s.strip()]:
        for policy in ("weakest", "mix"):
            r = arm(args.profile, args.overrides, base, out / f"{policy}-s{seed}", policy=policy, seed=seed,
                    budget=args.budget_units, train_steps=args.train_steps)
            results.append(r)
            print(f"seed {seed} {policy:8s}: +{r['units_added']} units ({r['prompts_added']} prompts), acc_len "
                  f"{r['acc_len_before']:.3f} -> {r['acc_len_after']:.3f} (per request "
                  f"{r['acc_len_per_request_after']:.3f}) on {r['num_prompts']} held-out prompts, cells measured "
                  f"{r['cells_measured']} of {r['cells_selected']} selected, {r['wall_s']:.0f} s; per category "
                  + ", ".join(f"{c} {v:.3f}" for c, v in sorted(r["per_category_after"].items())), flush=True)
    ratios = []
    for seed in sorted({r["seed"] for r in results}):
        w = next(r for r in results if r["seed"] == seed and r["policy"] == "weakest")
        m = next(r for r in results if r["seed"] == seed and r["policy"] == "mix")
        ratios.append(w["acc_len_after"] / m["acc_len_after"])
        print(f"seed {seed}: weakest / mix = {ratios[-1]:.4f}")
    mean = sum(ratios) / len(ratios)
    print(f"weakest / mix, mean over {len(ratios)} seed(s): {mean:.4f}")
    print("\n".join(["acc_len per round by cell (means over seeds; units summed over seeds):", *cell_table(results)]))
    out.mkdir(parents=True, exist_ok=True)
    (out / "loop.json").write_text(json.dumps({"results": results, "ratios": ratios, "mean_ratio": mean}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
