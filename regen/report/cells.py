"""The mix's cells in a plan: `regen plan`'s count of prompts and units per input-length band x generation mode
(`select.length_bands`, `select.modes`), and the assumed output tokens of each mode.

A mode's units are assumed to produce `plan.mode_output_factor[mode]` x their category's `plan.output_tokens`
(1.0 for a mode left out): thinking off answers are shorter than thinking at maximum effort. Like every `plan:`
value it is an assumption, labelled as such, until `regen plan --pilot N` measures the run's own rates (the pilot's
rates are per category and turn; the factors then only split the pilot's figures, they do not change them).
"""
from __future__ import annotations

import json


def out_tokens(a: dict, category: str) -> float:
    """The assumed output tokens per unit of `category` (`plan.output_tokens`, else its `default`)."""
    return a["output_tokens"].get(category, a["output_tokens"].get("default", 0))


def mode_factor(a: dict, mode: str | None) -> float:
    """The assumed output-token factor of `mode` (`plan.mode_output_factor`, 1.0 when absent)."""
    return float((a.get("mode_output_factor") or {}).get(mode, 1.0)) if mode is not None else 1.0


def set_template_kwargs(prompts: list[dict], generate_cfg, render_cfg, renderer_name: str) -> None:
    """Give each prompt dict the template kwargs its rows are rendered with (`template_kwargs`): the profile's,
    overridden by its mode's request (`GenerateConfig.for_mode`, read as `regen.render.rows.template_kwargs_of`
    reads a row's request_params), so a plan renders thinking-off prompts without the effort note."""
    from regen.render.rows import KIMI_TEMPLATE_KWARGS, template_kwargs_of

    allowed = KIMI_TEMPLATE_KWARGS if renderer_name == "kimi-k3" else ()
    by_mode: dict = {}
    for p in prompts:
        mode = p.get("mode")
        if mode not in by_mode:
            cfg = generate_cfg.for_mode(mode)
            row = {"request_params": json.dumps({"temperature": cfg.temperature, **cfg.extra_body})}
            by_mode[mode] = template_kwargs_of(row, render_cfg.template_kwargs, allowed)
        p["template_kwargs"] = by_mode[mode]


def cell_plan(prompts: list[dict], scale: float, a: dict) -> dict:
    """{"cells": [{length_band, mode, prompts, units, output_tokens_per_unit}], "note"}: the selection (scaled as
    every count of the plan) by band x mode; output tokens per unit are the category's assumption x the mode's
    factor, averaged over the cell's units."""
    cells: dict = {}
    for p in prompts:
        key = (p.get("length_band"), p.get("mode"))
        c = cells.setdefault(key, {"prompts": 0, "units": 0, "output": 0.0})
        n = len(p["positions"])
        c["prompts"] += 1
        c["units"] += n
        c["output"] += n * out_tokens(a, p["category"]) * mode_factor(a, p.get("mode"))
    rows = [{"length_band": b, "mode": m, "prompts": round(c["prompts"] * scale), "units": round(c["units"] * scale),
             "output_tokens_per_unit": round(c["output"] / c["units"], 1) if c["units"] else 0.0}
            for (b, m), c in sorted(cells.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1])))]
    return {"cells": rows, "mode_output_factor": dict(a.get("mode_output_factor") or {}),
            "note": "assumed: a mode's output tokens = its category's plan.output_tokens x plan.mode_output_factor"}


def print_cells(cells: dict, width: int | None = None) -> None:
    """The band x mode table of a plan (nothing when the profile has neither bands nor modes), at most `width`
    columns wide (the terminal's when None)."""
    from regen.report.query import print_table

    rows = [r for r in cells.get("cells", []) if r["length_band"] is not None or r["mode"] is not None]
    if rows:
        print_table(["length band", "mode", "prompts", "units", "output tokens/unit"],
                    [[r["length_band"] or "-", r["mode"] or "-", r["prompts"], r["units"],
                      r["output_tokens_per_unit"]] for r in rows], title="cells (" + cells["note"] + ")", width=width)
