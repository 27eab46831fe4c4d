"""The report's acceptance plots: where the draft is weak, and how it got there.

  acc_len_cells        acc_len of the trained draft per category x length band x mode, per round and per request,
                       the untrained draft's per-round figure beside it      <run>/eval.json `breakdown`
  position_acceptance  per-position acceptance (conditional accept_rate and unconditional share of rounds) of the
                       trained draft, overall and per length band           <run>/eval.json `breakdown.by`
  eval_curve           the estimate of acc_len measured during training every `train.eval_every` steps, the best
                       step marked                                          <run>/train/periodic_eval.jsonl

Each returns (base64 PNG, caption) or (None, why it is missing), as `regen.report.html.make_plots` does.
"""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path

from schemas.io import read_json


def _png(fig) -> str:
    """The figure as a base64 PNG (the report's format), closed after."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _label(c: dict) -> str:
    return "/".join(str(x) for x in (c["category"], c.get("length_band") or "-", c.get("mode") or "-"))


def eval_plots(run_root: Path) -> dict[str, tuple[str | None, str]]:
    """The acc_len per cell and per-position plots of `<run>/eval.json` (none before `regen eval` has run, or for
    an eval.json written before the breakdown existed)."""
    import matplotlib.pyplot as plt

    ev = read_json(run_root / "eval.json")
    b = ((ev or {}).get("trained") or {}).get("breakdown")
    if not b:
        why = "no eval.json (run `regen eval`)" if ev is None else "eval.json has no per-cell breakdown"
        return {"acc_len_cells": (None, why), "position_acceptance": (None, why)}
    cells = [c for c in b["cells"] if c["num_rounds"]]
    base = {_label(c): c for c in ((ev.get("untrained") or {}).get("breakdown") or {}).get("cells", [])}
    fig, ax = plt.subplots(figsize=(6, max(2.5, 0.35 * len(cells) + 1)))
    ys = list(range(len(cells)))[::-1]
    ax.barh([y + 0.27 for y in ys], [c["acc_len_per_round"] for c in cells], height=0.27, color="#4c72b0",
            label="trained, per round")
    ax.barh(ys, [c["acc_len_per_request"] or 0 for c in cells], height=0.27, color="#55a868",
            label="trained, per request")
    ax.barh([y - 0.27 for y in ys], [(base.get(_label(c)) or {}).get("acc_len_per_round") or 0 for c in cells],
            height=0.27, color="#bbbbbb", label="untrained, per round")
    ax.set_yticks(ys, [f"{_label(c)} (n={c['num_requests']})" for c in cells])
    ax.set_xlabel("acc_len (tokens per verification round)")
    ax.set_title("acc_len per category / length band / mode")
    ax.legend(fontsize=7)
    held = ev.get("heldout") or {}
    missing = held.get("cells_not_measured") or []
    cover = (f"; {held['cells_measured']} of the selection's {held['cells_selected']} cells measured"
             + (f", not: {', '.join('/'.join(str(x or '-') for x in c) for c in missing)}" if missing else "")
             if held.get("cells_selected") is not None else "")
    out = {"acc_len_cells": (_png(fig), "acc_len per cell (n = held-out requests; per round: every round weighs the "
                                        f"same, per request: every prompt weighs the same{cover})")}
    fig, ax = plt.subplots(figsize=(6, 3.2))
    k = list(range(1, len(b["overall"]["accept_rate"]) + 1))
    ax.plot(k, b["overall"]["accept_rate"], marker="o", color="#4c72b0", label="accept_rate (given reached)")
    ax.plot(k, b["overall"]["position_acceptance"], marker="x", color="#c44e52", label="share of rounds")
    for band, f in (b.get("by", {}).get("length_band") or {}).items():
        if band != "None" and f["num_rounds"]:
            ax.plot(k, f["position_acceptance"], linestyle="--", label=f"share, band {band}")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.05)
    ax.set_title("Per-position acceptance (trained draft)")
    ax.legend(fontsize=7)
    out["position_acceptance"] = (_png(fig), "Acceptance of draft position k: conditional on reaching it, and as a "
                                             "share of all rounds (overall and per length band)")
    return out


def read_curve(run_root: Path) -> list[dict]:
    """The lines of `<run>/train/periodic_eval.jsonl` (`regen.train.periodic_eval`), [] when absent."""
    path = Path(run_root) / "train" / "periodic_eval.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def curve_plot(run_root: Path) -> dict[str, tuple[str | None, str]]:
    """The estimate of acc_len during training against the step, with the best step marked."""
    import matplotlib.pyplot as plt

    curve = read_curve(run_root)
    if not curve:
        return {"eval_curve": (None, "no evaluation during training (train.eval_every = 0, or training has not run)")}
    fig, ax = plt.subplots(figsize=(6, 3.2))
    steps = [c["step"] for c in curve]
    ax.plot(steps, [c["acc_len_estimate"] for c in curve], marker="o", color="#4c72b0", label="estimate")
    best = max(curve, key=lambda c: c["acc_len_estimate"])
    ax.scatter([best["step"]], [best["acc_len_estimate"]], s=90, facecolors="none", edgecolors="#c44e52",
               label=f"best (step {best['step']})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("acc_len estimate")
    ax.set_title("Held-out acc_len estimate during training")
    ax.legend(fontsize=7)
    spent = sum(c.get("seconds") or 0.0 for c in curve)
    cost = f"; the {len(curve)} estimates took {spent:.1f} s" if spent else ""
    return {"eval_curve": (_png(fig), f"acc_len estimated on held-out rows every {curve[0].get('eval_every', '?')} "
                                      f"steps ({curve[0].get('method', 'estimate')}); best {best['acc_len_estimate']:.3f}"
                                      f" at step {best['step']}{cost}")}


def read_log(run_root: Path) -> list[dict]:
    """The lines of `<run>/train/log.jsonl` (one per logged optimizer step: step, loss, tau_probabilistic, ...; the
    trainer, `regen.train.loop`), [] when absent. A line that is not JSON (a run killed mid-write) is skipped."""
    path = Path(run_root) / "train" / "log.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def training_plot(run_root: Path) -> dict[str, tuple[str | None, str]]:
    """The training loss and tau (the expected accepted length per block, `tau_probabilistic`) against the step,
    from the training log, the latest run's steps only where a resumed run logged a step twice."""
    import matplotlib.pyplot as plt

    by_step = {r["step"]: r for r in read_log(run_root) if "step" in r and "loss" in r}
    if not by_step:
        return {"training": (None, "no training log (train has not run)")}
    rows = [by_step[s] for s in sorted(by_step)]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(steps, [r["loss"] for r in rows], color="#4c72b0", label="loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    taus = [(r["step"], r["tau_probabilistic"]) for r in rows if r.get("tau_probabilistic") is not None]
    if taus:
        ax2 = ax.twinx()
        ax2.plot([t[0] for t in taus], [t[1] for t in taus], color="#dd8452", label="tau")
        ax2.set_ylabel("tau (expected accepted length)")
    ax.set_title("Training loss and tau")
    last = rows[-1]
    tau = f", tau {last['tau_probabilistic']:.3f}" if last.get("tau_probabilistic") is not None else ""
    return {"training": (_png(fig), f"training loss (blue) and tau (orange, 1 + the expected accepted draft tokens "
                                    f"per block) every logged step, train/log.jsonl; step {last['step']}: loss "
                                    f"{last['loss']:.4f}{tau}")}


def cells_table(run_root: Path) -> tuple[list[str], list[list]]:
    """(columns, rows) of the trained draft's cells in `<run>/eval.json`; ([], []) without a breakdown."""
    ev = read_json(Path(run_root) / "eval.json") or {}
    b = (ev.get("trained") or {}).get("breakdown")
    if not b:
        return [], []
    cols = ["category", "length_band", "mode", "requests", "rounds", "acc_len/round", "acc_len/request", "accept@0"]
    rows = [[c["category"], c["length_band"], c["mode"], c["num_requests"], c["num_rounds"], c["acc_len_per_round"],
             c["acc_len_per_request"], (c["accept_rate"] or [None])[0]] for c in b["cells"]]
    return cols, rows


def engine_cells_table(run_root: Path) -> tuple[list[str], list[list]]:
    """(columns, rows) of the engine's acc_len per cell in `<run>/engine-eval.json` (the draft served by llama.cpp,
    one row per weight type and cell) beside regen's replay of the same prompts under the engine's budget rule
    (`regen.serve.engines.spec_eval.engine_cell_rows`); ([], []) before `regen engine-eval` has run or for a file
    written before the cells existed."""
    from regen.serve.engines.spec_eval import ENGINE_CELL_COLUMNS, engine_cell_rows

    rows = engine_cell_rows(read_json(Path(run_root) / "engine-eval.json") or {})
    return (ENGINE_CELL_COLUMNS, rows) if rows else ([], [])
