"""The run directory: everything one run produces, one folder per stage, each with its manifest.

    runs/<name>/
      prompts/      part-*.parquet + manifest.json      (regen select)
      generations/  part-*.parquet + manifest.json      (regen generate)
      shards/       shard-*.parquet + manifest.json     (regen render)
      rejected/<stage>/part-*.parquet                   (every stage's drops, with filter and reason)
      train/ eval.json report.html views.sql
      originals/ shards-original/ rejected/render-original/ train-original/ eval-original.json
                    the same stages on the source's own answers (`regen render --responses original`)

A RunDir is a view of one response set: `RunDir.at(path)` is the regenerated one; `run.with_responses("original")`
gives the same run whose `generations`, `shards`, `rejected("render")`, `train` and `eval_json` are the original
set's (`originals/` holds generation rows made from the prompts' `original_answers`), so the render, train and
eval stages run unchanged on either set.

Leases (`Lease`, below): one writer per stage directory, across processes and hosts sharing a filesystem: a lease file.

    <dir>/.lease-<name>.json   {"stage", "host", "pid", "since", "renewed", "expires", "ttl_s", "token"}

`flock` gives no exclusion across the nodes of a shared filesystem (the cluster docs put run directories on one),
so a stage takes a lease instead: the file is created with O_CREAT | O_EXCL (atomic on local filesystems, NFSv3+,
Lustre, GPFS), renewed by a daemon thread every `ttl_s / 3` seconds while the stage runs, and removed when it
ends. A second writer finds it and exits at once naming the holder (`LeaseHeld`). A lease is stale when its
expiry has passed (the holder stopped renewing: killed, host lost) or when its holder is a process of this host
that no longer exists; a stale lease is taken over with a warning naming the old holder. A directory whose
filesystem does not honour O_EXCL is refused (`LeaseError`), never silently shared.

Stages and their leases (`<run>` the run directory): `regen select` `<run>/.lease-select.json` (and it refuses
while a `regen generate` lease is live), `regen generate` `<run>/.lease-generate-<generations dir>.json` (besides
its flock; it refuses while `regen select` holds its lease), `regen render` `<run>/.lease-render-<shards dir>.json`,
`regen train` `<training dir>/.lease-train.json` (rank 0 holds it for the job).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from regen.errors import InputError
from schemas.io import read_json, write_json_atomic

RESPONSES = ("regenerated", "original")


@dataclass(frozen=True)
class RunDir:
    root: Path
    responses: str = "regenerated"  # one of RESPONSES: which answers the render/train/eval paths hold

    @classmethod
    def at(cls, path: str | Path, responses: str = "regenerated") -> "RunDir":
        root = Path(path).resolve()
        root.mkdir(parents=True, exist_ok=True)
        return cls(root).with_responses(responses)

    def with_responses(self, responses: str) -> "RunDir":
        """This run viewed on one response set. Raises ValueError for a name outside RESPONSES."""
        if responses not in RESPONSES:
            raise ValueError(f"responses {responses!r}: choose one of {list(RESPONSES)}")
        return RunDir(self.root, responses)

    @property
    def _suffix(self) -> str:
        return "" if self.responses == "regenerated" else "-original"

    @property
    def prompts(self) -> Path:
        return self.root / "prompts"

    @property
    def generations(self) -> Path:
        """The answers to render: `generations/`, or `originals/` for the original set."""
        return self.root / ("generations" if self.responses == "regenerated" else "originals")

    @property
    def shards(self) -> Path:
        return self.root / f"shards{self._suffix}"

    @property
    def train(self) -> Path:
        return self.root / f"train{self._suffix}"

    @property
    def eval_json(self) -> Path:
        return self.root / f"eval{self._suffix}.json"

    def rejected(self, stage: str) -> Path:
        return self.root / "rejected" / (f"{stage}{self._suffix}" if stage == "render" else stage)

    def manifest(self, stage_dir: Path) -> dict | None:
        return read_json(stage_dir / "manifest.json")

    def write_manifest(self, stage_dir: Path, manifest: dict) -> None:
        write_json_atomic(manifest, stage_dir / "manifest.json")


# -- leases: one writer per stage directory --------------------------------------------------------------------

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 60.0


class LeaseError(InputError):
    """A stage directory whose filesystem cannot hold a lease (exclusive creation not honoured)."""


class LeaseHeld(LeaseError):
    """Another process (host, pid, since when) holds the stage directory's lease: one writer at a time."""


def lease_path(directory: Path, name: str) -> Path:
    return Path(directory) / f".lease-{name}.json"


def read_lease(directory: Path, name: str) -> dict | None:
    """The lease record `name` in `directory`, or None when there is none (or it is being written)."""
    try:
        return json.loads(lease_path(directory, name).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_reason(record: dict, now: float | None = None) -> str | None:
    """Why a lease record no longer holds (expired, or its holder on this host is gone), or None when it holds."""
    now = time.time() if now is None else now
    if record.get("expires", 0) < now:
        return f"expired at {_iso(record.get('expires', 0))}"
    if record.get("host") == socket.gethostname() and not _pid_alive(int(record.get("pid", 0))):
        return f"its process {record.get('pid')} on this host is gone"
    return None


def describe_holder(record: dict) -> str:
    return (f"`regen {record.get('stage')}` on host {record.get('host')} pid {record.get('pid')} since "
            f"{_iso(record.get('since', 0))} (renewed {_iso(record.get('renewed', 0))}, expires "
            f"{_iso(record.get('expires', 0))} unless renewed)")


def check_not_held(directory: Path, pattern: str, by: str) -> None:
    """LeaseHeld when a live lease whose name matches `pattern` (a glob, e.g. `generate*`) is in `directory` (for
    a stage `by` that must not run beside its holder)."""
    for path in sorted(Path(directory).glob(f".lease-{pattern}.json")):
        record = read_lease(directory, path.name.removeprefix(".lease-").removesuffix(".json"))
        if record is not None and stale_reason(record) is None:
            raise LeaseHeld(f"{path}: {describe_holder(record)} is working on {directory}; `regen {by}` would "
                            "change what it reads: wait for it to end, or stop it first")


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def check_exclusive_create(directory: Path) -> None:
    """LeaseError when creating one file twice with O_EXCL succeeds in `directory` (a filesystem without
    working exclusive creation: no lease, and no lock, can be trusted there)."""
    probe = Path(directory) / f".lease-probe-{uuid.uuid4().hex}"
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    os.close(fd)
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return
    else:
        os.close(fd)
        raise LeaseError(f"{directory}: this filesystem does not honour exclusive file creation (O_EXCL), so two "
                         "writers of one run could not be kept apart; put the run directory on a filesystem that "
                         "does (local disk, NFSv3+, Lustre, GPFS)")
    finally:
        probe.unlink(missing_ok=True)


class Lease:
    """The lease of `stage` on `directory` (file `.lease-<name or stage>.json`, module docstring); a context manager.
    `acquire` raises LeaseHeld naming the holder (or the holder of a live lease matching the glob `exclude` in the same
    directory), or LeaseError for a filesystem without exclusive creation. `took_over`: the stale record
    replaced, if any. `lost`: True once a renewal found another holder's token (the lease was taken over)."""

    def __init__(self, directory: str | Path, stage: str, *, name: str | None = None, ttl_s: float = DEFAULT_TTL_S,
                 exclude: str | None = None):
        self.directory, self.stage, self.ttl_s, self.exclude = Path(directory), stage, float(ttl_s), exclude
        self.name = name or stage
        self.path = lease_path(self.directory, self.name)
        self.token = uuid.uuid4().hex
        self.since = time.time()
        self.took_over: dict | None = None
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> dict:
        now = time.time()
        return {"stage": self.stage, "host": socket.gethostname(), "pid": os.getpid(), "since": self.since,
                "renewed": now, "expires": now + self.ttl_s, "ttl_s": self.ttl_s, "token": self.token}

    def _write_new(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self._record(), f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _replace(self) -> None:
        tmp = self.path.with_name(f".tmp-{uuid.uuid4().hex}-{self.path.name}")
        with open(tmp, "w") as f:
            json.dump(self._record(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def acquire(self) -> "Lease":
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.exclude:  # a stage that must not run beside this one (a glob of lease names)
            check_not_held(self.directory, self.exclude, by=self.stage)
        check_exclusive_create(self.directory)
        if not self._write_new():
            record = read_lease(self.directory, self.name)
            if record is None:  # being written this instant by another writer, or emptied: treat as held
                raise LeaseHeld(f"{self.path}: another `regen {self.stage}` is taking this directory's lease right "
                                "now; wait for it to end, or remove the file if no such process exists")
            why = stale_reason(record)
            if why is None:
                raise LeaseHeld(f"{self.path}: {describe_holder(record)} is already writing {self.directory}: wait "
                                f"for it to end or stop it; a holder that died is taken over once its lease expires "
                                f"({record.get('ttl_s', DEFAULT_TTL_S):g} s after its last renewal)")
            self._replace()
            back = read_lease(self.directory, self.name) or {}
            if back.get("token") != self.token:  # another writer took it over in the same instant
                raise LeaseHeld(f"{self.path}: {describe_holder(back)} took over the stale lease first")
            self.took_over = {**record, "why": why}
            log.warning("%s: took over the stale lease of %s: %s", self.path, describe_holder(record), why)
        self._thread = threading.Thread(target=self._renew, name=f"lease-{self.stage}", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            record = read_lease(self.directory, self.name)
            if record is not None and record.get("token") != self.token:
                self.lost = True
                log.error("%s: the lease was taken over by %s; this `regen %s` is no longer the only writer",
                          self.path, describe_holder(record), self.stage)
                return
            try:
                self._replace()
            except OSError as exc:
                log.error("%s: could not renew the lease: %s", self.path, exc)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        record = read_lease(self.directory, self.name)
        if record is not None and record.get("token") == self.token:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "Lease":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
