"""The selection policy of `regen select`: per-category targets from the mix and the supply, and the seeded choice.

Per-source and per-language caps bound the eligible pool (rows beyond a cap, in seeded key order, are not
eligible); each category gets round(total * share) (largest remainder); a category short of supply gives its
shortfall to the others in proportion to their shares (`shortfall_policy: redistribute`; `report_only` leaves it
unfilled). With `band_shares`, a category's count is split over the input-length bands the same way (a band short
of supply gives its shortfall to the category's other bands by share). Within a category (or category x band) the
rows with the smallest seeded keys (sha of seed + prompt_id) are taken: same seed, same prompt_id list; another
seed, another sample in the same mix.

Modes (`assign_modes`): within every category x band cell of the selection, the modes get largest-remainder
counts of the cell's prompts by `select.modes` shares, in the order of a second seeded key (sha of seed, "mode"
and prompt_id), so each cell holds the stated proportions and the assignment does not follow the selection order.
"""
from __future__ import annotations

import hashlib
from collections import Counter

import numpy as np
import pyarrow as pa

from regen.config.select import SelectConfig
from schemas.prompt import CATEGORIES


def largest_remainder(total: int, weights: dict[str, float]) -> dict[str, int]:
    """Integers proportional to `weights` summing to `total` (Hamilton's method; ties by name)."""
    s = sum(weights.values())
    if total <= 0 or s <= 0:
        return {k: 0 for k in weights}
    raw = {k: total * w / s for k, w in weights.items()}
    out = {k: int(v) for k, v in raw.items()}
    rest = total - sum(out.values())
    for k in sorted(raw, key=lambda k: (-(raw[k] - out[k]), k))[:rest]:
        out[k] += 1
    return out


def plan_mix(shares: dict[str, float], supply: dict[str, int], total: int, policy: str = "redistribute") -> dict:
    """Per-category targets for `total` prompts given `supply` (eligible rows per category).

    Returns {"target": requested counts, "alloc": counts to select, "shortfall": {cat: missing}}. With
    `redistribute`, the missing rows go to categories with spare supply in proportion to their shares
    (repeated until no spare supply is left among categories with a share > 0).
    """
    target = largest_remainder(total, shares)
    alloc = {c: min(target[c], supply.get(c, 0)) for c in shares}
    shortfall = {c: target[c] - alloc[c] for c in shares if target[c] > alloc[c]}
    if policy == "redistribute":
        missing = total - sum(alloc.values())
        while missing > 0:
            spare = {c: supply.get(c, 0) - alloc[c] for c in shares if shares[c] > 0 and supply.get(c, 0) > alloc[c]}
            if not spare:
                break
            extra = largest_remainder(missing, {c: shares[c] for c in spare})
            moved = 0
            for c, n in extra.items():
                n = min(n, spare[c])
                alloc[c] += n
                moved += n
            missing -= moved
            if moved == 0:
                break
    return {"target": target, "alloc": alloc, "shortfall": shortfall}


def seeded_keys(prompt_ids: list[str], seed: int) -> np.ndarray:
    """uint64 sort keys: sha256(seed:prompt_id) first 8 bytes. Deterministic, independent of row order."""
    prefix = f"{seed}:".encode()
    return np.fromiter(
        (int.from_bytes(hashlib.sha256(prefix + p.encode()).digest()[:8], "big") for p in prompt_ids),
        dtype=np.uint64, count=len(prompt_ids),
    )


def select_rows(pool: pa.Table, cfg: SelectConfig, seed: int, keep: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
    """Indices of `pool` rows to select (ordered by seeded key) and the mix report (see module docstring).

    `keep` (bool[pool.num_rows]) marks the rows still in the pool after near dedup (default: all).
    """
    n = pool.num_rows
    keys = seeded_keys(pool.column("prompt_id").to_pylist(), seed)
    order = np.argsort(keys, kind="stable")
    cats = np.asarray(pool.column("category").to_pylist(), dtype=object)
    eligible = np.ones(n, dtype=bool) if keep is None else keep.copy()
    capped = Counter()
    for column, caps in (("source", cfg.max_per_source), ("language", cfg.max_per_language)):
        if not caps:
            continue
        values = np.asarray(pool.column(column).to_pylist(), dtype=object)
        seen: Counter = Counter()
        for i in order:
            v = values[i]
            if v in caps and eligible[i]:
                if seen[v] >= caps[v]:
                    eligible[i] = False
                    capped[f"{column}:{v}"] += 1
                else:
                    seen[v] += 1
    shares = cfg.shares()
    supply = Counter(cats[eligible].tolist())
    plan = plan_mix(shares, dict(supply), cfg.total, cfg.shortfall_policy)
    bands = (np.asarray(pool.column("length_band").to_pylist(), dtype=object)
             if "length_band" in pool.column_names else np.full(n, None, dtype=object))
    cell_alloc, band_report = band_quotas(cats, bands, eligible, plan["alloc"], cfg)
    taken: Counter = Counter()
    taken_cell: Counter = Counter()
    chosen = []
    for i in order:
        if eligible[i]:
            c = cats[i]
            cell = (c, bands[i]) if cell_alloc is not None else None
            if taken[c] < plan["alloc"].get(c, 0) and (cell is None or taken_cell[cell] < cell_alloc.get(cell, 0)):
                taken[c] += 1
                taken_cell[cell] += 1
                chosen.append(i)
    chosen_arr = np.asarray(chosen, dtype=np.int64)
    num = max(len(chosen), 1)
    mix = {
        c: {
            "share_requested": round(shares[c], 6),
            "target": plan["target"][c],
            "available": int(supply.get(c, 0)),
            "selected": int(taken.get(c, 0)),
            "share_selected": round(taken.get(c, 0) / num, 6),
            "shortfall": int(plan["shortfall"].get(c, 0)),
        }
        for c in CATEGORIES
    }
    report = {"mix": mix, "capped": dict(capped), "num_selected": len(chosen), "num_requested": cfg.total,
              "total_shortfall": max(0, cfg.total - len(chosen))}
    if band_report is not None:
        for (c, b), n_sel in taken_cell.items():
            band_report[c][b]["selected"] = int(n_sel)
        report["bands"] = band_report
    return chosen_arr, report


def band_quotas(cats: np.ndarray, bands: np.ndarray, eligible: np.ndarray, alloc: dict[str, int],
                cfg: SelectConfig) -> tuple[dict | None, dict | None]:
    """Per (category, band) counts: each category's `alloc` split by `cfg.band_shares` over its bands' eligible
    supply (`plan_mix`, shortfall redistributed within the category). (None, None) without band shares.

    Returns ({(category, band): count}, {category: {band: {share_requested, target, available, selected: 0}}}).
    """
    if not cfg.band_shares:
        return None, None
    names = cfg.band_names()
    shares = dict(zip(names, cfg.band_shares))
    supply = Counter(zip(cats[eligible].tolist(), bands[eligible].tolist()))
    cells: dict = {}
    report: dict = {}
    for c in CATEGORIES:
        by_band = {b: supply.get((c, b), 0) for b in names}
        plan = plan_mix(shares, by_band, alloc.get(c, 0), "redistribute")
        report[c] = {b: {"share_requested": round(shares[b], 6), "target": plan["target"][b],
                         "available": int(by_band[b]), "selected": 0} for b in names}
        cells.update({(c, b): k for b, k in plan["alloc"].items()})
    return cells, report


def assign_modes(prompt_ids: list[str], categories: list[str], bands: list, shares: dict[str, float],
                 seed: int) -> list[str]:
    """The generation mode of each selected prompt (module docstring): within each (category, band) cell, modes
    get `largest_remainder(cell size, shares)` prompts in the order of seeded_keys over "mode:" + prompt_id."""
    keys = seeded_keys([f"mode:{p}" for p in prompt_ids], seed)
    cells: dict = {}
    for i, cell in enumerate(zip(categories, bands)):
        cells.setdefault(cell, []).append(i)
    out: list[str] = [""] * len(prompt_ids)
    for members in cells.values():
        members.sort(key=lambda i: int(keys[i]))
        counts = largest_remainder(len(members), shares)
        at = 0
        for mode in sorted(counts):
            for i in members[at: at + counts[mode]]:
                out[i] = mode
            at += counts[mode]
    return out
