"""Counters of a generation run: live progress figures, the manifest's metrics summary, per-minute throughput.

Units: seconds, tokens (usage.completion_tokens; when a server gives no usage, stream chunks are counted).
The per-minute table (`throughput.parquet`: minute UTC, writer, requests, ok, errors, skipped,
output_tokens, prompt_tokens) is plot-ready: one row per (minute, writer).
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict

import pyarrow as pa

THROUGHPUT_SCHEMA = pa.schema([
    ("minute", pa.timestamp("s", tz="UTC")), ("writer", pa.string()), ("requests", pa.int64()),
    ("ok", pa.int64()), ("errors", pa.int64()), ("skipped", pa.int64()),
    ("output_tokens", pa.int64()), ("prompt_tokens", pa.int64()),
])


class Metrics:
    """Mutable counters of one process (one event loop; no locking needed)."""

    def __init__(self, writer: str = "w0"):
        self.writer = writer
        self.t0 = time.time()
        self.attempts = 0  # HTTP attempts finished (any outcome)
        self.rows = Counter()  # status -> rows written this session
        self.row_errors = Counter()  # error_class of error rows
        self.failures = Counter()  # attempt-level failure/quality classes (retried or not)
        self.failure_examples: dict[str, str] = {}  # failure class -> the first attempt's detail (retried or not)
        self.flags = Counter()
        self.output_tokens = 0
        self.prompt_tokens = 0
        self.latencies: list[float] = []
        self.ttfts: list[float] = []
        self.per_minute: dict[int, Counter] = defaultdict(Counter)
        self.peak_in_flight = 0
        self.limit_history: dict[str, list] | None = None  # max_in_flight auto: endpoint -> [(t_s, limit, reason)]

    def _minute(self) -> Counter:
        return self.per_minute[int(time.time() // 60) * 60]

    def attempt(self, failure_class: str | None = None, output_tokens: int = 0, prompt_tokens: int = 0,
                latency_s: float | None = None, ttft_s: float | None = None, detail: str | None = None) -> None:
        """One HTTP attempt ended; `failure_class` (and the transport's `detail`, the first kept per class) when it
        failed or its answer was judged."""
        self.attempts += 1
        m = self._minute()
        m["requests"] += 1
        if failure_class:
            self.failures[failure_class] += 1
            if detail and failure_class not in self.failure_examples:
                self.failure_examples[failure_class] = detail
        self.output_tokens += output_tokens
        self.prompt_tokens += prompt_tokens
        m["output_tokens"] += output_tokens
        m["prompt_tokens"] += prompt_tokens
        if latency_s is not None:
            self.latencies.append(latency_s)
        if ttft_s is not None:
            self.ttfts.append(ttft_s)

    def row(self, status: str, error_class: str | None = None, flags: list[str] | None = None) -> None:
        self.rows[status] += 1
        self._minute()["ok" if status == "ok" else ("errors" if status == "error" else "skipped")] += 1
        if error_class and status == "error":
            self.row_errors[error_class] += 1
        for f in flags or []:
            self.flags[f] += 1

    def snapshot(self) -> dict:
        """Live figures for the progress line (rates over the whole session)."""
        dt = max(1e-6, time.time() - self.t0)
        return {"attempts": self.attempts, "rows": sum(self.rows.values()), "req_per_s": self.attempts / dt,
                "out_tok_per_s": self.output_tokens / dt, "failures": dict(self.failures)}

    def summary(self) -> dict:
        """The metrics block of the manifest."""
        def pct(xs, q):
            if not xs:
                return None
            xs = sorted(xs)
            return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)

        dt = max(1e-6, time.time() - self.t0)
        return {
            "writer": self.writer, "wall_s": round(dt, 3), "attempts": self.attempts, "rows": dict(self.rows),
            "error_rows_by_class": dict(self.row_errors), "failures_by_class": dict(self.failures),
            "failure_examples": dict(self.failure_examples), "flags": dict(self.flags),
            "output_tokens": self.output_tokens, "prompt_tokens": self.prompt_tokens,
            "req_per_s": round(self.attempts / dt, 3), "output_tok_per_s": round(self.output_tokens / dt, 1),
            "peak_in_flight": self.peak_in_flight,
            "latency_s": {q: pct(self.latencies, f) for q, f in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
            "ttft_s": {"p50": pct(self.ttfts, 0.5), "p90": pct(self.ttfts, 0.9)},
            **({"in_flight_limits": {ep: {"final": h[-1][1], "changes": len(h) - 1, "history": h}
                                     for ep, h in self.limit_history.items()}} if self.limit_history else {}),
        }

    def throughput_rows(self) -> list[dict]:
        return [{"minute": m, "writer": self.writer, "requests": c["requests"], "ok": c["ok"], "errors": c["errors"],
                 "skipped": c["skipped"], "output_tokens": c["output_tokens"], "prompt_tokens": c["prompt_tokens"]}
                for m, c in sorted(self.per_minute.items())]


def merge_summaries(summaries: list[dict]) -> dict:
    """Sum the counters of several writers' summaries (Ray actors); percentiles kept per writer."""
    if len(summaries) == 1:
        return summaries[0]
    limits = {f"{s.get('writer')}:{ep}": v for s in summaries for ep, v in (s.get("in_flight_limits") or {}).items()}
    out: dict = {"writers": summaries, "attempts": 0, "output_tokens": 0, "prompt_tokens": 0,
                 "peak_in_flight": sum(s.get("peak_in_flight", 0) for s in summaries)}
    for key in ("rows", "error_rows_by_class", "failures_by_class", "flags"):
        total = Counter()
        for s in summaries:
            total.update(s.get(key, {}))
        out[key] = dict(total)
    out["failure_examples"] = {}  # the first writer's example of each class
    for s in summaries:
        for k, v in (s.get("failure_examples") or {}).items():
            out["failure_examples"].setdefault(k, v)
    for s in summaries:
        for key in ("attempts", "output_tokens", "prompt_tokens"):
            out[key] += s.get(key, 0)
    wall = max((s.get("wall_s", 0) for s in summaries), default=0) or 1e-6
    out["wall_s"] = wall
    out["req_per_s"] = round(out["attempts"] / wall, 3)
    out["output_tok_per_s"] = round(out["output_tokens"] / wall, 1)
    if limits:
        out["in_flight_limits"] = limits  # "writer:endpoint" -> final, changes, history
    return out


def write_throughput(path, rows: list[dict]) -> None:
    """Merge `rows` into the per-minute table at `path` (sums rows of the same minute and writer)."""
    from pathlib import Path

    import pyarrow.parquet as pq

    from schemas.io import write_parquet_atomic

    path = Path(path)
    merged: dict[tuple, Counter] = defaultdict(Counter)
    existing = pq.read_table(path).to_pylist() if path.exists() else []
    for r in existing + rows:
        minute = r["minute"]
        minute = int(minute.timestamp()) if hasattr(minute, "timestamp") else int(minute)
        c = merged[(minute, r["writer"])]
        for k in ("requests", "ok", "errors", "skipped", "output_tokens", "prompt_tokens"):
            c[k] += r[k] or 0
    out = [{"minute": m, "writer": w, **{k: c[k] for k in ("requests", "ok", "errors", "skipped", "output_tokens",
                                                               "prompt_tokens")}}
           for (m, w), c in sorted(merged.items())]
    write_parquet_atomic(pa.Table.from_pylist(out, schema=THROUGHPUT_SCHEMA), path, THROUGHPUT_SCHEMA)


def format_stats(snapshot: dict, in_flight: int, limit: int | None = None) -> str:
    """The figures of the progress line: req/s, output tok/s, in flight (/ the auto limit), errors by class."""
    errors = " ".join(f"{k}={v}" for k, v in sorted(snapshot["failures"].items()))
    flight = f"in flight {in_flight}" + (f"/{limit} auto" if limit is not None else "")
    return (f"{snapshot['req_per_s']:.1f} req/s  {snapshot['out_tok_per_s']:.0f} tok/s  {flight}"
            + (f"  errors {errors}" if errors else ""))


class ProgressLine:
    """Progress of a generation: units done / total, req/s, output tok/s, in flight, errors by class, ETA.

    On a terminal with `enabled`, a rich progress bar. Anywhere else (stdout sent to a file, `--no-progress`, a
    Prefect task, whose printed lines go to the flow run's logs) a plain line every `interval_s` seconds
    (`generate.progress_interval_s`; 0 = none) and one at the end: a bar draws nothing where nobody watches a
    terminal (a main job sent to a file printed nothing for 45 minutes)."""

    def __init__(self, total: int, done: int, enabled: bool = True, interval_s: float = 0.0, out=None,
                 terminal: bool | None = None):
        import sys

        self.out = out or sys.stdout
        terminal = self.out.isatty() if terminal is None else terminal
        self.enabled = enabled and terminal
        self.interval_s = 0.0 if self.enabled else interval_s
        self.total, self.start_done, self.done = total, done, done
        self.t0 = self.last = time.monotonic()
        self.stats = ""
        if not self.enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("generate"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
            TimeRemainingColumn(), refresh_per_second=2, transient=False,
        )
        self.task = self.progress.add_task("generate", total=total, completed=done, stats="")
        self.progress.start()

    def update(self, done: int, snapshot: dict, in_flight: int, limit: int | None = None) -> None:
        """`limit`: the current in-flight limit (max_in_flight auto: the sum over endpoints), shown as n/limit."""
        self.done, self.stats = done, format_stats(snapshot, in_flight, limit)
        if self.enabled:
            self.progress.update(self.task, completed=done, stats=self.stats)
        elif self.interval_s > 0 and time.monotonic() - self.last >= self.interval_s:
            self.print_line()

    def line(self) -> str:
        """`generate: D/T units (P%), <stats>, ETA M min` (the rate since this process started)."""
        elapsed = time.monotonic() - self.t0
        rate = (self.done - self.start_done) / elapsed if elapsed > 0 else 0.0
        left = max(0, self.total - self.done)
        eta = f"ETA {left / rate / 60:.1f} min" if rate > 0 and left else ("done" if not left else "ETA unknown")
        return (f"generate: {self.done:,}/{self.total:,} units ({self.done / max(1, self.total):.1%}), "
                f"{self.stats or 'no completion yet'}, {elapsed / 60:.1f} min elapsed, {eta}")

    def print_line(self) -> None:
        self.last = time.monotonic()
        print(self.line(), file=self.out, flush=True)

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()
        elif self.interval_s > 0:
            self.print_line()
