"""The next selection: a round of new prompts within a budget of units, aimed at the cells
where the evaluation's acc_len is lowest (or by the stated mix), from prompts not yet used, reasoning written
down; `regen generate` then asks only the new prompts' units."""
from __future__ import annotations

import json
from collections import Counter

import pyarrow.parquet as pq
import pytest

from regen.cli import main as cli_main
from regen.config import load_profile
from regen.errors import InputError
from regen.rundir import RunDir
from regen.select.aim import allocate, is_heldout
from regen.select.stage import next_round as next_selection
from regen.select.stage import run_select
from regen.train.eval import Round
from regen.train.eval_cells import breakdown
from regen.train.heldout import is_heldout as train_is_heldout
from schemas.prompt import turn_positions

HELDOUT = 0.15


def _eval(weak: str, strong: str, path) -> dict:
    """An eval.json whose trained draft is weak on `weak` prompts (acc_len 1.0) and strong on `strong` (5.0)."""
    reqs = []
    for cat, acc in ((weak, 0), (strong, 4)):
        for band in ("0-128", "128-1536"):
            reqs += [({"category": cat, "length_band": band, "mode": None}, [Round(acc, acc + 1, 7, False)] * 3)] * 3
    ev = {"drafts": {"trained": {}}, "draft": "runs/x/train/checkpoints/step-000750",
          "trained": {"acc_len": 3.0, "breakdown": breakdown(reqs, 7)}}
    path.write_text(json.dumps(ev))
    return ev


@pytest.fixture
def local_run(tmp_path):
    profile = load_profile("local", {"select.total": 40})
    run = RunDir.at(tmp_path / "run")
    run_select(profile.select, run, seed=0, progress=False)
    return profile, run


def _ids(run, part):
    return pq.read_table(run.prompts / part).to_pylist()


def test_the_budget_goes_to_the_weakest_cells_from_unused_training_prompts(local_run, tmp_path):
    profile, run = local_run
    before = {p["prompt_id"] for f in run.prompts.glob("part-0*.parquet") for p in pq.read_table(f).to_pylist()}
    _eval("coding", "general", tmp_path / "eval.json")
    rec = next_selection(profile.select, run, seed=0, eval_path=tmp_path / "eval.json", budget_units=30,
                         heldout_fraction=HELDOUT)
    assert rec["round"] == 1 and rec["policy"] == "weakest" and rec["units_added"] <= 30
    rows = _ids(run, rec["part"])
    units = sum(len(turn_positions(r["messages"])) for r in rows)
    assert units == rec["units_added"] >= 25  # within the budget, and close to it
    assert not {r["prompt_id"] for r in rows} & before  # prompts not yet used
    assert not any(is_heldout(r["prompt_id"], HELDOUT) for r in rows)  # never a held-out prompt
    cats = Counter(r["category"] for r in rows)
    assert cats["coding"] == len(rows)  # coding is below the overall acc_len; general above it gets nothing
    table = json.loads((run.root / "loop" / "round-01.json").read_text())["cells"]
    weak = [c for c in table if c["category"] == "coding"]
    assert all(c["deficit"] > 0 for c in weak) and all(c["weight"] == 0 for c in table if c["category"] == "general")
    md = (run.root / "loop" / "round-01.md").read_text()
    assert "policy `weakest`" in md and "| coding |" in md and "shrunk toward its category" in md
    manifest = json.loads((run.prompts / "manifest.json").read_text())
    assert manifest["parts"][-1]["path"] == "part-loop-01.parquet" and manifest["loop"][0]["units_added"] == units
    # a second round takes other prompts; the selection itself resumes untouched
    rec2 = next_selection(profile.select, run, seed=0, eval_path=tmp_path / "eval.json", budget_units=10,
                          heldout_fraction=HELDOUT)
    assert rec2["round"] == 2 and not {r["prompt_id"] for r in _ids(run, rec2["part"])} & {r["prompt_id"] for r in rows}
    again = run_select(profile.select, run, seed=0, progress=False)
    assert [p["path"] for p in again["parts"]][-2:] == ["part-loop-01.parquet", "part-loop-02.parquet"]


def test_the_mix_policy_follows_the_stated_shares(local_run, tmp_path):
    profile, run = local_run
    rec = next_selection(profile.select, run, seed=0, eval_path=None, budget_units=200, policy="mix",
                         heldout_fraction=HELDOUT)
    rows = _ids(run, rec["part"])
    units = Counter()
    for r in rows:
        units[r["category"]] += len(turn_positions(r["messages"]))
    assert rec["units_added"] == sum(units.values()) <= 200
    for cat, share in profile.select.shares().items():
        assert abs(units[cat] / sum(units.values()) - share) < 0.06, (cat, units)
    assert "stated mix" in (run.root / "loop" / "round-01.md").read_text()


def test_allocate_keeps_within_the_budget_and_passes_on_what_a_cell_cannot_use():
    cand = {"a": [{"prompt_id": f"a{i}", "units": 3} for i in range(2)],  # 6 units of supply only
            "b": [{"prompt_id": f"b{i}", "units": 1} for i in range(50)],
            "c": [{"prompt_id": "a0", "units": 3}]}  # the same prompt in another mode's cell
    got = allocate({"a": 0.8, "b": 0.2, "c": 0.5}, cand, 20)
    used = [p for ps in got.values() for p in ps]
    assert sum(p["units"] for p in used) == 20 and len({p["prompt_id"] for p in used}) == len(used)
    assert len(got["a"]) == 2 and len(got["b"]) == 14  # a's shortfall went to b
    assert sum(p["units"] for p in allocate({"a": 1.0}, {"a": [{"prompt_id": "x", "units": 5}]}, 4)["a"]) == 0


def test_heldout_rule_is_the_trainers():
    ids = [f"p{i}" for i in range(3000)]
    assert [is_heldout(p, 0.15) for p in ids] == [train_is_heldout(p, 0.15) for p in ids]


@pytest.mark.integration
def test_cli_and_its_errors(local_run, tmp_path, capsys):
    profile, run = local_run
    argv = ["select", "--profile", "local", "--run", str(run.root), "--set", "select.total=40"]
    assert cli_main(argv + ["--budget-units", "5"]) == 2
    assert "eval.json: no evaluation" in capsys.readouterr().err
    _eval("reasoning", "chinese", run.root / "eval.json")
    assert cli_main(argv + ["--budget-units", "0"]) == 2
    assert cli_main(argv + ["--budget-units", "12"]) == 0
    out = capsys.readouterr().out
    assert "loop round 1 (weakest):" in out and "of 12 units" in out
    with pytest.raises(InputError, match="no per-cell breakdown"):
        (run.root / "eval.json").write_text(json.dumps({"trained": {"acc_len": 2.0}}))
        next_selection(profile.select, run, seed=0, eval_path=run.root / "eval.json", budget_units=5)


@pytest.mark.integration
def test_generate_asks_only_the_new_prompts(local_run, tmp_path):
    from regen.generate.stage import run_generate
    from regen.testing.openai_server import ServerThread, Settings

    profile, run = local_run
    srv = ServerThread(Settings(models=["fake"]))
    try:
        cfg = profile.generate.model_copy(update={"model": "fake", "max_in_flight": 8, "endpoints": []})
        first = run_generate(cfg, run, endpoints=[srv.base_url], progress=False)
        asked = len(srv.server.log)
        _eval("coding", "general", tmp_path / "eval.json")
        rec = next_selection(profile.select, run, seed=0, eval_path=tmp_path / "eval.json", budget_units=15,
                             heldout_fraction=HELDOUT)
        second = run_generate(cfg, run, endpoints=[srv.base_url], progress=False)
        assert len(srv.server.log) - asked == rec["units_added"]  # only the added prompts' units were asked
        assert second["accounting"]["balanced"]
        assert second["accounting"]["units"] == first["accounting"]["units"] + rec["units_added"]
    finally:
        srv.stop()
