"""The next selection: more prompts where the draft's acceptance is lowest, within a stated
budget of new generation units, drawn from the pool's prompts not yet used; the reasoning written down.

    regen select --profile P --run R --aim R/eval.json --budget-units N [--policy weakest|mix]

In:  an evaluation (`eval.json` of `regen eval`: the trained draft's acc_len per category x length band x mode,
     `regen.train.eval_cells`), the run's selection (`prompts/`), the profile's sources.
Out: `prompts/part-loop-NN.parquet` (PROMPT_SCHEMA v3, listed in `prompts/manifest.json` under `parts` and
     `loop`), `loop/round-NN.json` and `loop/round-NN.md` (the reasoning). `regen generate` then asks only the new
     prompts' units (its ledger keeps every recorded one); `regen train --init-from` continues from the last draft.

The pool is the selection stage's own (`regen.select.stage.eligible_pool`: `run_select` with every eligible row
taken, the same sources, filters, dedup and control tokens, under `loop/pool/`); "not yet used" = not in any part of
`prompts/`. Held-out prompt ids (`train.heldout_fraction`) are never added: they would change the prompts every
evaluation measures.

Policy `weakest` (where to spend): every cell the pool can supply gets an acc_len: the evaluation's per-round
figure of that cell, shrunk toward its category's figure by `prior_requests` pseudo-requests
(`(n·a_cell + m·a_category) / (n + m)`; a cell without held-out requests takes its category's figure, an unmeasured
category the overall one) because a cell of two requests is mostly noise. A cell's deficit is the overall acc_len
minus its shrunk figure; the budget goes to the cells with a deficit in proportion to it (all cells equally when
none has one). Policy `mix` (the control arm): the budget follows the profile's stated mix (category shares x band
shares, or the pool's band proportions when bands are labels only, x mode shares), whatever was measured.

Units (a prompt's `(prompt, turn)` units, `schemas.prompt.turn_positions`) are allotted by largest remainder; each
cell takes its unused prompts in seeded order (sha of seed, round and prompt id) while their units fit its
allotment; what a cell cannot use (supply exhausted, or no prompt small enough) goes to the other funded cells by
weight. The total never passes the budget. New prompts get the cell's mode.
"""
from __future__ import annotations

import hashlib
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from regen.config.select import SelectConfig
from regen.errors import InputError
from regen.rundir import RunDir
from regen.select.mix import largest_remainder
from schemas.io import read_json, write_json_atomic, write_parquet_atomic
from schemas.prompt import PROMPT_SCHEMA, turn_positions

POLICIES = ("weakest", "mix")


def _key(seed: int, round_no: int, pid: str) -> str:
    return hashlib.sha256(f"{seed}:loop:{round_no}:{pid}".encode()).hexdigest()


def used_ids(run: RunDir) -> set[str]:
    """Prompt ids in every part of the run's selection (its own and earlier rounds')."""
    manifest = run.manifest(run.prompts) or {}
    out: set[str] = set()
    for p in manifest.get("parts", []):
        out.update(pq.read_table(run.prompts / p["path"], columns=["prompt_id"]).column("prompt_id").to_pylist())
    return out


def kept_shares(run: RunDir) -> dict:
    """{(category, length_band, mode): (prompts with a training row, prompts answered)} of the run's selection: how
    much of a cell's generation survived the response filters into the shards (a unit spent where the answers are
    dropped trains nothing). Read from `generations/` (status ok) and `shards/`; {} before render."""
    def ids(stage: Path, key: str, cols: list[str], keep) -> set[str]:
        out: set[str] = set()
        for e in (run.manifest(stage) or {}).get(key, []):
            t = pq.read_table(stage / e["path"], columns=cols).to_pydict()
            out.update(pid for i, pid in enumerate(t["prompt_id"]) if keep(t, i))
        return out

    if not (run.manifest(run.shards) or {}).get("shards"):
        return {}
    answered = ids(run.generations, "parts", ["prompt_id", "status"], lambda t, i: t["status"][i] == "ok")
    trained = ids(run.shards, "shards", ["prompt_id"], lambda t, i: True)
    counts: dict = defaultdict(lambda: [0, 0])
    for p in (run.manifest(run.prompts) or {}).get("parts", []):
        t = pq.read_table(run.prompts / p["path"], columns=["prompt_id", "category", "length_band", "mode"]).to_pydict()
        for i, pid in enumerate(t["prompt_id"]):
            if pid in answered:
                c = counts[(t["category"][i], t["length_band"][i], t["mode"][i])]
                c[0] += pid in trained
                c[1] += 1
    return {cell: tuple(v) for cell, v in counts.items()}


def cell_figures(ev: dict) -> tuple[dict, dict, float]:
    """({cell: (acc_len per round, requests)}, {category: acc_len}, overall acc_len) of the trained draft."""
    b = (ev.get("trained") or {}).get("breakdown")
    if not b:
        raise InputError("the evaluation has no per-cell breakdown (`trained.breakdown`): run `regen eval` with this "
                         "version first")
    cells = {(c["category"], c.get("length_band"), c.get("mode")): (c["acc_len_per_round"], c["num_requests"])
             for c in b["cells"] if c.get("acc_len_per_round") is not None}
    cats = {k: v["acc_len_per_round"] for k, v in (b.get("by") or {}).get("category", {}).items()
            if v.get("acc_len_per_round") is not None}
    overall = b["overall"]["acc_len_per_round"]
    if overall is None:
        raise InputError("the evaluation measured no verification round: nothing to aim at")
    return cells, cats, overall


def weights_weakest(supply_cells: list, ev: dict, prior_requests: float) -> tuple[dict, list[dict]]:
    """({cell: weight}, rows of the reasoning table) for policy `weakest` (module docstring)."""
    measured, cats, overall = cell_figures(ev)
    rows, deficit = [], {}
    for cell in supply_cells:
        a, n = measured.get(cell, (None, 0))
        parent = cats.get(cell[0], overall)
        shrunk = parent if a is None else (n * a + prior_requests * parent) / (n + prior_requests)
        deficit[cell] = max(0.0, overall - shrunk)
        rows.append({"category": cell[0], "length_band": cell[1], "mode": cell[2], "acc_len": a, "requests": n,
                     "category_acc_len": parent, "shrunk_acc_len": round(shrunk, 4),
                     "deficit": round(deficit[cell], 4)})
    total = sum(deficit.values())
    weights = {c: d / total for c, d in deficit.items()} if total > 0 else {c: 1.0 for c in supply_cells}
    return weights, rows


def weights_mix(supply_cells: list, cfg: SelectConfig, pool_bands: dict) -> tuple[dict, list[dict]]:
    """({cell: weight}, reasoning rows) for policy `mix`: the profile's category x band x mode shares."""
    shares = cfg.shares()
    bands = dict(zip(cfg.band_names(), cfg.band_shares)) if cfg.band_shares else None
    modes = cfg.mode_shares()
    weights, rows = {}, []
    for cell in supply_cells:
        c, b, m = cell
        band_share = bands.get(b, 0.0) if bands is not None else pool_bands.get(c, {}).get(b, 0.0)
        w = shares.get(c, 0.0) * band_share * modes.get(m if m is not None else "default", 0.0)
        weights[cell] = w
        rows.append({"category": c, "length_band": b, "mode": m, "category_share": shares.get(c, 0.0),
                     "band_share": round(band_share, 4), "mode_share": modes.get(m or "default", 0.0),
                     "weight": round(w, 6)})
    return weights, rows


def allocate(weights: dict, candidates: dict, budget: int) -> dict:
    """{cell: [prompt dicts]} within `budget` units (module docstring). `candidates`: {cell: prompts in seeded
    order, each with `prompt_id` and `units`}; a prompt is taken once, by the first cell that reaches it (the same
    prompt is a candidate of every mode's cell)."""
    chosen: dict = {c: [] for c in weights}
    nxt = {c: 0 for c in weights}
    taken: set[str] = set()

    def head(cell):
        """The cell's next untaken prompt, or None."""
        items = candidates.get(cell, [])
        while nxt[cell] < len(items) and items[nxt[cell]]["prompt_id"] in taken:
            nxt[cell] += 1
        return items[nxt[cell]] if nxt[cell] < len(items) else None

    def take(cell, p):
        chosen[cell].append(p)
        taken.add(p["prompt_id"])
        nxt[cell] += 1

    left = budget
    live = {c for c, w in weights.items() if w > 0 and head(c) is not None}
    while left > 0 and live:
        share = largest_remainder(left, {c: weights[c] for c in live})
        spent = 0
        for cell in sorted(live, key=str):  # each cell fills its share in its own seeded order, never skipping
            room = share[cell]
            while room > 0 and (p := head(cell)) is not None and p["units"] <= room:
                take(cell, p)
                room -= p["units"]
                spent += p["units"]
        left -= spent
        if spent == 0:  # no share fits the next prompt: the heaviest funded cell whose next prompt fits takes it
            fits = [c for c in sorted(live, key=lambda c: (-weights[c], str(c)))
                    if (p := head(c)) is not None and p["units"] <= left]
            if not fits:
                break
            p = head(fits[0])
            take(fits[0], p)
            left -= p["units"]
        live = {c for c in live if (p := head(c)) is not None and p["units"] <= left}
    return chosen


def is_heldout(prompt_id: str, fraction: float) -> bool:
    """The trainer's held-out rule (`regen.train.heldout.is_heldout`, the same sha256 bucket of the prompt id; the two
    are compared in tests/select/test_aim.py): a stage reads another's files, never its modules."""
    if fraction <= 0:
        return False
    return int(hashlib.sha256(prompt_id.encode("utf-8")).hexdigest(), 16) % 1_000_000 < round(fraction * 1_000_000)


def next_selection(cfg: SelectConfig, run: RunDir, pool: pa.Table, *, seed: int, eval_path: str | Path | None,
                   budget_units: int, policy: str = "weakest", heldout_fraction: float = 0.0,
                   prior_requests: float = 4.0) -> dict:
    """Write the next round's prompts and its reasoning (module docstring); returns the round's record.

    pool: every eligible prompt (PROMPT_SCHEMA table; `regen.select.stage.eligible_pool`, which
    `regen.select.stage.next_round` computes before calling this).

    Raises InputError for an unknown policy, a budget < 1, a run without a selection, or (policy weakest) a
    missing evaluation or one without a breakdown."""
    if policy not in POLICIES:
        raise InputError(f"--policy {policy!r}: use one of {list(POLICIES)}")
    if budget_units < 1:
        raise InputError(f"--budget-units {budget_units}: the new generation units of this round, >= 1")
    manifest = run.manifest(run.prompts)
    if not manifest or not manifest.get("parts"):
        raise InputError(f"{run.prompts}: no selection yet; run `regen select` (or `regen run`) first")
    ev = None
    if policy == "weakest" or eval_path is not None:
        path = Path(eval_path) if eval_path is not None else run.root / "eval.json"
        ev = read_json(path)
        if ev is None:
            raise InputError(f"{path}: no evaluation; run `regen eval --run {run.root} --draft ...` first")
    rounds = list(manifest.get("loop") or [])
    round_no = len(rounds) + 1
    used = used_ids(run)
    rows = pool.select(["prompt_id", "category", "length_band", "messages"]).to_pylist()
    candidates: dict = defaultdict(list)
    band_counts: dict = defaultdict(lambda: defaultdict(int))
    modes = list(cfg.modes) or [None]
    skipped_heldout = 0
    for r in rows:
        band_counts[r["category"]][r["length_band"]] += 1
        if r["prompt_id"] in used:
            continue
        if is_heldout(r["prompt_id"], heldout_fraction):
            skipped_heldout += 1
            continue
        units = len(turn_positions(r["messages"]))
        for m in modes:  # a new prompt can serve any mode: its cell's mode is given when it is chosen
            candidates[(r["category"], r["length_band"], m)].append(
                {"prompt_id": r["prompt_id"], "units": units, "key": _key(seed, round_no, f"{m}:{r['prompt_id']}")})
    for items in candidates.values():
        items.sort(key=lambda p: p["key"])
    cells = sorted(candidates, key=lambda c: tuple(str(x) for x in c))
    pool_bands = {c: {b: n / sum(v.values()) for b, n in v.items()} for c, v in band_counts.items()}
    if policy == "weakest":
        weights, table = weights_weakest(cells, ev, prior_requests)
    else:
        weights, table = weights_mix(cells, cfg, pool_bands)
    chosen = allocate(weights, candidates, budget_units)
    kept = kept_shares(run)
    assigned = {p["prompt_id"]: cell[2] for cell, ps in chosen.items() for p in ps}
    for row in table:
        cell = (row["category"], row["length_band"], row["mode"])
        row.update(kept=kept.get(cell), weight=round(weights.get(cell, 0.0), 6), supply=len(candidates.get(cell, [])),
                   prompts_added=len(chosen.get(cell, [])), units_added=sum(p["units"] for p in chosen.get(cell, [])))
    new = pool.filter(pc.is_in(pool["prompt_id"], pa.array(sorted(assigned), type=pa.string())))
    new = new.set_column(new.schema.get_field_index("mode"), "mode",
                         pa.array([assigned[p] for p in new.column("prompt_id").to_pylist()], type=pa.string()))
    name = f"part-loop-{round_no:02d}.parquet"
    units = sum(r["units_added"] for r in table)
    record = {"round": round_no, "policy": policy, "budget_units": budget_units, "units_added": units,
              "prompts_added": new.num_rows, "part": name, "eval": str(eval_path) if ev is not None else None,
              "eval_draft": (ev or {}).get("draft"), "prior_requests": prior_requests, "seed": seed,
              "pool_prompts": pool.num_rows, "unused_prompts": sum(r["prompt_id"] not in used for r in rows),
              "heldout_skipped": skipped_heldout, "status": "selected",
              "reasoning": f"loop/round-{round_no:02d}.md"}
    out_dir = run.root / "loop"
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic({**record, "cells": table}, out_dir / f"round-{round_no:02d}.json")
    (out_dir / f"round-{round_no:02d}.md").write_text(reasoning_md(record, table, ev), encoding="utf-8")
    if new.num_rows:
        info = write_parquet_atomic(new, run.prompts / name, PROMPT_SCHEMA)
        manifest["parts"] = [*manifest["parts"], info]
    manifest["loop"] = [*rounds, record]
    run.write_manifest(run.prompts, manifest)
    return record


def update_round(run: RunDir, round_no: int, **fields) -> dict:
    """Merge `fields` into round `round_no`'s record in `prompts/manifest.json` (how far the round got: `status`,
    the draft it trains from, its training directory and evaluation); returns the record."""
    manifest = run.manifest(run.prompts) or {}
    rounds = manifest.get("loop") or []
    if not 0 < round_no <= len(rounds):
        raise InputError(f"{run.prompts}/manifest.json has no loop round {round_no}")
    rounds[round_no - 1] = {**rounds[round_no - 1], **fields}
    manifest["loop"] = rounds
    run.write_manifest(run.prompts, manifest)
    return rounds[round_no - 1]


def reasoning_md(record: dict, table: list[dict], ev: dict | None) -> str:
    """The round's reasoning for people: what was measured, which cells get how many units, and why."""
    lines = [f"# Loop round {record['round']}: policy `{record['policy']}`", "",
             f"Budget: {record['budget_units']:,} new generation units; added {record['prompts_added']:,} prompts "
             f"({record['units_added']:,} units) from {record['unused_prompts']:,} unused prompts of the pool "
             f"({record['heldout_skipped']:,} held-out ones never added).", ""]
    if record["policy"] == "weakest":
        overall = ((ev or {}).get("trained") or {}).get("breakdown", {}).get("overall", {}).get("acc_len_per_round")
        lines += [f"Measured: `{record['eval']}` (draft `{record['eval_draft']}`), overall acc_len per round "
                  f"{overall:.3f}. Each cell's acc_len is shrunk toward its category's by {record['prior_requests']:g} "
                  "pseudo-requests; the budget goes to cells below the overall figure, in proportion to how far "
                  "below.", "",
                  "| category | length band | mode | acc_len | requests | category acc_len | shrunk | deficit | "
                  "weight | supply | prompts | units | answers kept |", "|" + "---|" * 13]
        for r in sorted(table, key=lambda r: -r["weight"]):
            a = "-" if r["acc_len"] is None else f"{r['acc_len']:.3f}"
            lines.append(f"| {r['category']} | {r['length_band'] or '-'} | {r['mode'] or '-'} | {a} | {r['requests']} "
                         f"| {r['category_acc_len']:.3f} | {r['shrunk_acc_len']:.3f} | {r['deficit']:.3f} | "
                         f"{r['weight']:.3f} | {r['supply']} | {r['prompts_added']} | {r['units_added']} | "
                         f"{_kept(r)} |")
    else:
        lines += ["The budget follows the profile's stated mix (category x band x mode shares), not the measurement.",
                  "", "| category | length band | mode | category share | band share | mode share | weight | supply "
                  "| prompts | units | answers kept |", "|" + "---|" * 11]
        for r in sorted(table, key=lambda r: -r["weight"]):
            lines.append(f"| {r['category']} | {r['length_band'] or '-'} | {r['mode'] or '-'} | "
                         f"{r['category_share']:.3f} | {r['band_share']:.3f} | {r['mode_share']:.3f} | "
                         f"{r['weight']:.4f} | {r['supply']} | {r['prompts_added']} | {r['units_added']} | "
                         f"{_kept(r)} |")
    lines += ["", "Answers kept: of the cell's prompts answered so far, how many have a training row after the response "
              "filters (what a unit spent there is likely to buy); the allocation does not use it."]
    return "\n".join(lines) + "\n"


def _kept(row: dict) -> str:
    k = row.get("kept")
    return "-" if not k else f"{k[0]}/{k[1]} ({k[0] / k[1]:.0%})"
