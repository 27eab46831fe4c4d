"""regen export: shards and conversations to a local path, file:// and memory://, read back by datasets, Polars,
DuckDB and pyarrow."""
from __future__ import annotations

import json

import duckdb
import fsspec
import polars as pl
import pyarrow.parquet as pq
import pytest
from render_fixtures import generation_row, write_generations

from regen.cli import main as cli_main
from regen.config.render import RenderConfig
from regen.errors import InputError
from regen.render.export import run_export
from regen.render.stage import run_render
from regen.rundir import RunDir

U1 = {"role": "user", "content": "What is the sum of two and three? Explain it briefly."}
A0 = {"role": "assistant", "content": "Two plus three is five.", "reasoning_content": "2+3=5."}
CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> RunDir:
    root = tmp_path_factory.mktemp("export-run")
    rows = [generation_row(f"p{i}", 0, [U1], content=f"The sum is five, answer number {i}.", reasoning_content="2+3=5")
            for i in range(5)]
    rows += [generation_row("m", 1, [U1, A0, {"role": "user", "content": "Use the tool."}], tools=TOOLS,
                            content="", reasoning_content="Calling add.", tool_calls=[CALL])]
    write_generations(root, rows)
    run = RunDir.at(root)
    run_render(RenderConfig(renderer="kimi-k3", template_kwargs={"thinking": True}, shard_max_rows=4), run,
               progress=False)
    return run


def test_export_shards_to_a_local_path_reads_everywhere(rendered, tmp_path):
    out = tmp_path / "export"
    summary = run_export(rendered, str(out))
    m = rendered.manifest(rendered.shards)
    assert [f["sha256"] for f in summary["files"]] == [e["sha256"] for e in m["shards"]]
    exported = json.loads((out / "manifest.json").read_text())
    assert [e["path"] for e in exported["shards"]] == ["data/shard-00000.parquet", "data/shard-00001.parquet"]
    assert exported["contract"] == m["contract"]
    card = (out / "README.md").read_text()
    assert card.startswith("---\nconfigs:") and "path: data/shard-*.parquet" in card and "TEST VOCABULARY" in card

    import datasets

    ds = datasets.load_dataset("parquet", data_files=str(out / "data" / "*.parquet"), split="train",
                               cache_dir=str(tmp_path / "hf-cache"))
    assert ds.num_rows == m["num_rows"] == 6
    assert ds[0]["loss_spans"][0]["end"] > ds[0]["loss_spans"][0]["start"]
    ds2 = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "hf-cache2"))
    assert ds2.num_rows == 6
    df = pl.read_parquet(str(out / "data" / "*.parquet"))
    assert df.height == 6 and df["num_tokens"].sum() == m["num_tokens"]
    n, tokens = duckdb.connect().execute(f"SELECT count(*), sum(len(input_ids)) FROM '{out}/data/*.parquet'").fetchone()
    assert (n, tokens) == (6, m["num_tokens"])


def test_export_to_memory_and_file_uris(rendered, tmp_path):
    run_export(rendered, "memory://regen-export/x")
    fs = fsspec.filesystem("memory")
    table = pq.read_table("regen-export/x/data/shard-00000.parquet", filesystem=fs)
    assert table.num_rows == 4 and "input_ids" in table.column_names
    assert json.loads(fs.cat("regen-export/x/manifest.json"))["num_rows"] == 6
    run_export(rendered, f"file://{tmp_path}/viafile")
    assert (tmp_path / "viafile" / "data" / "shard-00001.parquet").is_file()


def test_export_conversations_jsonl(rendered, tmp_path):
    out = tmp_path / "conv"
    run_export(rendered, str(out), fmt="conversations")
    lines = [json.loads(x) for x in (out / "data" / "conversations-00000.jsonl").read_text().splitlines()]
    assert len(lines) == 6
    tool_row = next(x for x in lines if x["prompt_id"] == "m")
    assert tool_row["messages"][1] == A0 and tool_row["tools"] == TOOLS
    last = tool_row["messages"][-1]
    assert last["role"] == "assistant" and last["reasoning_content"] == "Calling add."
    assert last["tool_calls"][0]["function"] == CALL["function"]
    import datasets

    ds = datasets.load_dataset("json", data_files=str(out / "data" / "*.jsonl"), split="train",
                               cache_dir=str(tmp_path / "hf-cache"))
    assert ds.num_rows == 6


def test_export_cli_and_errors(rendered, tmp_path, capsys):
    assert cli_main(["export", "--run", str(rendered.root), "--to", str(tmp_path / "cli")]) == 0
    assert "exported 2 shards files (6 rows" in capsys.readouterr().out
    with pytest.raises(InputError, match="not complete"):
        run_export(RunDir.at(tmp_path / "empty"), str(tmp_path / "x"))
    # a shard changed after rendering is refused, naming the fix
    bad = tmp_path / "tampered"
    import shutil

    shutil.copytree(rendered.root, bad)
    p = bad / "shards" / "shard-00000.parquet"
    p.write_bytes(p.read_bytes() + b"x")
    with pytest.raises(InputError, match="regen render --force"):
        run_export(RunDir.at(bad), str(tmp_path / "y"))
