"""The report's acc_len-per-cell plot says how many of the selection's cells the evaluation measured, and names the
ones it did not (a held-out set of every cell)."""
from __future__ import annotations

from regen.report.acceptance import eval_plots
from regen.train.eval import Round
from regen.train.eval_cells import breakdown
from schemas.io import write_json_atomic


def test_the_cells_plot_names_the_cells_not_measured(tmp_path):
    reqs = [({"prompt_id": f"p{i}", "category": cat, "length_band": "0-128", "mode": None, "prompt_ids": [1, 2]},
             [Round(1, 2, 7, False), Round(0, 1, 7, False)]) for i, cat in enumerate(("coding", "general"))]
    b = breakdown(reqs, 7)
    write_json_atomic({"trained": {"breakdown": b}, "untrained": {"breakdown": b},
                       "heldout": {"cells_selected": 3, "cells_measured": 2,
                                   "cells_not_measured": [["chinese", "128-1536", None]]}}, tmp_path / "eval.json")
    png, caption = eval_plots(tmp_path)["acc_len_cells"]
    assert png and "2 of the selection's 3 cells measured, not: chinese/128-1536/-" in caption
    write_json_atomic({"trained": {"breakdown": b}}, tmp_path / "eval.json")  # an eval.json from before the record
    png, caption = eval_plots(tmp_path)["acc_len_cells"]
    assert png and "cells measured" not in caption
