"""One round of the data loop end to end on the local profile's real target (SmolLM2-135M)
with a test server answering: the next selection aimed at the evaluation, only its units generated, training
continued from the evaluated draft, the new draft measured on the same held-out prompts; an interrupted round
resumes where it stopped."""
from __future__ import annotations

import json
import shutil

import pytest

from regen.config import load_profile
from regen.pipeline import loop_round, run_pipeline
from regen.rundir import RunDir
from regen.testing.openai_server import ServerThread, Settings

pytestmark = pytest.mark.slow


def overrides(url: str) -> dict:
    """The local profile against a test server, small: 24 prompts, 2 training steps, 4 held-out prompts."""
    return {"serve.enabled": False, "generate.model": "fake", "generate.endpoints": [url],
            "generate.max_tokens": 16, "select.total": 24, "train.max_steps": 2, "train.checkpoint_every": 2,
            "train.eval_prompts": 4, "train.eval_max_new_tokens": 8, "train.heldout_fraction": 0.3,
            "train.progress_interval_s": 0, "render.filters": ["empty_answer"]}


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    srv = ServerThread(Settings(models=["fake"], tokens=12, reasoning_field=None))
    profile = load_profile("local", overrides(srv.base_url))
    run = RunDir.at(tmp_path_factory.mktemp("loop") / "run")
    run_pipeline(profile, run, progress=False, log=lambda *_: None)
    shutil.copytree(run.root, run.root.with_name("main-job"))  # the run before any loop round (the bench's base)
    yield profile, run, srv
    srv.stop()


def test_one_round_generates_only_the_new_prompts_and_trains_on_from_the_last_draft(small_run):
    profile, run, srv = small_run
    ev0 = json.loads((run.root / "eval.json").read_text())
    asked = len(srv.server.log)
    rec = loop_round(profile, run, budget_units=10, train_steps=2, progress=False, log=lambda *_: None)
    assert rec["status"] == "done" and rec["round"] == 1 and 0 < rec["units_added"] <= 10
    assert len(srv.server.log) - asked == rec["units_added"]  # only the added prompts' units were asked
    meta = json.loads(next((run.root / "train-loop-01" / "checkpoints").glob("step-*/training.json")).read_text())
    assert meta["init_from"]["path"] == ev0["draft"] and meta["init_from"]["layout"] == "regen"
    ev1 = json.loads((run.root / "eval-loop-01.json").read_text())
    assert ev1["num_prompts"] == ev0["num_prompts"]  # the same held-out prompts: new prompts are never held out
    # the per-cell picks come from the first selection only: the round's new part does not move them
    assert ev0["heldout"]["per_cell"] == 2 and ev1["heldout"]["picks_sha256"] == ev0["heldout"]["picks_sha256"]
    assert rec["acc_len"] == ev1["trained"]["acc_len"] and ev1["trained"]["breakdown"]["cells"]
    assert (run.root / "loop" / "round-01.md").read_text().startswith("# Loop round 1: policy `weakest`")
    # each cell's share of answered prompts that reached the shards (what a unit there is likely to buy)
    cells = json.loads((run.root / "loop" / "round-01.json").read_text())["cells"]
    kept = [c["kept"] for c in cells if c.get("kept")]
    assert kept and all(0 <= k <= n and n > 0 for k, n in kept)
    assert sum(n for _, n in kept) <= 24  # the answered prompts of the 24-prompt selection
    assert "| answers kept |" in (run.root / "loop" / "round-01.md").read_text()
    assert (run.root / "train-loop-01" / "tensorboard").is_dir()


def test_an_interrupted_round_resumes_after_its_selection(small_run):
    from regen.select.stage import next_round as next_selection

    profile, run, srv = small_run
    rounds = json.loads((run.prompts / "manifest.json").read_text())["loop"]
    rec = next_selection(profile.select, run, seed=0, eval_path=run.root / "eval-loop-01.json", budget_units=6,
                         heldout_fraction=0.3)  # the round's selection, then a crash before generate
    from regen.select.aim import update_round

    update_round(run, rec["round"], init_from=str(run.root / "train-loop-01"))
    asked = len(srv.server.log)
    done = loop_round(profile, run, budget_units=999, train_steps=2, progress=False, log=lambda *_: None)
    assert done["round"] == len(rounds) + 1 == rec["round"] and done["units_added"] == rec["units_added"] <= 6
    assert len(srv.server.log) - asked == rec["units_added"]
    assert json.loads((run.prompts / "manifest.json").read_text())["loop"][-1]["status"] == "done"


def test_bench_loop_runs_both_arms_from_the_same_draft(small_run, tmp_path, capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import loop as bench_loop

    profile, run, srv = small_run
    sets = [x for k, v in overrides(srv.base_url).items() for x in ("--set", f"{k}={json.dumps(v)}")]
    assert bench_loop.main(["--run", str(run.root), *sets, "--budget-units", "4"]) == 2  # rounds already: refused
    rc = bench_loop.main(["--run", str(run.root.with_name("main-job")), *sets, "--budget-units", "4", "--seeds", "0",
                          "--train-steps", "1", "--out", str(tmp_path / "bench")])
    out = capsys.readouterr().out
    assert rc == 0 and "weakest / mix, mean over 1 seed(s):" in out
    assert "cells measured" in out and "| cell | held-out requests | before | weakest after | mix after |" in out
    res = json.loads((tmp_path / "bench" / "loop.json").read_text())["results"]
    assert [r["policy"] for r in res] == ["weakest", "mix"] and all(0 < r["units_added"] <= 4 for r in res)
    assert res[0]["acc_len_before"] == res[1]["acc_len_before"]  # both arms start from the same evaluated draft
    assert all(r["cells_measured"] and r["cells_measured"] <= r["cells_selected"] for r in res)
    assert sum(r["units_per_cell"].get(k, 0) for r in res[:1] for k in r["units_per_cell"]) == res[0]["units_added"]
