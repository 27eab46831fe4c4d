"""Token shards on disk: `shards/shard-NNNNN.parquet` (`schemas.shard.SHARD_SCHEMA`) and `shards/manifest.json`.

A shard closes when it reaches `max_rows` rows or `max_tokens` tokens; it is written atomically (temporary
name, fsync, rename; `schemas.io.write_parquet_atomic`) and only then appended to the manifest with its rows,
tokens, supervised tokens, bytes and sha256. The manifest's shard list is append-only while a run is in
progress (`"status": "running"`, `"complete": false`), so a trainer may follow it (`regen.train.feed`); it ends with
`"status": "complete"`. It also states the training contract (tokenizer name + file hash, renderer + version,
mask policy, max length, turn mode, schema version) that a trainer checks before reading a row.

Manifest layout (JSON):
    {"schema": "regen.render.shards", "schema_version": 1, "status", "complete", "contract": {...}, "contract_hash",
     "config_hash", "input": {...}, "shards": [{"path", "rows", "tokens", "loss_tokens", "bytes", "sha256"}],
     "num_rows", "num_tokens", "num_loss_tokens", "checkpoint", "cursor", "counts", "drift", ...}
"""
from __future__ import annotations

import hashlib
import json
from array import array
from pathlib import Path

import numpy as np
import pyarrow as pa

from schemas.io import write_parquet_atomic
from schemas.shard import SCHEMA_VERSION, SHARD_SCHEMA, SPAN_TYPE

MANIFEST_SCHEMA = "regen.render.shards"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.parquet"


def contract_hash(contract: dict) -> str:
    """sha256 (hex, 16 chars) of the canonical JSON of a training contract."""
    return hashlib.sha256(json.dumps(contract, sort_keys=True, default=str).encode()).hexdigest()[:16]


def training_contract(renderer, *, max_tokens: int, turn_mode: str, min_loss_tokens: int, template_kwargs: dict,
                      overlong: str, on_drift: str) -> dict:
    """The contract a trainer needs to trust a shard: which tokenizer, renderer, mask and limits made it."""
    return {
        "tokenizer_name": renderer.tokenizer_name,
        "tokenizer_hash": renderer.tokenizer_hash,
        "renderer": renderer.name,
        "renderer_version": renderer.version,
        "mask_policy": getattr(renderer, "mask_policy", "default"),
        "test_vocabulary": bool(getattr(getattr(renderer, "tokenizer", None), "is_test_vocab", False)),
        "max_tokens": max_tokens,
        "turn_mode": turn_mode,
        "loss_turns": "last",
        "min_loss_tokens": min_loss_tokens,
        "overlong": overlong,
        "on_drift": on_drift,
        "template_kwargs": template_kwargs,
        "schema": "regen.shard",
        "schema_version": SCHEMA_VERSION,
        "loss_encoding": "loss_spans: half-open [start, end) token spans, sorted, non-overlapping",
    }


def _ids_array(ids) -> np.ndarray:
    if isinstance(ids, array):
        return np.frombuffer(ids, dtype=np.int32) if ids.itemsize == 4 else np.asarray(ids, dtype=np.int32)
    return np.asarray(ids, dtype=np.int32)


def rows_to_table(rows: list[dict]) -> pa.Table:
    """Shard rows (dicts with `input_ids`: list[int] or array("i"), `loss_spans`: list[{start, end}]) ->
    SHARD_SCHEMA table. input_ids become one int32 buffer + offsets (no per-element Python conversion for arrays)."""
    parts = [_ids_array(r["input_ids"]) for r in rows]
    lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=pa.int32()))
    columns = {
        "sample_id": pa.array([r["sample_id"] for r in rows], pa.string()),
        "prompt_id": pa.array([r["prompt_id"] for r in rows], pa.string()),
        "turn": pa.array([r["turn"] for r in rows], pa.int32()),
        "category": pa.array([r.get("category") for r in rows], pa.string()),
        "language": pa.array([r.get("language") for r in rows], pa.string()),
        "input_ids": ids,
        "loss_spans": pa.array([r["loss_spans"] for r in rows], pa.list_(SPAN_TYPE)),
        "num_tokens": pa.array(lengths, pa.int32()),
        "num_loss_tokens": pa.array([r["num_loss_tokens"] for r in rows], pa.int32()),
    }
    return pa.table(columns, schema=SHARD_SCHEMA)


class ShardWriter:
    """Buffers shard rows and writes `shard-NNNNN.parquet` files of at most `max_rows` rows / `max_tokens` tokens.

    directory: the run's `shards/`. next_index: the index of the next shard (resume). `add(row)` returns the
    manifest entry of a shard it closed (or None); `flush()` closes the current shard if it has rows; `fits(row)`
    says whether `row` still fits under `max_tokens`.
    Entries: {"path", "rows", "tokens", "loss_tokens", "bytes", "sha256"}.
    """

    def __init__(self, directory: str | Path, *, max_rows: int, max_tokens: int, next_index: int = 0):
        if max_rows < 1 or max_tokens < 1:
            raise ValueError(f"shard size must be positive (max_rows={max_rows}, max_tokens={max_tokens})")
        self.directory = Path(directory)
        self.max_rows, self.max_tokens = max_rows, max_tokens
        self.next_index = next_index
        self.rows: list[dict] = []
        self.num_tokens = 0

    def fits(self, row: dict) -> bool:
        """False when adding `row` would take a non-empty shard past `max_tokens` (flush first)."""
        return not self.rows or self.num_tokens + len(row["input_ids"]) <= self.max_tokens

    def add(self, row: dict) -> dict | None:
        """Buffer `row`; close the shard (returning its entry) once it has `max_rows` rows or `max_tokens` tokens.
        Call `flush()` first when `fits(row)` is False, so no shard passes `max_tokens` (a single longer row
        makes a shard of its own)."""
        self.rows.append(row)
        self.num_tokens += len(row["input_ids"])
        if len(self.rows) >= self.max_rows or self.num_tokens >= self.max_tokens:
            return self.flush()
        return None

    def flush(self) -> dict | None:
        if not self.rows:
            return None
        table = rows_to_table(self.rows)
        name = shard_name(self.next_index)
        info = write_parquet_atomic(table, self.directory / name, SHARD_SCHEMA)
        entry = {"path": name, "rows": info["rows"], "tokens": self.num_tokens,
                 "loss_tokens": int(sum(r["num_loss_tokens"] for r in self.rows)),
                 "bytes": info["bytes"], "sha256": info["sha256"]}
        self.next_index += 1
        self.rows, self.num_tokens = [], 0
        return entry


def manifest_totals(entries: list[dict]) -> dict:
    return {"num_shards": len(entries), "num_rows": sum(e["rows"] for e in entries),
            "num_tokens": sum(e["tokens"] for e in entries), "num_loss_tokens": sum(e["loss_tokens"] for e in entries)}
