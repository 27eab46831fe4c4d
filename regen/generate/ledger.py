"""Exactly-once storage of generation rows: a journal for durability within milliseconds, Parquet parts for reading.

Layout of `runs/<name>/generations/`:

    part-<writer>-<seq>.parquet   GENERATION_SCHEMA rows; written to a .tmp- name, fsynced, renamed (schemas.io)
    ledger-<writer>.jsonl         one line per part, appended + fsynced after its rename: path, rows, bytes, sha256
    journal-<writer>.jsonl        rows acknowledged since the writer's last part (one JSON object per line)
    quarantine/                   rows taken out of the live set: superseded rows (`--retry-errors`, repair) as
                                  `<part>.<reason>.parquet`, damaged parts as `<part>.damaged`; never read as data

A row is *recorded* once its journal line is fsynced (`Ledger.append` returns only then); its request is never
sent again. Every `part_rows` rows or `part_interval_s` seconds the journal's rows become a part, the part is
listed in the ledger file, and the journal is truncated. `recover()` (run before any writer starts) makes the
directory consistent after a `kill -9` at any point: a renamed part missing from its ledger is listed; journal
lines whose request_key is not in a part become a new part; a torn last line (killed mid-write, never
acknowledged) is dropped, so its request counts as in flight and is sent again.

One writer per process (`writer` is unique among concurrent processes: `w0` locally, `r<i>` per Ray actor).

The live set is what the ledger lists, never the directory listing. Two more kinds of ledger line change it,
each one atomic append: `{"path": P, "removed": reason, "quarantine": {...}}` takes part P out, and
`{"path": N, ..., "replaces": P, "reason": ..., "quarantine": {...}}` lists N in P's place (P's rows minus the
superseded ones, which were written to `quarantine/` before the line). Both stay in the ledger: the audit trail.
`replace_rows` (used by `regen generate --recheck`) supersedes rows and lists their replacements in one
crash-safe step (`replace-pending.json` is its commit point; `recover` finishes it).

Integrity. `verify_parts` checks every listed part against its ledger line (exists, size, sha256, Parquet footer
and row count). `recover` refuses damaged parts with an InputError naming each file, unless `repair=True`: then
each damaged part goes to `quarantine/`, its ledger line becomes a `removed` line, and the rows of later turns of
the conversations that lost a turn are superseded too (their request history holds the lost answer), so the run
re-requests exactly the lost units and what depends on them.
"""
from __future__ import annotations

import asyncio
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from regen.errors import InputError
from schemas.generation import GENERATION_SCHEMA
from schemas.io import _fsync_dir, read_json, sha256_file, write_json_atomic, write_parquet_atomic

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


def ledger_lines(directory: Path) -> list[dict]:
    """Every ledger line of every writer, file by file in name order, each file in append order (the audit trail)."""
    return [e for led in sorted(Path(directory).glob("ledger-*.jsonl")) for e in _read_jsonl(led)]


def listed_parts(directory: Path) -> dict[str, dict]:
    """The live parts: part name -> its ledger entry, over every writer's ledger file (see module doc)."""
    entries: dict[str, dict] = {}
    for e in ledger_lines(directory):
        if e.get("removed"):
            entries.pop(e["path"], None)
            continue
        if e.get("replaces"):
            entries.pop(e["replaces"], None)
        entries[e["path"]] = e
    return entries


def _next_seq(directory: Path, writer: str) -> int:
    names = [p.name for p in part_paths(directory)] + [e["path"] for e in ledger_lines(directory)]
    seqs = [int(m["seq"]) for n in names if (m := PART_RE.match(n)) and m["writer"] == writer]
    return max(seqs, default=-1) + 1


def _write_part(directory: Path, writer: str, table: pa.Table, extra: dict | None = None) -> dict:
    name = f"part-{writer}-{_next_seq(directory, writer):05d}.parquet"
    info = write_parquet_atomic(table, directory / name, GENERATION_SCHEMA)
    info["writer"] = writer
    info.update(extra or {})
    _append_line(directory / f"ledger-{writer}.jsonl", _dumps(info) + b"\n")
    return info


# ---------------------------------------------------------------- integrity


@dataclass(frozen=True)
class PartProblem:
    """One listed part that does not match its ledger line. `kind`: missing | size | sha256 | unreadable | rows."""

    path: Path
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.path}: {self.detail}"


def verify_parts(directory: Path, check_sha256: bool = True) -> list[PartProblem]:
    """Check every part the ledger lists (see `listed_parts`) against its ledger line: present, same size,
    same sha256 (`check_sha256`, reads every byte), a Parquet footer with the recorded row count.

    Parts on disk that no ledger line lists are not checked (a crash can leave one; `recover` adopts it).
    Returns [] when every part is sound. Render and query call this before reading generations.
    """
    directory = Path(directory)
    problems = []
    for name, e in sorted(listed_parts(directory).items()):
        p = directory / name
        if not p.exists():
            problems.append(PartProblem(p, "missing", "listed in the ledger but missing (deleted or moved)"))
            continue
        size = p.stat().st_size
        if e.get("bytes") is not None and size != e["bytes"]:
            problems.append(PartProblem(p, "size", f"{size} bytes, the ledger recorded {e['bytes']} (truncated or rewritten)"))
            continue
        if check_sha256 and e.get("sha256") and sha256_file(p) != e["sha256"]:
            problems.append(PartProblem(p, "sha256", "sha256 differs from the ledger (bytes changed after it was written)"))
            continue
        try:
            rows = pq.read_metadata(p).num_rows
        except (pa.ArrowException, OSError) as exc:
            problems.append(PartProblem(p, "unreadable", f"not a readable Parquet file ({exc})"))
            continue
        if e.get("rows") is not None and rows != e["rows"]:
            problems.append(PartProblem(p, "rows", f"{rows} rows, the ledger recorded {e['rows']}"))
    return problems


def problems_message(directory: Path, problems: list[PartProblem], run_root: Path | None = None) -> str:
    """The InputError text for damaged parts: every file, what is wrong, and the repair command."""
    run = f" --run {run_root}" if run_root else ""
    lines = [f"{len(problems)} damaged generations part(s) in {directory}:"] + [f"  {p}" for p in problems]
    lines.append(f"run `regen generate{run} --repair` (with your usual --profile/--endpoint): it moves them to "
                 "generations/quarantine/ and re-requests exactly their rows (and the later turns of the same "
                 "conversations); nothing else is sent again")
    return "\n".join(lines)


def check_parts(directory: Path, run_root: Path | None = None) -> None:
    """Raise InputError naming every damaged part (see `verify_parts`); return when all are sound."""
    problems = verify_parts(directory)
    if problems:
        raise InputError(problems_message(directory, problems, run_root))


def _quarantine_file(directory: Path, path: Path, suffix: str) -> dict:
    """Move `path` into quarantine/ as `<name>.<suffix>` (a new name if taken); returns its audit entry."""
    qdir = directory / "quarantine"
    qdir.mkdir(exist_ok=True)
    target = qdir / f"{path.name}.{suffix}"
    n = 1
    while target.exists():
        target, n = qdir / f"{path.name}.{suffix}.{n}", n + 1
    os.replace(path, target)
    _fsync_dir(qdir)
    _fsync_dir(directory)
    return {"path": f"quarantine/{target.name}", "bytes": target.stat().st_size}


def supersede(directory: Path, keys: set[str], reason: str) -> dict:
    """Take the rows whose request_key is in `keys` out of the live parts into `quarantine/` (crash-safe, see
    module doc): per affected part P, (1) its superseded rows -> `quarantine/<P>.<reason>.parquet`, (2) the rest ->
    a new part N, (3) one ledger line (`replaces: P`, or `removed` when nothing is left), (4) P deleted.
    Returns {"rows": rows taken out, "parts": parts rewritten}. Must run while no writer is active."""
    import pyarrow.compute as pc

    directory = Path(directory)
    if not keys:
        return {"rows": 0, "parts": 0}
    wanted = pa.array(sorted(keys), pa.string())
    num_rows = num_parts = 0
    for name, entry in sorted(listed_parts(directory).items()):
        p = directory / name
        table = _read_part(p)
        hit = pc.is_in(table.column("request_key"), value_set=wanted)
        n = pc.sum(hit).as_py() or 0
        if not n:
            continue
        writer = PART_RE.match(name)["writer"]
        q = write_parquet_atomic(table.filter(hit), directory / "quarantine" / f"{p.stem}.{reason}.parquet",
                                 GENERATION_SCHEMA)
        q["path"] = f"quarantine/{q['path']}"
        kept = table.filter(pc.invert(hit))
        audit = {"reason": reason, "quarantine": q, "at": round(time.time(), 3)}
        if kept.num_rows:
            _write_part(directory, writer, kept, {"replaces": name, **audit})
        else:
            _append_line(directory / f"ledger-{writer}.jsonl", _dumps({"path": name, "removed": reason, **audit}) + b"\n")
        p.unlink()
        _fsync_dir(directory)
        num_rows += n
        num_parts += 1
    return {"rows": num_rows, "parts": num_parts}


REPLACE_PENDING = "replace-pending.json"  # the commit point of a `replace_rows` (rows in replace-pending.parquet)


def replace_rows(directory: Path, remove: set[str], rows: list[dict], reason: str) -> dict:
    """Take the live rows whose request_key is in `remove` out into `quarantine/` (`supersede`) and list `rows` (new
    GENERATION_SCHEMA dicts) in their place, as one operation a crash cannot leave half done: the new rows and the
    keys go to `replace-pending.parquet` / `.json` first (the JSON is the commit point), and `recover` finishes a
    pending replace (`_finish_replace`). Returns {"rows": rows taken out, "parts": parts rewritten, "written": n}.
    Must run while no writer is active."""
    directory = Path(directory)
    write_parquet_atomic(rows_to_table(rows), directory / "replace-pending.parquet", GENERATION_SCHEMA)
    token = f"{reason}-{time.time_ns()}"
    write_json_atomic({"reason": reason, "remove": sorted(remove), "id": token}, directory / REPLACE_PENDING)
    return _finish_replace(directory)


def _finish_replace(directory: Path) -> dict:
    """Finish the pending replace of `directory` (idempotent): supersede, write the part (its ledger line carries
    the replace id, so a rerun after the line sees it done), remove the pending files."""
    pending = read_json(directory / REPLACE_PENDING)
    out = {"rows": 0, "parts": 0, "written": 0}
    if pending is not None:
        done = any(e.get("replace_id") == pending["id"] for e in ledger_lines(directory))
        if not done:
            out.update(supersede(directory, set(pending["remove"]), pending["reason"]))
            table = pq.read_table(directory / "replace-pending.parquet")
            if table.num_rows:
                _write_part(directory, pending["reason"], table, {"replace_id": pending["id"]})
            out["written"] = table.num_rows
    for name in (REPLACE_PENDING, "replace-pending.parquet"):
        (directory / name).unlink(missing_ok=True)
    _fsync_dir(directory)
    return out


def _dependent_keys(index: pa.Table) -> set[str]:
    """Request keys of rows that follow a missing turn of the same prompt (their history holds the lost answer)."""
    d = index.select(["request_key", "prompt_id", "turn"]).to_pydict()
    turns: dict[str, set[int]] = {}
    for pid, t in zip(d["prompt_id"], d["turn"]):
        turns.setdefault(pid, set()).add(t)
    gap = {pid: min(set(range(len(ts) + 1)) - ts) for pid, ts in turns.items()}
    return {k for k, pid, t in zip(d["request_key"], d["prompt_id"], d["turn"]) if t > gap[pid]}


def _repair(directory: Path, problems: list[PartProblem]) -> dict:
    """Quarantine the damaged parts (removed lines), then supersede the rows that depended on their rows."""
    listed = listed_parts(directory)
    for prob in problems:
        writer = PART_RE.match(prob.path.name)["writer"]
        entry = {"path": prob.path.name, "removed": f"damaged: {prob.kind}", "detail": prob.detail,
                 "at": round(time.time(), 3)}
        if prob.path.exists():
            entry["quarantine"] = _quarantine_file(directory, prob.path, "damaged")
        _append_line(directory / f"ledger-{writer}.jsonl", _dumps(entry) + b"\n")
    dependent = supersede(directory, _dependent_keys(read_index(directory)), "after_lost_turn")
    return {"parts_quarantined": [p.path.name for p in problems],
            "rows_lost": sum(listed[p.path.name].get("rows") or 0 for p in problems),
            "dependent_rows_superseded": dependent["rows"]}


def rows_to_table(rows: list[dict]) -> pa.Table:
    """Row dicts (finished_at as epoch milliseconds) -> a GENERATION_SCHEMA table."""
    return pa.Table.from_pylist(rows, schema=GENERATION_SCHEMA)


def recover(directory: Path, repair: bool = False) -> dict:
    """Make `directory` consistent after a crash (see module doc). Returns counts of what was repaired.

    Finishes an interrupted `supersede` (a replaced part still on disk is deleted; a new part whose rows are
    all still live elsewhere is dropped), adopts renamed-but-unlisted parts, then verifies every listed part:
    damaged parts raise InputError naming each file, or with `repair=True` are quarantined (see `_repair`).
    Finally acknowledged journal rows not in a part become a part. Must run while no writer is active.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for tmp in list(directory.glob(".tmp-*")) + list(directory.glob("quarantine/.tmp-*")):
        tmp.unlink(missing_ok=True)
    lines = ledger_lines(directory)
    listed = listed_parts(directory)
    gone = {e["replaces"] for e in lines if e.get("replaces")} | {e["path"] for e in lines if e.get("removed")}
    live_q = {(e.get("quarantine") or {}).get("path") for e in lines}
    for q in directory.glob("quarantine/*.parquet"):  # written by a supersede that stopped before its ledger line
        if f"quarantine/{q.name}" not in live_q:
            q.unlink()
    adopted = 0
    listed_keys: set[str] | None = None
    for p in part_paths(directory):
        if p.name in listed:
            continue
        if p.name in gone:  # replaced or removed; the ledger line was written, only the deletion was cut
            _quarantine_file(directory, p, "stale")
            continue
        try:
            meta = pq.read_metadata(p)  # a renamed part was fsynced first, so it is complete
            keys = set(pq.read_table(p, columns=["request_key"]).column("request_key").to_pylist())
        except (pa.ArrowException, OSError):
            _quarantine_file(directory, p, "unlisted_damaged")  # never listed: its rows are still in a journal
            continue
        if listed_keys is None:
            listed_keys = set(_live_index(directory, listed, ["request_key"]).column("request_key").to_pylist())
        if keys & listed_keys:  # the new part of a supersede cut before its ledger line: its rows are live in P
            _quarantine_file(directory, p, "duplicate")
            continue
        writer = PART_RE.match(p.name)["writer"]
        info = {"path": p.name, "rows": meta.num_rows, "bytes": p.stat().st_size, "sha256": sha256_file(p),
                "writer": writer}
        _append_line(directory / f"ledger-{writer}.jsonl", _dumps(info) + b"\n")
        adopted += 1
    report = {"parts_adopted": adopted, "journal_rows_recovered": 0}
    if (directory / REPLACE_PENDING).exists():  # a replace_rows cut by a crash: finish it
        report["replace_finished"] = _finish_replace(directory)
    elif (directory / "replace-pending.parquet").exists():  # cut before its commit point: never happened
        (directory / "replace-pending.parquet").unlink()
    problems = verify_parts(directory)
    if problems and not repair:
        raise InputError(problems_message(directory, problems, directory.parent))
    if problems:
        report["repair"] = _repair(directory, problems)
    journals = sorted(directory.glob("journal-*.jsonl"))
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
            report["journal_rows_recovered"] = len(rows)
        for j in journals:
            j.unlink()
        _fsync_dir(directory)
    return report


def read_part(path: Path, columns: list[str] | None = None) -> pa.Table:
    """One listed part as a table; InputError naming it when it is missing or unreadable."""
    return _read_part(path, columns)


def _read_part(path: Path, columns: list[str] | None = None) -> pa.Table:
    try:
        return pq.read_table(path, columns=columns)
    except FileNotFoundError:
        raise InputError(f"{path}: listed in the generations ledger but missing; run `regen generate --repair`") from None
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{path}: not a readable Parquet file ({exc}); run `regen generate --repair`") from None


def _live_index(directory: Path, listed: dict, columns: list[str]) -> pa.Table:
    tables = [_read_part(Path(directory) / name, columns) for name in sorted(listed)]
    if not tables:
        return pa.table({c: pa.array([], GENERATION_SCHEMA.field(c).type) for c in columns})
    return pa.concat_tables(tables)


def read_index(directory: Path, columns: list[str] | None = None) -> pa.Table:
    """The small columns of every live row (default INDEX_COLUMNS) as one table (empty when none).

    Reads the parts the ledger lists (`listed_parts`); raises InputError naming a listed part that is missing
    or unreadable.
    """
    return _live_index(Path(directory), listed_parts(directory), columns or INDEX_COLUMNS)


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
    for name in sorted(listed_parts(directory)):
        t = _read_part(Path(directory) / name)
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
