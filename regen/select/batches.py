"""The per-batch work of `regen select`, run in the main process or in `workers` forked processes.

A batch of raw rows -> normalized drafts (`regen.select.sources.make_drafts`) -> the stateless row filters in config
order (everything but `exact_dedup` and `near_dedup`, which need the whole stream and run in the main process
afterwards) -> survivors as an Arrow table (PROMPT_SCHEMA), their normalized conversation text and MinHash
signatures. Results come back in submission order, so the output does not depend on `workers`; at most
`2 * workers` batches are in flight (bounded memory). Workers start from a forkserver, never from a fork of the
calling process: a process with threads (an HTTP server, Ray, torch's OpenMP pool, Arrow's thread pools) can be
forked while one of them holds a lock, and the child then waits on it forever (a data-loop round under CI
hung so). Each worker runs `configure` once with the same config, contamination index and control tokens; a
worker that dies (out of memory, killed) fails the stage with `SelectWorkerDied` instead of leaving it waiting.
"""
from __future__ import annotations

import json
import multiprocessing as mp
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from filters.control_tokens import ControlTokensFilter
from filters.dedup import MinHasher
from filters.prompt import PROMPT_FILTERS, ContaminationIndex, conversation_text, prompt_tokens
from regen.errors import InputError
from schemas.prompt import PROMPT_SCHEMA, PromptRecord
from schemas.rejected import RejectedRecord

STAGE = "select"
STATEFUL = ("exact_dedup", "near_dedup")
# The `filter` of every reject `regen select` writes: a row that is not a well-formed prompt (`parse`: it does not
# decode, parse or match its shape; `not_a_prompt`: a tool-definition row), then the prompt filters in config order
# and `control_tokens` (docs/errors.md gives each one's remedy; tests/docs/test_docs.py checks it).
ROW_FILTERS = ("parse", "not_a_prompt")
REJECT_FILTERS = (*ROW_FILTERS, *PROMPT_FILTERS, ControlTokensFilter.name)
_STATE: dict = {}


@dataclass
class BatchResult:
    """One processed batch: rejects (REJECTED_SCHEMA row dicts), survivors and their dedup inputs."""

    source_file: str
    num_rows: int
    rejects: list[dict] = field(default_factory=list)
    drops: Counter = field(default_factory=Counter)
    table: pa.Table | None = None
    norms: list[str] = field(default_factory=list)
    sigs: np.ndarray | None = None


def configure(cfg, index: ContaminationIndex | None, control_tokens=()) -> None:
    """Build the stateless filters and the MinHasher for this process (and the workers forked after it).

    `control_tokens`: the strings the renderer would parse as control tokens in prompt text
    (`regen.render.stage.prompt_control_tokens`); when any, the filter `control_tokens` runs after the configured
    ones (such a prompt is rejected before any request is sent for it)."""
    filters = []
    for name in cfg.filters:
        if name in STATEFUL:
            continue
        cls = PROMPT_FILTERS[name]
        filters.append(cls.from_config(cfg, index) if name == "contamination" else cls.from_config(cfg))
    if control_tokens:
        filters.append(ControlTokensFilter(control_tokens))
    _STATE.update(cfg=cfg, filters=filters, near="near_dedup" in cfg.filters,
                  hasher=MinHasher(cfg.num_perm, cfg.shingle_chars, cfg.minhash_max_chars))


def payload(obj) -> str:
    """The raw row or record as JSON for the rejected table, truncated to 4 KiB."""
    try:
        text = json.dumps(obj, ensure_ascii=False, default=str)[:4096]
    except (TypeError, ValueError, RecursionError):
        text = repr(obj)[:4096] if not isinstance(obj, (dict, list)) else "(payload not serializable)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")  # lone surrogates -> \\udXXX text


def reject_row(d, filt: str, reason: str, score, body: str) -> dict:
    assert filt in REJECT_FILTERS, f"select reject filter {filt!r} is not in REJECT_FILTERS"
    return RejectedRecord(stage=STAGE, filter=filt, reason=reason, score=score, source=d.source,
                          source_file=d.source_file, source_row=d.source_row, prompt_id=d.prompt_id,
                          category=d.category, payload=body).to_arrow_row()


def process_batch(job) -> BatchResult:
    """`job` = (SourceConfig, source_file, start_row, rows, shape, field map) -> BatchResult."""
    from regen.select.sources import make_drafts

    src, sfile, start, rows, shape, fmap = job
    cfg = _STATE["cfg"]
    out = BatchResult(sfile, len(rows))
    survivors = []
    for d in make_drafts(src, cfg, sfile, start, rows, shape, fmap, {}):
        if d.error:
            out.rejects.append(reject_row(d, d.filter, d.error, None, payload(d.raw)))
            out.drops[d.filter] += 1
            continue
        d.num_prompt_tokens = prompt_tokens(d)
        for f in _STATE["filters"]:
            dec = f(d)
            if not dec.keep:
                out.rejects.append(reject_row(d, f.name, dec.reason, dec.score,
                                              payload({"messages": d.messages, "tools": d.tools})))
                out.drops[f.name] += 1
                break
        else:
            survivors.append(d)
    if survivors:
        out.table = pa.Table.from_pylist([
            PromptRecord(
                prompt_id=d.prompt_id, messages=d.messages, tools=d.tools, category=d.category, language=d.language,
                source=d.source, source_file=d.source_file, source_row=d.source_row,
                num_turns=sum(1 for m in d.messages if m["role"] == "user"), num_prompt_tokens=d.num_prompt_tokens,
                tools_inferred=d.tools_inferred, original_answers=d.original_answers,
            ).to_arrow_row()
            for d in survivors
        ], schema=PROMPT_SCHEMA)
        out.norms = [conversation_text(d) for d in survivors]
        if _STATE["near"]:
            out.sigs = _STATE["hasher"].signatures(out.norms, normalized=True)
    return out


class SelectWorkerDied(InputError):
    """A `select.workers` process ended without answering (killed by the OS, out of memory, a crash in a library).
    Nothing of the stage was written (the selection is swapped in only when complete). Exit status 1."""

    exit_status = 1


class BatchRunner:
    """Runs `process_batch` over jobs in order: inline (workers <= 1) or in `workers` processes started from a
    forkserver, with bounded in-flight batches. The process that runs the batches (this one inline, else each
    worker) is configured once by `configure(cfg, index, control_tokens)`."""

    def __init__(self, workers: int, cfg, index: ContaminationIndex | None, control_tokens=()):
        self.workers = workers
        self.pool = None
        if workers > 1:
            self.pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("forkserver"), initializer=configure,
                                            initargs=(cfg, index, tuple(control_tokens)))
        else:
            configure(cfg, index, control_tokens)

    def map(self, jobs):
        """Yield `(meta, BatchResult)` for `(meta, job)` items in order (`(meta, None)` for a None job).

        Raises SelectWorkerDied when a worker process ends without answering."""
        if self.pool is None:
            for meta, job in jobs:
                yield meta, (process_batch(job) if job is not None else None)
            return
        pending: deque = deque()
        for meta, job in jobs:
            pending.append((meta, self._submit(job)))
            if len(pending) >= 2 * self.workers:
                yield self._result(*pending.popleft())
        while pending:
            yield self._result(*pending.popleft())

    def _submit(self, job):
        if job is None:
            return None
        try:
            return self.pool.submit(process_batch, job)
        except BrokenProcessPool as exc:
            raise self._died() from exc

    def _result(self, meta, fut):
        try:
            return meta, (fut.result() if fut is not None else None)
        except BrokenProcessPool as exc:
            raise self._died() from exc

    def _died(self) -> SelectWorkerDied:
        return SelectWorkerDied(
            f"a select worker process died without answering (killed by the OS or out of memory: see `dmesg`); "
            f"nothing was written, rerun the stage, and with less memory set select.workers lower than "
            f"{self.workers} or select.batch_rows smaller")

    def close(self, error: bool = False) -> None:
        """Stop the workers. After an error (a dead worker among them) the workers are killed first and the queued
        batches cancelled: ProcessPoolExecutor's own cleanup of a broken pool sends SIGTERM to the others, joins
        them and the call queue's feeder thread, and under CI (Python 3.11.7, a full suite) that wait did not end;
        with every worker gone nothing is left to wait on. Nothing a worker holds is kept after an error."""
        if self.pool is None:
            return
        pool, self.pool = self.pool, None
        if error:
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                if proc.is_alive():
                    proc.kill()
        pool.shutdown(wait=True, cancel_futures=error)
