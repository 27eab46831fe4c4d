"""acc_len per category x length band x mode: the per-cell figures on scripted rounds (both
averages, conditional and unconditional per-position acceptance), and `regen eval` end to end writing them for the
labels the selection recorded."""
from __future__ import annotations

import json

import pyarrow as pa
import pytest
import torch

from regen.train.eval import Round
from regen.train.eval_cells import breakdown, figures, format_cells
from schemas.io import write_parquet_atomic
from schemas.prompt import PROMPT_SCHEMA, PromptRecord


def R(accepted, proposed=4, stopped=False):
    return Round(accepted=accepted, tau=accepted + 1, proposed=proposed, stopped=stopped)


def test_per_round_and_per_request_averages_differ_as_they_should():
    # request a: 1 round of tau 5; request b: 3 rounds of tau 1 -> per round 8/4 = 2.0, per request (5 + 1)/2 = 3.0
    a = ({"category": "coding", "length_band": "0-2K", "mode": "m", "prompt_ids": [1, 2, 3]}, [R(4)])
    b = ({"category": "coding", "length_band": "0-2K", "mode": "m", "prompt_ids": [1]}, [R(0), R(0), R(0)])
    f = figures([a, b], block_size=4)
    assert f["acc_len_per_round"] == pytest.approx(2.0) and f["acc_len_per_request"] == pytest.approx(3.0)
    assert f["num_requests"] == 2 and f["num_rounds"] == 4 and f["mean_prompt_tokens"] == 2.0
    # position 0: 1 of 4 rounds accepted it; all 4 proposed it -> conditional = unconditional = 0.25
    assert f["accept_rate"][0] == f["position_acceptance"][0] == pytest.approx(0.25)
    # a stop-cut round proposes fewer: the conditional rate divides by the rounds that reached the position
    stop = Round(accepted=1, tau=1, proposed=1, stopped=True)  # a stop token accepted at j = 1: no bonus
    g = figures([({"category": "coding", "length_band": "0-2K", "mode": "m"}, [R(2, proposed=4), stop])], 4)
    assert g["accept_rate"][:3] == [1.0, 1.0, 0.0] and g["position_acceptance"][:3] == [1.0, 0.5, 0.0]
    assert g["acc_len_per_round"] == 2.0 and 1 + sum(g["position_acceptance"]) == 2.5  # the stop round: no bonus
    empty = figures([({"category": "x"}, [])], block_size=2)
    assert empty["num_requests_without_rounds"] == 1 and empty["acc_len_per_round"] is None


def test_breakdown_by_cell_and_by_dimension():
    reqs = []
    for band, acc in (("0-2K", 3), ("2K-8K", 0)):
        for mode in ("think", "no_think"):
            reqs.append(({"category": "general", "length_band": band, "mode": mode}, [R(acc)] * 2))
    reqs.append(({"category": "coding", "length_band": None, "mode": None}, [R(1)]))
    b = breakdown(reqs, block_size=4)
    cells = {(c["category"], c["length_band"], c["mode"]): c for c in b["cells"]}
    assert len(cells) == 5 and cells[("general", "2K-8K", "think")]["acc_len_per_round"] == 1.0
    assert cells[("general", "0-2K", "no_think")]["acc_len_per_round"] == 4.0
    assert b["by"]["length_band"]["0-2K"]["acc_len_per_round"] == 4.0
    assert b["by"]["length_band"]["2K-8K"]["num_requests"] == 2 and b["by"]["length_band"]["None"]["num_rounds"] == 1
    assert b["by"]["mode"]["think"]["acc_len_per_request"] == pytest.approx(2.5)
    assert set(b["averaging"]) == {"acc_len_per_round", "acc_len_per_request", "accept_rate", "position_acceptance"}
    table = format_cells({"trained": {"breakdown": b}})
    assert "| general | 2K-8K | think | 1 | 2 | 1.000 | 1.000 | 0.000 |" in table


def _label_prompts(run, rows, labels):
    records = [PromptRecord(prompt_id=r["prompt_id"], messages=[{"role": "user", "content": r["prompt_id"]}],
                            tools=None, category=r["category"], language="en", source="t", source_file="t",
                            source_row=i, length_band=labels[i % len(labels)][0], mode=labels[i % len(labels)][1])
               for i, r in enumerate(rows)]
    table = pa.Table.from_pylist([x.to_arrow_row() for x in records], schema=PROMPT_SCHEMA)
    write_parquet_atomic(table, run.prompts / "part-00000.parquet", PROMPT_SCHEMA)
    return {x.prompt_id: (x.length_band, x.mode) for x in records}


@pytest.mark.integration
def test_regen_eval_writes_the_breakdown_for_the_selections_labels(tmp_path, shard_writer, capsys):
    from train_helpers import make_rows, make_tiny_target

    from regen.cli import main
    from regen.config.train import TrainConfig
    from regen.rundir import RunDir
    from regen.train.eval import run_eval
    from regen.train.model import DSparkDraft, save_draft, small_config_for_target
    from regen.train.target import TargetContract, TargetFeatures

    target = make_tiny_target(tmp_path / "target")
    rows = make_rows(8, seed=2, vocab=512, min_len=20, max_len=40)
    shard_writer.add(rows, complete=True)
    run = RunDir.at(shard_writer.dir.parent)
    want = _label_prompts(run, rows, [("0-128", "a"), ("0-128", "b"), ("128-1536", "a"), ("128-1536", "b")])
    tf = TargetFeatures.from_pretrained(target, TargetContract((0, 2)))
    dcfg = small_config_for_target(tf.config, target_layer_ids=(0, 2), num_hidden_layers=1, markov_rank=8,
                                   block_size=4)
    torch.manual_seed(1)
    save_draft(DSparkDraft.from_target(tf.model, dcfg), tmp_path / "ckpt")
    cfg = TrainConfig(target=str(target), heldout_fraction=1.0, target_layer_ids=[0, 2])
    out = run_eval(cfg, run, draft_dir=tmp_path / "ckpt", seed=3, num_prompts=8, max_new_tokens=10, progress=False,
                   temperature=1.0)
    saved = json.loads((run.root / "eval.json").read_text())
    for res in (saved, saved["sampled"]):
        for name in ("trained", "untrained"):
            b = res[name]["breakdown"]
            cells = {(c["length_band"], c["mode"]) for c in b["cells"]}
            assert cells == set(want.values())
            assert sum(c["num_requests"] for c in b["cells"]) == 8
            assert sum(c["num_rounds"] for c in b["cells"]) == res[name]["num_rounds"]
            assert b["overall"]["acc_len_per_round"] == pytest.approx(res[name]["acc_len"])
            assert res[name]["acc_len_per_request"] == b["overall"]["acc_len_per_request"]
            assert len(b["cells"][0]["accept_rate"]) == 4 and len(b["cells"][0]["position_acceptance"]) == 4
    assert out["trained"]["breakdown"]["by"]["mode"].keys() == {"a", "b"}
    rc = main(["eval", "--run", str(run.root), "--draft", str(tmp_path / "ckpt"), "--num-prompts", "8",
               "--max-new-tokens", "4", "--set", f"train.target={target}", "--set", "train.heldout_fraction=1.0",
               "--set", "train.target_layer_ids=[0, 2]"])
    printed = capsys.readouterr().out
    assert rc == 0 and "| math | 0-128 | a |" in printed and "acc_len/request" in printed
