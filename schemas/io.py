"""Durable writes: temporary name, fsync, rename, fsync the directory; then the caller records it.

A reader trusts manifests, not directory listings; temporary files start with `.tmp-` and never match a
`part-*`/`shard-*` glob.
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_parquet_atomic(table: pa.Table, path: str | os.PathLike, schema: pa.Schema, compression: str = "zstd") -> dict:
    """Write `table` cast to `schema` at `path` durably. Returns `{"path", "rows", "bytes", "sha256"}`.

    Raises pyarrow.ArrowInvalid when the table does not fit the schema (a bug in the writer, not user input).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = table.cast(schema) if table.schema != schema else table
    tmp = path.with_name(f".tmp-{uuid.uuid4().hex}-{path.name}")
    with open(tmp, "wb") as f:
        pq.write_table(table, f, compression=compression)
        f.flush()
        os.fsync(f.fileno())
    digest = sha256_file(tmp)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return {"path": path.name, "rows": table.num_rows, "bytes": path.stat().st_size, "sha256": digest}


def write_rows_atomic(rows: list[dict], path: str | os.PathLike, schema: pa.Schema) -> dict:
    """`write_parquet_atomic` for a list of dicts matching `schema`."""
    return write_parquet_atomic(pa.Table.from_pylist(rows, schema=schema), path, schema)


def write_json_atomic(obj, path: str | os.PathLike) -> None:
    """Write JSON durably (indent 2, non-ASCII kept)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{uuid.uuid4().hex}-{path.name}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def read_json(path: str | os.PathLike, default=None):
    path = Path(path)
    if not path.exists():
        return default
    with open(path, encoding="utf-8") as f:
        return json.load(f)
