"""Every file of the public prompt sets (the sample in data/pool) through `regen select`: no crash, exact
accounting, mix, queries."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pyarrow.parquet as pq

from regen.cli import main as cli_main
from regen.report.query import query
from regen.select.sources import DATA_SUFFIXES, SKIP_NAMES
from schemas.prompt import CATEGORIES, PROMPT_SCHEMA


def _data_files(root: Path) -> set[str]:
    out = set()
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.lower().endswith(DATA_SUFFIXES) and f not in SKIP_NAMES:
                out.add(str(Path(dirpath) / f))
    return out


def _rows_listed(pool: Path) -> dict[str, int]:
    """Rows kept per file as data/pool/SOURCES.md lists them (written by data/pool/build.py)."""
    text = (pool / "SOURCES.md").read_text(encoding="utf-8")
    return {m[1]: int(m[2]) for m in re.finditer(r"^\| `([^`]+)` \| (\d+) / \d+ \|", text, re.M)}


def test_every_shared_file_is_read_and_accounting_closes(shared_run, pool_dir):
    run, manifest = shared_run
    files = manifest["accounting"]["files"]
    # compared resolved: the manifest names files by the profile's path
    assert {str(Path(f).resolve()) for f in files} == _data_files(pool_dir.resolve())
    for name, a in files.items():
        assert a["input_rows"] == a["selected"] + a["rejected"] + a["not_selected"], name
        assert a["input_rows"] > 0, name
    # independent check of the accounting against the files on disk
    cols, rows = query(run.root, "SELECT source_file, count(*) FROM rejected GROUP BY 1")
    rejected = dict(rows)
    cols, rows = query(run.root, "SELECT source_file, count(*) FROM prompts GROUP BY 1")
    chosen = dict(rows)
    for name, a in files.items():
        assert rejected.get(name, 0) == a["rejected"], name
        assert chosen.get(name, 0) == a["selected"], name
    # row counts from data/pool/SOURCES.md, file by file (116 files, 1,508 rows)
    listed = _rows_listed(pool_dir)
    assert len(listed) == len(files) == 116
    assert {str((pool_dir / k).resolve()): v for k, v in listed.items()} == {
        str(Path(f).resolve()): a["input_rows"] for f, a in files.items()}
    assert manifest["accounting"]["totals"]["input_rows"] == sum(listed.values()) == 1_508


def test_mix_within_one_point_and_schema(shared_run):
    run, manifest = shared_run
    assert manifest["num_prompts"] == manifest["num_requested"] == 250
    for c in CATEGORIES:
        m = manifest["mix"][c]
        assert abs(m["share_selected"] - m["share_requested"]) <= 0.01, (c, m)
    for part in manifest["parts"]:
        t = pq.read_table(run.prompts / part["path"])
        assert t.schema.equals(PROMPT_SCHEMA, check_metadata=False)
        assert t.schema.metadata[b"schema_version"] == b"3"  # v3: length_band, mode
    ids = query(run.root, "SELECT count(DISTINCT prompt_id), count(*) FROM prompts")[1][0]
    assert ids[0] == ids[1] == 250


def test_every_reject_has_filter_and_reason(shared_run):
    run, manifest = shared_run
    rows = query(run.root, "SELECT filter, count(*), min(length(reason)) FROM rejected GROUP BY 1")[1]
    by_filter = {f: (n, shortest) for f, n, shortest in rows}
    assert all(shortest > 10 for _, shortest in by_filter.values())
    for f, n in manifest["filters"].items():
        assert by_filter.get(f, (0, 0))[0] == n, f
    # BFCL tool-definition rows are accounted for, not silently skipped
    assert manifest["filters"]["not_a_prompt"] == 162
    # the two glaive zh rows whose function call was translated into prose are malformed
    parse = query(run.root, "SELECT reason FROM rejected WHERE filter = 'parse'")[1]
    assert parse and all("tool result without a preceding tool call" in r[0] for r in parse)


def test_shapes_and_labels_in_the_selection(shared_run):
    run, _ = shared_run
    rows = dict(query(run.root, "SELECT source, count(*) FROM prompts GROUP BY 1")[1])
    assert {"bfcl", "mt_bench", "mgsm", "gaokao", "bbh"} <= set(rows)  # 250 of 1,508: glaive (tool_use) may miss
    # MGSM: zh -> chinese, other non-English -> multilingual, English stays reasoning
    cats = dict(query(run.root, "SELECT language, any_value(category) FROM prompts WHERE source = 'mgsm' "
                                "AND language IN ('zh', 'en') GROUP BY 1")[1])
    assert cats.get("zh", "chinese") == "chinese" and cats.get("en", "reasoning") == "reasoning"
    langs = {r[0] for r in query(run.root, "SELECT DISTINCT category FROM prompts WHERE language NOT IN ('en','zh') "
                                           "AND category <> 'tool_use'")[1]}
    assert langs <= {"multilingual"}
    # multi-turn MT-Bench rows keep both user turns and no assistant turn
    n = query(run.root, "SELECT min(num_turns), max(len(messages)) FROM prompts WHERE source = 'mt_bench'")[1][0]
    assert n == (2, 2)


def test_query_cli_table_and_json(shared_run, capsys):
    run, _ = shared_run
    assert cli_main(["query", "--run", str(run.root), "--json",
                     "SELECT category, count(*) AS n FROM prompts GROUP BY 1 ORDER BY 1"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["category"] for x in lines] == sorted(CATEGORIES)
    assert sum(x["n"] for x in lines) == 250
    assert cli_main(["query", "--run", str(run.root), "SELECT stage, filter, count(*) FROM rejected GROUP BY 1, 2"]) == 0
    assert "near_dedup" in capsys.readouterr().out
    assert (run.root / "views.sql").exists()
