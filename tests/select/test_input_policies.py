"""Input policies of `regen select`: hostile text, shape by vote, one file-level
policy across formats naming every bad file, and a selection swapped in only when complete."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from regen.config.select import SelectConfig, SourceConfig
from regen.errors import InputError
from regen.report.query import query
from regen.rundir import RunDir
from regen.select.stage import run_select

GOOD = [{"prompt": t} for t in ("Why is the sky blue?", "Write a haiku about autumn leaves.",
                                 "How do I reverse a list in Python?", "Summarize the plot of Hamlet.",
                                 "What causes ocean tides on Earth?")]
DEEP = "[" * 5000 + "]" * 5000


def _lines(rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def _select(tmp_path, *paths, name="run", **cfg):
    srcs = [SourceConfig(name=f"s{i}", path=str(p)) for i, p in enumerate(paths)]
    run = RunDir.at(tmp_path / name)
    return run, run_select(SelectConfig(sources=srcs, total=cfg.pop("total", 50), **cfg), run, seed=0, progress=False)


def _rejects(run):
    rows = query(run.root, "SELECT source_file, source_row, filter, reason FROM rejected ORDER BY source_file, source_row")[1]
    return {(r[0].rsplit("/", 1)[-1], r[1]): (r[2], r[3]) for r in rows}


@pytest.mark.parametrize("bad,reason", [
    (b'{"prompt": "caf\xe9"}', "not valid UTF-8 (byte 0xe9"),
    (b'{"prompt": "lone \\ud800 surrogate"}', "lone surrogate U+D800"),
    (b'{"prompt": "a pair \\ud83d\\ude00 is fine, a lone low half \\udfff is not"}', "lone surrogate U+DFFF"),
    (DEEP.encode(), "nested deeper than the JSON parser's limit"),
    (b'{"prompt": "nul \\u0000 inside"}', "U+0000"),
    (b'{"prompt": "bell \\u0007 and escape"}', "U+0007"),
    (b'{"prompt": null}', "prompt: must be a string (the prompt text), got null"),
])
@pytest.mark.parametrize("position", [0, 2, 5])
def test_a_hostile_row_is_a_reject_with_a_reason_at_any_position(tmp_path, bad, reason, position):
    rows = GOOD[:position] + [bad] + GOOD[position:]
    (tmp_path / "pool.jsonl").write_bytes(_lines(rows))
    run, m = _select(tmp_path, tmp_path / "pool.jsonl")
    rej = _rejects(run)
    assert list(rej) == [("pool.jsonl", position)], rej
    filt, why = rej[("pool.jsonl", position)]
    assert reason in why and filt in ("parse", "control_chars"), why
    assert m["num_prompts"] == len(GOOD)
    assert m["accounting"]["totals"]["input_rows"] == len(GOOD) + 1


def test_hostile_rows_in_json_and_parquet_files(tmp_path):
    # a .json list with a lone surrogate and a NUL; a parquet file with a control character
    (tmp_path / "a.json").write_text('[{"prompt": "ok one here"}, {"prompt": "x\\ud83d"}, {"prompt": "y\\u0000"}]')
    pq.write_table(pa.table({"prompt": ["fine parquet prompt", "tab\tand\x0bvertical tab"]}), tmp_path / "b.parquet")
    run, m = _select(tmp_path, tmp_path / "a.json", tmp_path / "b.parquet")
    rej = _rejects(run)
    assert set(rej) == {("a.json", 1), ("a.json", 2), ("b.parquet", 1)}
    assert "lone surrogate" in rej[("a.json", 1)][1] and "U+0000" in rej[("a.json", 2)][1]
    assert "U+000B" in rej[("b.parquet", 1)][1] and m["num_prompts"] == 2


def test_shape_is_voted_so_a_bad_first_row_is_only_a_reject(tmp_path):
    rows = [{"prompt": None}, {"prompt": 7}] + GOOD
    (tmp_path / "p.jsonl").write_bytes(_lines(rows))
    conv = [{"conversations": "oops"}] + [{"conversations": [{"from": "human", "value": t}]}
                                          for t in ("Plan a weekend in Rome.", "Translate 'cat' to French.", "2+2?")]
    (tmp_path / "c.json").write_text(json.dumps(conv))
    run, m = _select(tmp_path, tmp_path / "p.jsonl", tmp_path / "c.json")
    rej = _rejects(run)
    assert set(rej) == {("p.jsonl", 0), ("p.jsonl", 1), ("c.json", 0)}
    assert m["num_prompts"] == len(GOOD) + 3
    assert {a["shape"] for a in m["accounting"]["files"].values()} == {"prompt", "conversations"}


def _bad_files(tmp_path):
    """One bad file of each kind, and what its message must say."""
    d = tmp_path / "bad"
    d.mkdir()
    (d / "notjson.json").write_text("this is not json\nnor this line\n")
    (d / "notjson.jsonl").write_text("this is not json\nnor this line\n")
    (d / "latin1.json").write_bytes(b'[{"prompt": "caf\xe9"}]')
    (d / "deep.json").write_text(DEEP)
    (d / "broken.parquet").write_bytes(b"PAR1 not really parquet")
    (d / "odd.jsonl").write_text(json.dumps({"dialog_text": "hi", "speaker": 1}) + "\n")
    (d / "table.csv").write_text('prompt,other\n"unterminated,1\n')
    (d / "data.xlsx").write_bytes(b"PK\x03\x04")
    return {"notjson.json": "not valid JSON", "notjson.jsonl": "no line is a JSON row",
            "latin1.json": "not valid UTF-8 (byte 0xe9 at line 1", "deep.json": "nested deeper",
            "broken.parquet": "not a readable Parquet file", "odd.jsonl": "unrecognized row shape",
            "table.csv": "not a readable CSV file", "data.xlsx": "unsupported file type '.xlsx'"}


def test_every_bad_file_is_named_in_one_run_then_fail_or_skip(tmp_path):
    want = _bad_files(tmp_path)
    bad = sorted((tmp_path / "bad").iterdir())
    (tmp_path / "good.jsonl").write_bytes(_lines(GOOD))
    sources = [tmp_path / "good.jsonl", *bad]
    with pytest.raises(InputError) as err:
        _select(tmp_path, *sources)
    msg = str(err.value)
    assert f"{len(want)} source file(s) cannot be read" in msg and "--on-bad-file skip" in msg
    for name, why in want.items():
        line = next(ln for ln in msg.splitlines() if ln.strip().startswith(str(tmp_path / "bad" / name)))
        assert why in line, (name, line)
    assert not (tmp_path / "run" / "prompts").exists()  # nothing written
    run, m = _select(tmp_path, *sources, name="skip", on_bad_file="skip")
    assert m["num_prompts"] == len(GOOD) and set(m["bad_files"]) == {str(p) for p in bad}
    assert len(m["warnings"]) == len(want)
    assert list(m["accounting"]["files"]) == [str(tmp_path / "good.jsonl")]


def test_cli_on_bad_file_flag(tmp_path, capsys):
    from regen.cli import main as cli_main

    (tmp_path / "good.jsonl").write_bytes(_lines(GOOD))
    (tmp_path / "x.json").write_text("{nope")
    args = ["select", "--profile", "local", "--run", str(tmp_path / "r"), "--no-progress", "--set", "select.sources=[]",
            "--source", str(tmp_path / "good.jsonl"), "--source", str(tmp_path / "x.json")]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "x.json") in err and "Traceback" not in err
    assert cli_main(args + ["--on-bad-file", "skip"]) == 0
    assert "skipped" in capsys.readouterr().err


def test_csv_with_a_header_is_read(tmp_path):
    (tmp_path / "q.csv").write_text('id,question\n1,"What is 2+2, and why?"\n2,"Name a ""quoted"" word"\n')
    run, m = _select(tmp_path, tmp_path / "q.csv")
    texts = query(run.root, "SELECT messages[1].content FROM prompts ORDER BY source_row")[1]
    assert [t[0] for t in texts] == ["What is 2+2, and why?", 'Name a "quoted" word']


def test_total_below_one_is_refused_at_load():
    for bad in (0, -5):
        with pytest.raises(ValidationError, match="must be >= 1"):
            SelectConfig(total=bad)
    with pytest.raises(ValidationError, match="on_bad_file"):
        SelectConfig(on_bad_file="ignore")


def test_a_failed_rerun_leaves_the_previous_selection_intact(tmp_path):
    (tmp_path / "good.jsonl").write_bytes(_lines(GOOD))
    run, first = _select(tmp_path, tmp_path / "good.jsonl")
    before = {p.name: p.read_bytes() for p in run.prompts.iterdir()}
    rej_before = sorted(p.name for p in run.rejected("select").iterdir())
    (tmp_path / "more.json").write_text("{broken")
    with pytest.raises(InputError):
        _select(tmp_path, tmp_path / "good.jsonl", tmp_path / "more.json")
    assert {p.name: p.read_bytes() for p in run.prompts.iterdir()} == before
    assert sorted(p.name for p in run.rejected("select").iterdir()) == rej_before
    assert query(run.root, "SELECT count(*) FROM prompts")[1][0][0] == len(GOOD)
    # a failure after the reading (a starved quota with on_category_shortfall: fail) keeps it too
    with pytest.raises(InputError, match="starved category"):
        _select(tmp_path, tmp_path / "good.jsonl", total=5, mix={"general": 0.5, "tool_use": 0.5},
                on_category_shortfall="fail")
    assert {p.name: p.read_bytes() for p in run.prompts.iterdir()} == before
    # a complete rerun replaces it
    (tmp_path / "more.json").write_text(json.dumps([{"prompt": "A brand new prompt about rivers."}]))
    _, second = _select(tmp_path, tmp_path / "good.jsonl", tmp_path / "more.json")
    assert second["num_prompts"] == len(GOOD) + 1 and query(run.root, "SELECT count(*) FROM prompts")[1][0][0] == 6
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".")]


def test_a_starved_quota_warns_loudly(tmp_path, capsys):
    (tmp_path / "good.jsonl").write_bytes(_lines(GOOD))
    run, m = _select(tmp_path, tmp_path / "good.jsonl", total=4, mix={"general": 0.5, "tool_use": 0.5})
    assert any("'tool_use' got 0 of its 2 prompts" in w for w in m["warnings"])
    assert "WARNING" in capsys.readouterr().err
    run, m = _select(tmp_path, tmp_path / "good.jsonl", name="off", total=4, mix={"general": 0.5, "tool_use": 0.5},
                     min_category_fill=0.0)
    assert m["warnings"] == []
