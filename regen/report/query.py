"""`regen query`: DuckDB SQL over the views of a run directory.

Views (every one always exists: with no files it is empty, with the same columns):
  prompts      prompts/part-*.parquet        prompt_id, category, language, source, num_turns, ...
  rejected     rejected/*/part-*.parquet     stage, filter, reason, source, prompt_id, ...
  generations  generations/ parts listed in its ledger (sha256-checked; `regen.generate.ledger.check_parts`):
               prompt_id, turn, status, error_class, finish_reason, tokens, latency_s (no token ids)
  superseded   generations/quarantine/*.parquet: rows taken out by `--retry-errors` or `--repair` (audit)
  samples      shards/shard-*.parquet        responses, sample_id, prompt_id, category, num_tokens, num_loss_tokens
               + shards-original/...         (no ids); `responses`: 'regenerated' (shards/) or 'original'
                                             (shards-original/, `regen render --responses original`)
  shards       shards/manifest.json          one row per shard: responses, path, rows, tokens, loss_tokens, bytes,
               + shards-original/...         sha256

A damaged generations part (missing, truncated, bytes changed) raises InputError naming the file.

The same statements are written to `<run>/views.sql`, so `duckdb -c ".read runs/x/views.sql"` gives the
same views in the DuckDB shell.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import duckdb
import pyarrow as pa

from regen.errors import InputError
from regen.generate import ledger
from schemas.generation import GENERATION_SCHEMA
from schemas.prompt import PROMPT_SCHEMA
from schemas.rejected import REJECTED_SCHEMA
from schemas.shard import SHARD_SCHEMA

_GEN_SELECT = "SELECT * EXCLUDE (prompt_token_ids, completion_token_ids) FROM read_parquet({files}, union_by_name=true)"
# view -> (glob relative to the run, SELECT over read_parquet(...) or read_json(...)); a literal registry.
VIEWS: dict[str, tuple[str, str]] = {
    "prompts": ("prompts/part-*.parquet", "SELECT * FROM read_parquet({files}, union_by_name=true)"),
    "rejected": ("rejected/*/part-*.parquet", "SELECT * FROM read_parquet({files}, union_by_name=true)"),
    "generations": ("generations/part-*.parquet", _GEN_SELECT),
    "superseded": ("generations/quarantine/*.parquet", _GEN_SELECT),
    # one SELECT per response set ({shards}: its shard folder), joined with UNION ALL BY NAME
    "samples": (
        "{shards}/shard-*.parquet",
        "SELECT '{responses}' AS responses, * EXCLUDE (input_ids, loss_spans) FROM read_parquet({files}, "
        "union_by_name=true)",
    ),
    "shards": (
        "{shards}/manifest.json",
        "SELECT '{responses}' AS responses, unnest(shards, recursive := true) FROM read_json({files}, "
        "maximum_object_size=1000000000)",
    ),
}
# response set -> its shard folder (regen.rundir.RunDir.with_responses)
SHARD_SETS = {"regenerated": "shards", "original": "shards-original"}
SHARD_ENTRY_SCHEMA = pa.schema([("path", pa.string()), ("rows", pa.int64()), ("tokens", pa.int64()),
                                ("loss_tokens", pa.int64()), ("bytes", pa.int64()), ("sha256", pa.string())])
# view -> the columns it has when it has no files (the Arrow schema its files are written with, minus EXCLUDEs)
EMPTY: dict[str, pa.Schema] = {
    "prompts": PROMPT_SCHEMA, "rejected": REJECTED_SCHEMA,
    "generations": GENERATION_SCHEMA, "superseded": GENERATION_SCHEMA,
    "samples": SHARD_SCHEMA.insert(0, pa.field("responses", pa.string())),
    "shards": SHARD_ENTRY_SCHEMA.insert(0, pa.field("responses", pa.string())),
}
_EXCLUDED = {"prompt_token_ids", "completion_token_ids", "input_ids", "loss_spans"}


def _empty_select(schema: pa.Schema) -> str:
    """A SELECT of no rows with the columns (names and DuckDB types) of `schema`, minus the excluded id columns."""
    rel = duckdb.connect().from_arrow(schema.empty_table())
    cols = [f'CAST(NULL AS {t}) AS "{c}"' for c, t in zip(rel.columns, rel.types) if c not in _EXCLUDED]
    return f"SELECT {', '.join(cols)} WHERE false"


def _files(run_root: Path, name: str, pattern: str) -> list[str]:
    gen_dir = run_root / "generations"
    if name == "generations" and any(gen_dir.glob("ledger-*.jsonl")):
        ledger.check_parts(gen_dir, run_root)  # the ledger, not the directory listing, says what is live
        return [str(gen_dir / p) for p in sorted(ledger.listed_parts(gen_dir))]
    return sorted(str(p) for p in run_root.glob(pattern))


def view_statements(run_root: Path) -> list[str]:
    """CREATE VIEW statements for every view of `run_root` (absolute paths; an empty view where no file exists).

    Raises InputError naming every damaged generations part.
    """
    statements = []
    for name, (pattern, select) in VIEWS.items():
        sets = SHARD_SETS.items() if "{shards}" in pattern else [(None, None)]
        bodies = []
        for responses, folder in sets:
            files = _files(run_root, name, pattern.format(shards=folder) if folder else pattern)
            if files:
                literal = "[" + ", ".join("'" + f.replace("'", "''") + "'" for f in files) + "]"
                bodies.append(select.format(files=literal, responses=responses))
        body = " UNION ALL BY NAME ".join(bodies) if bodies else _empty_select(EMPTY[name])
        statements.append(f"CREATE OR REPLACE VIEW {name} AS {body};")
    return statements


def connect(run_root: str | Path) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the run's views; also (re)writes `<run>/views.sql`.

    Raises InputError when the run directory does not exist.
    """
    root = Path(run_root).resolve()
    if not root.is_dir():
        raise InputError(f"run directory {root} does not exist: run `regen select --run {run_root}` first")
    con = duckdb.connect()
    statements = view_statements(root)
    for st in statements:
        con.execute(st)
    (root / "views.sql").write_text("\n".join(statements) + "\n", encoding="utf-8")
    return con


def query(run_root: str | Path, sql: str) -> tuple[list[str], list[tuple]]:
    """Run `sql` over the run's views. Returns (column names, rows). Raises InputError on bad SQL."""
    con = connect(run_root)
    try:
        cur = con.execute(sql)
    except duckdb.Error as exc:
        known = [r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()]
        raise InputError(f"query failed: {exc}\n  views in this run: {known}") from None
    columns = [d[0] for d in cur.description] if cur.description else []
    return columns, cur.fetchall()


def print_table(columns: list[str], rows: list[tuple], title: str | None = None, width: int | None = None) -> None:
    """Rows as a rich table on stdout, at most `width` columns wide (the terminal's when None)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*["" if v is None else str(v) for v in r])
    Console(width=width).print(table)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, help="run directory")
    parser.add_argument("--json", action="store_true", help="print one JSON object per row")
    parser.add_argument("sql", help='SQL over the views, e.g. "SELECT category, count(*) FROM prompts GROUP BY 1"')


def main(args) -> int:
    columns, rows = query(args.run, args.sql)
    if args.json:
        for r in rows:
            sys.stdout.write(json.dumps(dict(zip(columns, r)), ensure_ascii=False, default=str) + "\n")
    else:
        print_table(columns, rows)
    return 0
