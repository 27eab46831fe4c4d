"""The selection policy of `regen select`: per-category targets from the mix and the supply, and the seeded choice.

Per-source and per-language caps bound the eligible pool (rows beyond a cap, in seeded key order, are not
eligible); each category gets round(total * share) (largest remainder); a category short of supply gives its
shortfall to the others in proportion to their shares (`shortfall_policy: redistribute`; `report_only` leaves it
unfilled). Within a category the rows with the smallest seeded keys (sha of seed + prompt_id) are taken: same
seed, same prompt_id list; another seed, another sample in the same mix.
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
    taken: Counter = Counter()
    chosen = []
    for i in order:
        if eligible[i]:
            c = cats[i]
            if taken[c] < plan["alloc"].get(c, 0):
                taken[c] += 1
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
    return chosen_arr, report
