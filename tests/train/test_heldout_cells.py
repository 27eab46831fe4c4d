"""The held-out split covers every cell: the per-cell picks of `train.heldout_per_cell`, kept
by the trainer's feed, recorded, rebuilt and checked by `regen eval`, and never moved by a loop round."""
from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from regen.errors import InputError
from regen.rundir import RunDir
from regen.train.heldout import HeldoutSplit, cell_picks, eval_order, first_selection_cells, heldout_split, is_heldout


def h(pid: str) -> str:
    return hashlib.sha256(pid.encode()).hexdigest()


def write_selection(run_dir, cells: dict[str, tuple], name: str = "part-00000.parquet") -> None:
    """A selection part with the columns the split reads ({prompt_id: (category, band, mode)}), listed in the
    selection's manifest (the first part replaces the list, a loop part is added to it)."""
    (run_dir / "prompts").mkdir(parents=True, exist_ok=True)
    pids = sorted(cells)
    pq.write_table(pa.table({"prompt_id": pids, "category": [cells[p][0] for p in pids],
                             "length_band": [cells[p][1] for p in pids], "mode": [cells[p][2] for p in pids]}),
                   run_dir / "prompts" / name)
    path = run_dir / "prompts" / "manifest.json"
    parts = json.loads(path.read_text())["parts"] if path.exists() and name.startswith("part-loop-") else []
    path.write_text(json.dumps({"parts": [*parts, {"path": name}]}))


def test_every_cell_gets_its_lowest_hash_prompts_up_to_half_the_cell():
    cells = {**{f"a{i}": ("coding", "0-128", None) for i in range(10)},
             **{f"b{i}": ("coding", "128-1536", None) for i in range(3)},
             **{"c0": ("chinese", "0-128", None)}}
    picks = cell_picks(cells, 0.0, 2)
    assert {p for p in picks if p.startswith("a")} == set(sorted((f"a{i}" for i in range(10)), key=h)[:2])
    assert len({p for p in picks if p.startswith("b")}) == 1  # 3 // 2
    assert "c0" in picks  # a cell of one prompt gives it to the evaluation
    assert cell_picks(cells, 0.0, 0) == frozenset()
    # the bucket's prompts count toward a cell's quota: at fraction 1 every prompt is held out already
    assert cell_picks(cells, 1.0, 2) == frozenset()


def test_the_bucket_and_the_picks_together_and_their_record():
    pids = [f"p{i}" for i in range(400)]
    cells = {p: (("general", "reasoning")[i % 2], None, None) for i, p in enumerate(pids)}
    split = HeldoutSplit(0.05, 3, cell_picks(cells, 0.05, 3))
    for cat in ("general", "reasoning"):
        held = [p for p in pids if cells[p][0] == cat and split(p)]
        assert len(held) >= 3
        assert [p for p in held if not is_heldout(p, 0.05)] == sorted(
            [p for p in held if not is_heldout(p, 0.05)], key=h)
    rec = split.record()
    assert rec["per_cell"] == 3 and rec["num_picks"] == len(split.picks) and len(rec["picks_sha256"]) == 64
    assert "per_cell" in rec and "cell_rule" not in HeldoutSplit(0.05).record()


def test_a_loop_round_does_not_move_the_split(tmp_path):
    run = RunDir.at(tmp_path / "run")
    cells = {f"q{i}": (("coding", "general", "tool_use")[i % 3], ("0-128", "128-1536")[i % 2], None)
             for i in range(60)}
    write_selection(run.root, cells)
    before = heldout_split(run, 0.1, 2)
    assert {c for p, c in cells.items() if before(p)} == set(cells.values())  # every cell of the selection
    # a loop part of prompts with lower hashes in the same cells must not change which prompts are held out
    added = {f"loop{i}": cells[f"q{i}"] for i in range(60)}
    write_selection(run.root, added, "part-loop-01.parquet")
    # and a part the manifest does not list (left by an earlier selection) is not the selection
    pq.write_table(pa.table({"prompt_id": ["stale"], "category": ["coding"], "length_band": ["0-128"],
                             "mode": pa.array([None], type=pa.string())}), run.prompts / "part-00009.parquet")
    after = heldout_split(run, 0.1, 2)
    assert after.picks == before.picks and set(first_selection_cells(run)) == set(cells)


def test_the_evaluation_order_covers_the_cells_first():
    prompts = [{"prompt_id": f"x{i}", "category": "general", "length_band": "0-128", "mode": None} for i in range(20)]
    prompts += [{"prompt_id": f"y{i}", "category": "chinese", "length_band": "128-1536", "mode": "thinking"}
                for i in range(2)]
    first = eval_order(prompts)[:2]
    assert {p["category"] for p in first} == {"general", "chinese"}
    assert eval_order(prompts) == eval_order(list(reversed(prompts)))  # a function of the ids, not the input order


@pytest.mark.integration
def test_the_trainer_keeps_the_picks_out_and_eval_measures_them(tiny_run, tmp_path):
    from train_helpers import make_rows

    from regen.config import load_profile
    from regen.train.eval import run_eval
    from regen.train.loop import run_train

    profile, run_dir = tiny_run
    pids = sorted({r["prompt_id"] for k in range(3) for r in make_rows(20, seed=k)})
    bands = ("0-128", "128-512", "512-2K", "2K-8K")  # the shard rows' category is "math"; the selection gives bands
    cells = {p: ("math", bands[i % 4], None) for i, p in enumerate(pids)}
    write_selection(run_dir, cells)
    cfg = load_profile(str(profile), {"train.max_steps": "0", "train.epochs": "1", "train.log_samples": "true",
                                      "train.heldout_fraction": "0.0", "train.heldout_per_cell": "2"}).train
    run_train(cfg, RunDir.at(run_dir))
    split = heldout_split(RunDir.at(run_dir), 0.0, 2)
    assert len(split.picks) == 8 and {cells[p][1] for p in split.picks} == set(bands)
    recorded = json.loads((run_dir / "train" / "heldout.json").read_text())
    assert recorded["per_cell"] == 2 and recorded["picks_sha256"] == split.picks_sha256
    trained = {sid for x in (run_dir / "train" / "samples-rank0.jsonl").read_text().splitlines()
               for sid in json.loads(x)["sample_ids"]}
    assert {"p" + s for s in trained} == set(pids) - split.picks  # one epoch: every row but the picks'
    kw = dict(max_new_tokens=4, progress=False, out_path=tmp_path / "e.json")
    out = run_eval(cfg, RunDir.at(run_dir), draft_dir=run_dir, num_prompts=4, **kw)
    assert {c["length_band"] for c in out["trained"]["breakdown"]["cells"]} == set(bands)  # 4 prompts, 4 cells
    h_ = out["heldout"]
    assert h_["num_heldout_prompts"] == 8 and h_["num_evaluated"] == 4
    assert h_["cells_selected"] == 4 and h_["cells_measured"] == 4 and h_["cells_not_measured"] == []
    # another selection than the draft was trained on: refused, naming the draft's record
    write_selection(run_dir, {p: ("math", "0-128", None) for p in pids})
    with pytest.raises(InputError, match="per-cell prompts of another selection"):
        run_eval(cfg, RunDir.at(run_dir), draft_dir=run_dir, num_prompts=4, **kw)
