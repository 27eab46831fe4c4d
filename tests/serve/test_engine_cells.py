"""The engine's acceptance per category x length band x mode (for the llama.cpp round trip):
`engine_breakdown` groups the engine's per-request counters by the held-out prompt's cell, and the report and the
CLI show it beside regen's replay. The served round trip itself is in tests/e2e (the main job's serve step)."""
from __future__ import annotations

import json

import pytest

from regen.serve.engines.spec_eval import engine_breakdown, format_engine_cells, summarize_engine


def _result(pid, drafts, accepted, per_pos):
    return {"prompt_id": pid, "category": None, "tokens": [], "stop_type": "limit", "drafts": drafts,
            "accepted": accepted, "draft_tokens": 7 * drafts, "per_pos": per_pos, "predicted_n": 10,
            "predicted_ms": 1.0, "top": []}


PROMPTS = [
    {"prompt_id": "a", "category": "coding", "length_band": "short", "mode": "think"},
    {"prompt_id": "b", "category": "coding", "length_band": "short", "mode": "think"},
    {"prompt_id": "c", "category": "coding", "length_band": "long", "mode": "think"},
    {"prompt_id": "d", "category": "chinese", "length_band": None, "mode": None},
]
RESULTS = [
    _result("a", 10, 5, {0: 4, 1: 1}),   # 1.5 per round
    _result("b", 30, 3, {0: 3}),         # 1.1 per round
    _result("c", 5, 10, {0: 5, 1: 5}),   # 3.0 per round
    _result("d", 0, 0, {}),              # the target stopped at once: no round
]


def test_cells_group_the_engine_counters_by_the_prompts_cell():
    b = engine_breakdown(PROMPTS, RESULTS, 7)
    cells = {(c["category"], c["length_band"], c["mode"]): c for c in b["cells"]}
    assert set(cells) == {("coding", "short", "think"), ("coding", "long", "think"), ("chinese", None, None)}
    short = cells[("coding", "short", "think")]
    # per round: every round weighs the same (1 + 8/40); per request: every prompt weighs the same ((1.5 + 1.1)/2)
    assert short["num_requests"] == 2 and short["num_rounds"] == 40
    assert short["acc_len_per_round"] == pytest.approx(1.2) and short["acc_len_per_request"] == pytest.approx(1.3)
    assert short["position_acceptance"][:3] == pytest.approx([7 / 40, 1 / 40, 0.0])
    assert cells[("chinese", None, None)]["num_requests_without_rounds"] == 1
    assert cells[("chinese", None, None)]["acc_len_per_round"] is None
    # each dimension alone, and the overall figure equal to the whole-run summary
    assert b["by"]["length_band"]["long"]["acc_len_per_round"] == pytest.approx(3.0)
    assert b["by"]["mode"]["think"]["num_requests"] == 3
    assert b["overall"]["acc_len_per_round"] == pytest.approx(summarize_engine(RESULTS, 7)["acc_len"])
    assert "unconditional" in b["averaging"]["position_acceptance"]


def test_prompts_and_results_must_pair_up():
    with pytest.raises(ValueError, match="3 prompts but 4 results"):
        engine_breakdown(PROMPTS[:3], RESULTS, 7)


def test_cli_table_and_report_show_engine_beside_replay(tmp_path):
    from regen.report.acceptance import engine_cells_table

    replay = {"cells": [{"category": "coding", "length_band": "short", "mode": "think", "acc_len_per_round": 1.25}]}
    res = {"by_gguf_type": {"q8_0": {"cells": engine_breakdown(PROMPTS, RESULTS, 7)}},
           "regen": {"cells": {"engine_budget_rule": replay}}}
    table = format_engine_cells(res, "q8_0")
    row = next(ln for ln in table.splitlines() if ln.startswith("| coding | short"))
    assert row.split(" | ")[3:5] == ["2", "40"]  # requests and rounds: whole numbers
    assert "1.200" in row and "1.300" in row and "1.250" in row and "-0.050" in row
    assert format_engine_cells({"by_gguf_type": {"q8_0": {}}}, "q8_0") == ""
    (tmp_path / "engine-eval.json").write_text(json.dumps(res))
    cols, rows = engine_cells_table(tmp_path)
    assert cols[0] == "weights" and len(rows) == 3
    short = next(r for r in rows if r[1:4] == ["coding", "short", "think"])
    assert short[6] == pytest.approx(1.2) and short[8] == pytest.approx(1.25)
    (tmp_path / "engine-eval.json").write_text(json.dumps({"by_gguf_type": {"q8_0": {"engine": {}}}}))
    assert engine_cells_table(tmp_path) == ([], [])


def test_regen_side_resolves_a_training_directory_and_names_a_folder_without_one(tmp_path):
    """regen's replay takes what the CLI takes (a step folder, `<run>/train`, a run): a folder with no checkpoint
    is an InputError naming it, before any model is loaded."""
    from regen.config import load_profile
    from regen.errors import InputError
    from regen.serve.engines.spec_eval import regen_side

    with pytest.raises(InputError, match="--draft .*no draft there"):
        regen_side(load_profile("local").train, [], tmp_path / "train", 8)
