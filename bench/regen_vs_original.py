"""Regenerated vs original answers: does training on the target's own answers give a longer acceptance?

    .venv/bin/python bench/regen_vs_original.py --run runs/local                 # after the README's first command
    .venv/bin/python bench/regen_vs_original.py --run runs/local --seeds 0,1     # the benchmark's two seeds
    .venv/bin/python bench/regen_vs_original.py --run runs/local --quick         # a few steps, a few prompts
    .venv/bin/python bench/regen_vs_original.py --run runs/local --seeds 0,1 --temperature 1.0  # + the paper's T=1

1. The two shard sets of the run: `shards/` (the regenerated answers, `regen render`) and `shards-original/`
   (the sources' own answers, rendered here with the profile's render config when missing:
   `regen render --responses original`).
2. The same prompts: both sets are cut to the prompt ids present in both (prompts with an original answer and
   a regenerated one, every turn kept that each set rendered), into `<run>/regen-vs-original/<arm>/shards/`.
3. For each seed, the profile's draft is trained once per arm (`regen.train.loop.run_train`): same config, same
   optimizer steps (`train.max_steps`), same seed, into `<run>/regen-vs-original/seed-<s>/train-<arm>/`.
   Each arm's reduced draft vocabulary comes from its own training data, as `regen train` does.
4. Both are measured with the eval stage (`regen.train.eval.run_eval`, spec §7: greedy verification against the
   target, bonus token counted) on the same held-out prompts of the run (`<run>/shards`, the prompts
   `regen eval` measures; neither arm trained on them: the split is by prompt id, its per-cell picks from the
   run's selection, copied beside each arm's shards), beside the untrained
   draft of the same config and seed. With `--temperature T` the same drafts are also measured under
   speculative rejection sampling at T (the paper's tables use T = 1; `regen eval --temperature`), reported
   under `"sampled"` beside the greedy figures, never in their place.

Prints acc_len per arm and per category with the ratios regenerated/original, and writes
`<run>/regen_vs_original.json`: {"seeds", "untrained": {"acc_len"}, "original": {"acc_len"}, "regenerated":
{"acc_len"}, "per_seed": [...], "per_category": {...}} (+ "sampled": the same at T); arm figures are means over the
seeds. Existing checkpoints of a finished budget are reused (delete the folder to retrain). The run's own `train/` and
`eval.json` are not touched.
"""
from __future__ import annotations

import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
import _preamble  # noqa: E402, F401 - bench/ off sys.path, the repository root first, HF offline

import argparse
import json
import shutil
import time
from pathlib import Path

ARMS = ("regenerated", "original")
QUICK = {"steps": 4, "num_prompts": 2, "max_new_tokens": 8}
MANIFEST_KEYS = ("schema", "schema_version", "contract", "contract_hash", "config_hash")


def shard_rows(run) -> list[dict]:
    """Every row of the shard set `run.shards` (as listed by its manifest)."""
    import pyarrow.parquet as pq

    manifest = run.manifest(run.shards) or {}
    return [r for e in manifest.get("shards", []) for r in pq.read_table(run.shards / e["path"]).to_pylist()]


def original_shards(profile, run) -> None:
    """Render the run's original answers into `shards-original/` unless a complete set is there."""
    from regen.render.originals import write_original_generations
    from regen.render.stage import run_render

    orig = run.with_responses("original")
    if (orig.manifest(orig.shards) or {}).get("complete"):
        return
    made = write_original_generations(run)
    print(f"original answers: {made['num_prompts_with_original']} of {made['num_prompts']} prompts "
          f"({made['num_rows']} turns); rendering them into {orig.shards}", flush=True)
    run_render(profile.render, orig, progress=False)


def write_subset(rows: list[dict], keep: set[str], source_manifest: dict, out_root: Path):
    """The rows whose prompt is in `keep`, as a complete shard set `<out_root>/shards/` with the source's contract.
    Returns (RunDir of out_root, number of rows)."""
    from regen.render.shards import ShardWriter, manifest_totals
    from regen.rundir import RunDir

    sub = RunDir.at(out_root)
    for old in sub.shards.glob("shard-*.parquet"):
        old.unlink()
    sub.shards.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(sub.shards, max_rows=256, max_tokens=1 << 22)
    entries = []
    kept = sorted((r for r in rows if r["prompt_id"] in keep), key=lambda r: (r["prompt_id"], r["turn"], r["sample_id"]))
    for r in kept:
        if not writer.fits(r):
            entries.append(writer.flush())
        closed = writer.add(r)
        if closed:
            entries.append(closed)
    last = writer.flush()
    entries += [last] if last else []
    manifest = {**{k: source_manifest.get(k) for k in MANIFEST_KEYS}, "status": "complete", "complete": True,
                **manifest_totals(entries), "shards": entries, "num_prompts": len({r["prompt_id"] for r in kept})}
    sub.write_manifest(sub.shards, manifest)
    return sub, len(kept)


def main(argv=None) -> int:
    from regen.config import load_profile
    from regen.errors import InputError
    from regen.rundir import RunDir
    from regen.train.eval import run_eval
    from regen.train.loop import run_train
    from schemas.io import write_json_atomic

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="the main job's run directory (with shards/), e.g. runs/local")
    p.add_argument("--profile", default="local")
    p.add_argument("--seeds", default="0", help="comma-separated training seeds (default 0)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per arm (default: train.max_steps)")
    p.add_argument("--num-prompts", type=int, default=32, help="held-out prompts (default 32)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="generated tokens per prompt (default 64)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="also measure under rejection sampling at this temperature (the paper's tables: 1.0); "
                        "default 0: greedy only")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: {QUICK['steps']} steps, {QUICK['num_prompts']} prompts, "
                        f"{QUICK['max_new_tokens']} new tokens (unless given)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    if not args.temperature >= 0:  # before any training: run_eval would refuse it only after both arms
        raise InputError(f"--temperature {args.temperature}: use T >= 0 (0 = greedy only; the paper's tables: 1.0)")
    if args.quick:
        defaults = p.parse_args(["--run", args.run])
        for key, value in QUICK.items():
            if getattr(args, key) == getattr(defaults, key):
                setattr(args, key, value)

    run = RunDir.at(args.run)
    if not (run.manifest(run.shards) or {}).get("shards"):
        raise InputError(f"{run.shards}/manifest.json lists no shards: run the main job first "
                         f"(regen run --profile {args.profile} --run {args.run})")
    overrides = dict(kv.split("=", 1) for kv in args.overrides)
    if args.steps is not None:
        overrides["train.max_steps"] = str(args.steps)
    profile = load_profile(args.profile, overrides)
    if not profile.train.max_steps:
        raise InputError("train.max_steps is 0: both arms need the same optimizer steps; set --steps N")
    original_shards(profile, run)
    sets = {arm: run.with_responses(arm) for arm in ARMS}
    rows = {arm: shard_rows(sets[arm]) for arm in ARMS}
    common = {r["prompt_id"] for r in rows["regenerated"]} & {r["prompt_id"] for r in rows["original"]}
    if not common:
        raise InputError(f"no prompt has rows in both {sets['regenerated'].shards} and {sets['original'].shards}")
    bench_dir = run.root / "regen-vs-original"
    subsets = {}
    for arm in ARMS:
        subsets[arm], n = write_subset(rows[arm], common, sets[arm].manifest(sets[arm].shards), bench_dir / arm)
        # the run's selection beside each arm's shards: the trainer's held-out split (train.heldout_per_cell's
        # picks) comes from it, so both arms leave out exactly the prompts run_eval measures
        if run.prompts.is_dir():
            shutil.copytree(run.prompts, subsets[arm].prompts, dirs_exist_ok=True)
        print(f"{arm}: {n} rows of {len(common)} common prompts -> {subsets[arm].shards}", flush=True)

    per_seed = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        cfg = load_profile(args.profile, {**overrides, "train.seed": str(seed)}).train
        out = bench_dir / f"seed-{seed}"
        trained = {}
        for arm in ARMS:
            t0 = time.perf_counter()
            summary = run_train(cfg, subsets[arm], train_dir=out / f"train-{arm}")
            trained[arm] = {"steps": summary["steps"], "train_s": round(time.perf_counter() - t0, 1)}
        ev = run_eval(cfg, run, draft_dir=out / "train-regenerated", seed=seed, num_prompts=args.num_prompts,
                      max_new_tokens=args.max_new_tokens, compare={"original": out / "train-original"},
                      progress=False, out_path=out / "eval.json", temperature=args.temperature)
        row = {"seed": seed, "num_prompts": ev["num_prompts"], "max_new_tokens": args.max_new_tokens,
               "num_common_prompts": len(common), "train": trained, **arm_figures(ev),
               "eval_json": str(out / "eval.json")}
        if args.temperature > 0:
            row["sampled"] = {"temperature": args.temperature, **arm_figures(ev["sampled"])}
        per_seed.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "train"}, indent=2), flush=True)

    summary = summarize(per_seed)
    result = {"seeds": [r["seed"] for r in per_seed], **{a: summary[a] for a in SUMMARY_ARMS},
              "per_seed": per_seed, "per_category": summary["per_category"]}
    if args.temperature > 0:
        result["sampled"] = {"temperature": args.temperature, **summarize([r["sampled"] for r in per_seed])}
    write_json_atomic(result, run.root / "regen_vs_original.json")

    print_table("greedy (T = 0)", per_seed, result)
    if args.temperature > 0:
        print_table(f"rejection sampling (T = {args.temperature:g})", [{"seed": r["seed"], **r["sampled"]}
                                                                     for r in per_seed], result["sampled"])
    print(f"-> {run.root / 'regen_vs_original.json'}")
    return 0


ARM_KEYS = {"regenerated": "trained", "original": "original", "untrained": "untrained"}  # arm: run_eval's name
SUMMARY_ARMS = ("untrained", "original", "regenerated")  # the order of the summary JSON


def arm_figures(ev: dict) -> dict:
    """{arm: {acc_len, num_rounds, per_category}, ratio_regenerated_vs_original} of one `run_eval` result (its
    greedy top level, or its `sampled` section)."""
    out = {arm: {"acc_len": ev[key]["acc_len"], "num_rounds": ev[key]["num_rounds"],
                 "per_category": {c: v["acc_len"] for c, v in ev[key]["per_category"].items()}}
           for arm, key in ARM_KEYS.items()}
    out["ratio_regenerated_vs_original"] = out["regenerated"]["acc_len"] / out["original"]["acc_len"]
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(rows: list[dict]) -> dict:
    """Means over seeds: {arm: {acc_len}} and per_category {cat: {arm: acc_len, ratio_regenerated_vs_original}}."""
    cats = sorted({c for r in rows for c in r["regenerated"]["per_category"]})
    per_category = {}
    for c in cats:
        entry = {a: _mean([r[a]["per_category"].get(c) for r in rows]) for a in ARM_KEYS}
        entry["ratio_regenerated_vs_original"] = (entry["regenerated"] / entry["original"]
                                                  if entry["original"] else None)
        per_category[c] = entry
    return {**{a: {"acc_len": _mean([r[a]["acc_len"] for r in rows])} for a in SUMMARY_ARMS},
            "per_category": per_category}


def print_table(title: str, rows: list[dict], summary: dict) -> None:
    print(f"\n{title}\n{'':<14} {'untrained':>9} {'original':>9} {'regen':>9} {'regen/orig':>10}")
    for r in rows:
        print(f"{'seed ' + str(r['seed']):<14} {r['untrained']['acc_len']:9.3f} {r['original']['acc_len']:9.3f} "
              f"{r['regenerated']['acc_len']:9.3f} {r['ratio_regenerated_vs_original']:10.3f}")
    fmt = lambda x: f"{x:9.3f}" if x is not None else f"{'-':>9}"  # noqa: E731
    for c, e in summary["per_category"].items():
        ratio = f"{e['ratio_regenerated_vs_original']:10.3f}" if e["ratio_regenerated_vs_original"] else f"{'-':>10}"
        print(f"{c:<14} {fmt(e['untrained'])} {fmt(e['original'])} {fmt(e['regenerated'])} {ratio}")


if __name__ == "__main__":
    from regen.errors import exit_code

    sys.exit(exit_code(main, "bench/regen_vs_original.py"))
