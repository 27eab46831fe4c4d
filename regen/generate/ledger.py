"""Exactly-once storage of generation rows: a journal for durability within milliseconds, Parquet parts for reading.

Layout of `runs/<name>/generations/`:

    part-<writer>-<seq>.parquet   GENERATION_SCHEMA rows; written to a .tmp- name, fsynced, renamed (schemas.io)
    ledger-<writer>.jsonl         one line per part, appended + fsynced after its rename: path, rows, bytes, sha256
    journal-<writer>.jsonl        rows acknowledged since the writer's last part (one JSON object per line)

A row is *recorded* once its journal line is fsynced (`Ledger.append` returns only then); its request is never
sent again. Every `part_rows` rows or `part_interval_s` seconds the journal's rows become a part, the part is
listed in the ledger file, and the journal is truncated. `recover()` (run before any writer starts) makes the
directory consistent after a `kill -9` at any point: a renamed part missing from its ledger is listed; journal
lines whose request_key is not in a part become a new part; a torn last line (killed mid-write, never
acknowledged) is dropped, so its request counts as in flight and is sent again.

One writer per process (`writer` is unique among concurrent processes: `w0` locally, `r<i>` per Ray actor).
"""
from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from schemas.generation import GENERATION_SCHEMA
from schemas.io import _fsync_dir, write_parquet_atomic

try:
    import orjson

    _loads = orjson.loads

    def _dumps(obj) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # pragma: no cover
    import json

    _loads = json.loads

    def _dumps(obj) -> bytes:
        return json.dumps(obj, ensure_ascii=False).encode()

PART_RE = re.compile(r"^part-(?P<writer>[A-Za-z0-9_]+)-(?P<seq>\d+)\.parquet$")
INDEX_COLUMNS = ["request_key", "prompt_id", "turn", "status", "stop_reason"]


def _append_line(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_jsonl(path: Path) -> list[dict]:
    """Complete, parseable lines of a JSON-lines file; a torn last line is dropped."""
    out = []
    data = path.read_bytes()
    for line in data.split(b"\n")[:-1] if data.endswith(b"\n") else data.split(b"\n")[:-1]:
        if not line.strip():
            continue
        try:
            out.append(_loads(line))
        except ValueError:
            continue
    return out


def part_paths(directory: Path) -> list[Path]:
    return sorted(p for p in Path(directory).glob("part-*.parquet") if PART_RE.match(p.name))


def listed_parts(directory: Path) -> dict[str, dict]:
    """part name -> its ledger entry, over every writer's ledger file."""
    entries = {}
    for led in sorted(Path(directory).glob("ledger-*.jsonl")):
        for e in _read_jsonl(led):
            entries[e["path"]] = e
    return entries


def _next_seq(directory: Path, writer: str) -> int:
    seqs = [int(m["seq"]) for p in part_paths(directory) if (m := PART_RE.match(p.name)) and m["writer"] == writer]
    return max(seqs, default=-1) + 1


def _write_part(directory: Path, writer: str, table: pa.Table) -> dict:
    name = f"part-{writer}-{_next_seq(directory, writer):05d}.parquet"
    info = write_parquet_atomic(table, directory / name, GENERATION_SCHEMA)
    info["writer"] = writer
    _append_line(directory / f"ledger-{writer}.jsonl", _dumps(info) + b"\n")
    return info


def rows_to_table(rows: list[dict]) -> pa.Table:
    """Row dicts (finished_at as epoch milliseconds) -> a GENERATION_SCHEMA table."""
    return pa.Table.from_pylist(rows, schema=GENERATION_SCHEMA)


def recover(directory: Path) -> dict:
    """Make `directory` consistent after a crash (see module doc). Returns counts of what was repaired.

    Must run while no writer is active.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for tmp in directory.glob(".tmp-*"):
        tmp.unlink(missing_ok=True)
    listed = listed_parts(directory)
    adopted = 0
    for p in part_paths(directory):
        if p.name not in listed:
            meta = pq.read_metadata(p)  # a renamed part was fsynced first, so it is complete
            writer = PART_RE.match(p.name)["writer"]
            from schemas.io import sha256_file

            info = {"path": p.name, "rows": meta.num_rows, "bytes": p.stat().st_size, "sha256": sha256_file(p),
                    "writer": writer}
            _append_line(directory / f"ledger-{writer}.jsonl", _dumps(info) + b"\n")
            adopted += 1
    journals = sorted(directory.glob("journal-*.jsonl"))
    recovered = 0
    if journals:
        keys = set(read_index(directory).column("request_key").to_pylist())
        rows = []
        for j in journals:
            for r in _read_jsonl(j):
                if r.get("request_key") not in keys:
                    keys.add(r["request_key"])
                    rows.append(r)
        if rows:
            _write_part(directory, "recovered", rows_to_table(rows))
            recovered = len(rows)
        for j in journals:
            j.unlink()
        _fsync_dir(directory)
    return {"parts_adopted": adopted, "journal_rows_recovered": recovered}


def read_index(directory: Path, columns: list[str] | None = None) -> pa.Table:
    """The small columns of every recorded row (default INDEX_COLUMNS) as one table (empty when none)."""
    columns = columns or INDEX_COLUMNS
    tables = [pq.read_table(p, columns=columns) for p in part_paths(Path(directory))]
    if not tables:
        return pa.table({c: pa.array([], GENERATION_SCHEMA.field(c).type) for c in columns})
    return pa.concat_tables(tables)


def recorded_keys(directory: Path) -> set[str]:
    """Read-only: request keys recorded so far (parts and acknowledged journal lines), as after `recover`."""
    directory = Path(directory)
    keys = set(read_index(directory, ["request_key"]).column("request_key").to_pylist())
    for j in sorted(directory.glob("journal-*.jsonl")):
        keys.update(r["request_key"] for r in _read_jsonl(j))
    return keys


def load_rows(directory: Path, prompt_ids: set[str]) -> list[dict]:
    """Full rows of the given prompt ids (used to rebuild the history of conversations cut by a crash)."""
    if not prompt_ids:
        return []
    import pyarrow.compute as pc

    wanted = pa.array(sorted(prompt_ids), pa.string())
    out = []
    for p in part_paths(Path(directory)):
        t = pq.read_table(p)
        t = t.filter(pc.is_in(t.column("prompt_id"), value_set=wanted))
        out.extend(t.to_pylist())
    return out


class Ledger:
    """The writer of one process. `await append(rows)` returns once the rows are durable (group commit:
    one write + fsync for every row acknowledged meanwhile). Call `await close()` at the end."""

    def __init__(self, directory: Path, writer: str, part_rows: int = 2000, part_interval_s: float = 300.0):
        if not re.fullmatch(r"[A-Za-z0-9_]+", writer):
            raise ValueError(f"writer id {writer!r} must be alphanumeric")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.writer = writer
        self.journal = self.directory / f"journal-{writer}.jsonl"
        self.part_rows = part_rows
        self.part_interval_s = part_interval_s
        self._pending: list[tuple[list[dict], asyncio.Future]] = []
        self._batches: list[pa.Table] = []  # rows in the journal, already columnar (compact token ids)
        self._num_journal_rows = 0
        self._last_part = time.monotonic()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.parts: list[dict] = []
        self.num_rows = 0

    async def start(self) -> "Ledger":
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._run())
        return self

    async def append(self, rows: list[dict]) -> None:
        """Durably record `rows` (GENERATION_SCHEMA dicts, finished_at in epoch ms). Returns when fsynced."""
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((rows, fut))
        self._wakeup.set()
        await fut

    async def _run(self) -> None:
        while True:
            if not self._pending:
                if self._closing:
                    return
                await self._wakeup.wait()
                self._wakeup.clear()
                continue
            group, self._pending = self._pending, []
            rows = [r for g, _ in group for r in g]
            try:
                data = b"".join(_dumps(r) + b"\n" for r in rows)
                table = rows_to_table(rows)
                await asyncio.to_thread(_append_line, self.journal, data)
                self._batches.append(table)
                self._num_journal_rows += len(rows)
                self.num_rows += len(rows)
                if self._num_journal_rows >= self.part_rows or time.monotonic() - self._last_part >= self.part_interval_s:
                    await asyncio.to_thread(self._roll)
            except BaseException as exc:  # a failed write must not look like success
                for _, fut in group:
                    if not fut.done():
                        fut.set_exception(exc if isinstance(exc, Exception) else RuntimeError("ledger stopped"))
                raise
            for _, fut in group:
                if not fut.done():
                    fut.set_result(None)

    _closing = False

    def _roll(self) -> None:
        """Journal rows -> a part; list it; truncate the journal."""
        if self._batches:
            info = _write_part(self.directory, self.writer, pa.concat_tables(self._batches))
            self.parts.append(info)
        self._batches, self._num_journal_rows = [], 0
        self._last_part = time.monotonic()
        if self.journal.exists():
            with open(self.journal, "r+b") as f:
                f.truncate(0)
                f.flush()
                os.fsync(f.fileno())

    async def close(self) -> None:
        """Flush everything acknowledged into a final part and stop the writer task."""
        if self._task is None:
            return
        self._closing = True
        self._wakeup.set()
        await self._task
        self._task = None
        await asyncio.to_thread(self._roll)
        self.journal.unlink(missing_ok=True)
