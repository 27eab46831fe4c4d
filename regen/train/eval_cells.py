"""acc_len where it is weak: `regen eval`'s figures per category x input-length band x generation mode, with
per-position acceptance and both averages.

A cell is the held-out prompt's `(category, length_band, mode)` as `regen select` recorded them (PROMPT_SCHEMA
v3; `None` where the selection has no bands or modes). For every cell, and for each dimension alone (`by`), over
the verification rounds of its requests (`regen.train.eval.Round`):

  acc_len_per_round    Σ τ over all rounds / number of rounds: every round weighs the same, so long
                       generations weigh more (the figure `regen eval` has always reported, DS `base_evaluator`)
  acc_len_per_request  the mean over requests of each request's own Σ τ / rounds: every prompt weighs the same
                       (vLLM #42508: the two can order two drafts differently)
  accept_rate[k]       rounds with more than k drafts accepted / rounds that proposed more than k: the
                       conditional acceptance of position k+1 given it was reached (TorchSpec's per-position
                       figure; `regen.train.eval.summarize`)
  position_acceptance[k]  rounds with more than k drafts accepted / all rounds: the unconditional share of
                       rounds whose draft k+1 was accepted (1 + Σ_k position_acceptance[k] = acc_len per round
                       when no stop cuts a round)

Requests without a round (the target stopped at once) count in `num_requests_without_rounds` and in neither mean.
A cell with few requests is a noisy figure: `num_requests` and `num_rounds` stand beside every value.
"""
from __future__ import annotations

from collections import defaultdict

DIMENSIONS = ("category", "length_band", "mode")

AVERAGING = {
    "acc_len_per_round": "sum of tau over all rounds of the cell / its rounds (every round weighs the same)",
    "acc_len_per_request": "mean over the cell's requests of (sum of tau / rounds) of each (every request weighs "
                           "the same)",
    "accept_rate": "per position k: rounds with more than k accepted / rounds proposing more than k (conditional)",
    "position_acceptance": "per position k: rounds with more than k accepted / all rounds (unconditional)",
}


def prompt_labels(run) -> dict[str, dict]:
    """{prompt_id: {length_band, mode}} from the run's selection (`prompts/part-*.parquet`); {} without one. Files
    written before PROMPT_SCHEMA v3 have neither column: their prompts get no labels (None)."""
    import pyarrow.parquet as pq

    out: dict[str, dict] = {}
    for f in sorted(run.prompts.glob("part-*.parquet")):
        names = set(pq.ParquetFile(f).schema_arrow.names)
        cols = [c for c in ("length_band", "mode") if c in names]
        if not cols:
            continue
        t = pq.read_table(f, columns=["prompt_id", *cols]).to_pydict()
        for i, pid in enumerate(t["prompt_id"]):
            out[pid] = {c: t[c][i] for c in cols}
    return out


def cell_of(prompt: dict) -> tuple:
    """(category, length_band, mode) of a held-out prompt dict (`heldout_prompts`)."""
    return (prompt.get("category") or "unknown", prompt.get("length_band"), prompt.get("mode"))


def figures(requests: list[tuple[dict, list]], block_size: int) -> dict:
    """The figures of one group of `(prompt, rounds)` requests (module docstring)."""
    rounds = [r for _, rs in requests for r in rs]
    with_rounds = [rs for _, rs in requests if rs]
    n = len(rounds)
    rates, pos = [], []
    for k in range(block_size):
        proposed = sum(1 for r in rounds if r.proposed > k)
        accepted = sum(1 for r in rounds if r.accepted > k)
        rates.append(round(accepted / proposed, 6) if proposed else None)
        pos.append(round(accepted / n, 6) if n else None)
    tokens = [len(p["prompt_ids"]) for p, _ in requests if p.get("prompt_ids") is not None]
    return {
        "num_requests": len(requests), "num_requests_without_rounds": len(requests) - len(with_rounds),
        "num_rounds": n,
        "acc_len_per_round": round(sum(r.tau for r in rounds) / n, 6) if n else None,
        "acc_len_per_request": (round(sum(sum(r.tau for r in rs) / len(rs) for rs in with_rounds) / len(with_rounds),
                                      6) if with_rounds else None),
        "accept_rate": rates, "position_acceptance": pos,
        "mean_prompt_tokens": round(sum(tokens) / len(tokens), 1) if tokens else None,
    }


def breakdown(requests: list[tuple[dict, list]], block_size: int, *, measure=None, averaging: dict | None = None
              ) -> dict:
    """{"cells": [{category, length_band, mode, **figures}], "by": {dimension: {value: figures}}, "averaging"}
    over `(prompt, rounds)` pairs of one draft, cells sorted by category, band, mode. `measure(pairs)` computes
    one group's figures (default `figures(pairs, block_size)`; the engine's counters take their own:
    `regen.serve.engines.spec_eval.engine_breakdown`), `averaging` says how (default AVERAGING)."""
    measure = measure or (lambda g: figures(g, block_size))
    groups: dict = defaultdict(list)
    by: dict = {d: defaultdict(list) for d in DIMENSIONS}
    for p, rs in requests:
        cell = cell_of(p)
        groups[cell].append((p, rs))
        for d, v in zip(DIMENSIONS, cell):
            by[d][v].append((p, rs))
    cells = [{"category": c, "length_band": b, "mode": m, **measure(g)}
             for (c, b, m), g in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0]))]
    return {"cells": cells,
            "by": {d: {str(v): measure(g) for v, g in sorted(vals.items(), key=lambda kv: str(kv[0]))}
                   for d, vals in by.items()},
            "overall": measure(requests), "averaging": averaging or AVERAGING}


def format_cells(out: dict, draft: str = "trained") -> str:
    """A markdown table of one draft's cells: acc_len per round and per request, accept@0..2, requests, rounds."""
    b = (out.get(draft) or {}).get("breakdown") or {}
    head = ["category", "length band", "mode", "requests", "rounds", "acc_len/round", "acc_len/request",
            "accept@0", "accept@1", "accept@2"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def num(x, fmt="{:.3f}"):
        return "-" if x is None else fmt.format(x)

    for c in b.get("cells", []):
        rates = (c["accept_rate"] + [None] * 3)[:3]
        lines.append("| " + " | ".join([c["category"], c["length_band"] or "-", c["mode"] or "-",
                                        str(c["num_requests"]), str(c["num_rounds"]), num(c["acc_len_per_round"]),
                                        num(c["acc_len_per_request"]), *[num(r) for r in rates]]) + " |")
    return "\n".join(lines)
