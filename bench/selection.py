"""Benchmark of `regen select`: a 1,000,000-row pool built from the bundled prompts, selected down to 150K.

    .venv/bin/python bench/selection.py            # full size (1M rows -> 150K)
    .venv/bin/python bench/selection.py --quick    # 20K rows -> 3K, a smoke run

The pool is Parquet in the kimi-mtp-dataset shape (`conversations: [{from, value}]`, `source`, `tools`), written
to a temporary folder by a child process. Rows: 88% distinct prompts (three bundled prompts, 300 characters
each, joined with a row number; tool conversations keep their later turns), 6% exact duplicates
(case/whitespace changed), 5% near duplicates (a few characters changed), 1% malformed (unknown role, empty
conversation, bad tool JSON). Prints rows/s, peak RSS of the selection (psutil, sampled every 50 ms) and the ratio of
the selection's time to reading the same file with `pyarrow.parquet.read_table` alone, measured in the same run.
"""
from __future__ import annotations

import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
from _preamble import ROOT  # noqa: E402 - bench/ off sys.path, the repository root first, HF offline

from pathlib import Path

REPO = ROOT

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

LABELS = {"general": "chat", "reasoning": "math", "coding": "code", "tool_use": "tool_agent", "chinese": "zh_chat",
          "multilingual": "multilingual_chat"}


def _base_prompts() -> list[dict]:
    """(conversations, source label, tools JSON) from every bundled prompt of the local profile."""
    from regen.config import load_profile
    from regen.select.sources import iter_raw_batches, make_drafts, shape_of, source_files

    cfg = load_profile("local").select
    out = []
    for src in cfg.sources:
        for path, kind in source_files(src):
            shape = fmap = None
            for sfile, start, rows in iter_raw_batches(path, kind, 5000, src.fields):
                if shape is None:
                    shape, fmap = shape_of(sfile, rows, src.fields)
                for d in make_drafts(src, cfg, sfile, start, rows, shape, fmap, {}):
                    if d.error or any(not isinstance(m.get("content"), (str, type(None))) for m in d.messages):
                        continue
                    out.append({"messages": d.messages, "tools": d.tools, "label": LABELS[d.category]})
    return out


def _conv(messages) -> list[dict]:
    conv = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            body = "".join(f"<|tool_call_begin|>functions.{c['function']['name']}:{i}<|tool_call_argument_begin|>"
                           f"{c['function']['arguments']}<|tool_call_end|>" for i, c in enumerate(m["tool_calls"]))
            conv.append({"from": "gpt", "value": (m.get("content") or "") + f"<|tool_calls_section_begin|>{body}"
                                                                          f"<|tool_calls_section_end|>"})
        else:
            conv.append({"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                         "value": m.get("content") or ""})
    return conv


def build_pool(path: Path, rows: int, seed: int = 0) -> None:
    """Write the perturbed pool (see module docstring) as Parquet row groups of 50K rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    base = _base_prompts()
    schema = pa.schema([("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))),
                        ("source", pa.string()), ("tools", pa.string())])
    recent: list[dict] = []
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        for start in range(0, rows, 50_000):
            batch = []
            for i in range(start, min(rows, start + 50_000)):
                r = rng.random()
                if r < 0.06 and recent:
                    row = json.loads(json.dumps(rng.choice(recent)))
                    row["conversations"][0]["value"] = "  " + row["conversations"][0]["value"].upper() + "\n"
                elif r < 0.11 and recent:
                    row = json.loads(json.dumps(rng.choice(recent)))
                    v = list(row["conversations"][0]["value"])
                    for _ in range(2):
                        v[rng.randrange(len(v))] = rng.choice("abcdefghij")
                    row["conversations"][0]["value"] = "".join(v)
                elif r < 0.12:
                    row = rng.choice([
                        {"conversations": [{"from": "narrator", "value": "x"}], "source": "chat", "tools": None},
                        {"conversations": [], "source": "chat", "tools": None},
                        {"conversations": [{"from": "human", "value": "hi"}], "source": "tool_agent", "tools": "[{"},
                    ])
                else:
                    a, b, c = rng.choice(base), rng.choice(base), rng.choice(base)
                    conv = _conv(a["messages"]) if a["tools"] else [{"from": "human", "value": next(
                        m["content"] for m in a["messages"] if m["role"] == "user")}]
                    first = next(k for k, t in enumerate(conv) if t["from"] == "human")
                    extra = [next((m["content"] for m in x["messages"] if m["role"] == "user"), "") for x in (b, c)]
                    conv[first] = {"from": "human", "value": f"[{i}] {conv[first]['value'][:300]}\n\nAlso: "
                                                             f"{extra[0][:300]}\n\nAnd: {extra[1][:300]}"}
                    row = {"conversations": conv, "source": a["label"],
                           "tools": json.dumps(a["tools"], ensure_ascii=False) if a["tools"] else None}
                    if len(recent) < 5000:
                        recent.append(row)
                    else:
                        recent[rng.randrange(5000)] = row
                batch.append(row)
            writer.write_table(pa.Table.from_pylist(batch, schema=schema))


class PeakRSS:
    """Peak resident set size of this process and its descendants, sampled every 50 ms in a thread (bytes), and
    the CPU seconds each descendant started meanwhile was last seen to have used (`workers_cpu_s`: the selection's
    workers are the forkserver's children, so `RUSAGE_CHILDREN` of this process never counts them)."""

    def __init__(self):
        import psutil

        self.proc = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._before = {c.pid for c in self.proc.children(recursive=True)}
        self._cpu: dict[int, float] = {}

    @property
    def workers_cpu_s(self) -> float:
        return sum(self._cpu.values())

    def __enter__(self):
        self.peak = self.proc.memory_info().rss
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _rss(self) -> int:
        """RSS of this process plus its worker processes (shared pages counted in each: an upper bound)."""
        total = self.proc.memory_info().rss
        for child in self.proc.children(recursive=True):
            try:
                total += child.memory_info().rss
                if child.pid not in self._before:
                    t = child.cpu_times()
                    self._cpu[child.pid] = t.user + t.system
            except Exception:  # a worker that just exited
                pass
        return total

    def _run(self):
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20K rows -> 3K prompts")
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--total", type=int, default=None)
    ap.add_argument("--pool", metavar="PATH", help="keep the pool at PATH (built there when missing) for reruns")
    ap.add_argument("--build", metavar="PATH", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rows = args.rows or (20_000 if args.quick else 1_000_000)
    total = args.total or (3_000 if args.quick else 150_000)
    if args.build:
        build_pool(Path(args.build), rows)
        return 0
    import pyarrow.parquet as pq

    from regen.config import load_profile
    from regen.config.select import SourceConfig
    from regen.rundir import RunDir
    from regen.select.stage import run_select

    with tempfile.TemporaryDirectory(prefix="bench-select-") as tmp:
        pool = Path(args.pool) if args.pool else Path(tmp) / "pool.parquet"
        t = time.time()
        if not pool.exists():
            subprocess.run([sys.executable, __file__, "--build", str(pool), "--rows", str(rows)], check=True)
            print(f"pool: built in {time.time() - t:.1f} s")
        rows = pq.ParquetFile(pool).metadata.num_rows
        print(f"pool: {rows:,} rows, {pool.stat().st_size / 2**20:.1f} MiB parquet")
        km = load_profile("kimi-k3").select.sources[0].category_map if os.environ.get("KIMI_MTP_DATASET") else None
        cfg = load_profile("local").select.model_copy(update={
            "total": total, "max_prompt_tokens": 16_384, "drop_prompts_with_images": False,
            "sources": [SourceConfig(name="pool", path=str(pool), category_map=km or {
                "math": "reasoning", "chat": "general", "code": "coding", "zh_chat": "chinese",
                "tool_agent": "tool_use", "multilingual_chat": "multilingual"})]})
        run = RunDir.at(Path(tmp) / "run")
        with PeakRSS() as mem:
            t, c = time.time(), time.process_time()
            m = run_select(cfg, run, seed=0, progress=sys.stderr.isatty())
            sel_s = time.time() - t
            cpu_s = time.process_time() - c
        cpu_s += mem.workers_cpu_s  # up to 50 ms per worker unseen
        t = time.time()  # the baseline runs after the selection so that its buffers do not count in the peak
        table = pq.read_table(pool)
        base_s = time.time() - t
        del table
    acct = m["accounting"]["totals"]
    print(f"selected {m['num_prompts']:,} of {total:,}; rejected {acct['rejected']:,} "
          f"({', '.join(f'{k} {v:,}' for k, v in m['filters'].items() if v)}); not selected {acct['not_selected']:,}")
    print(f"select: {sel_s:.1f} s wall, {cpu_s:.1f} s CPU; {rows / sel_s:,.0f} rows/s wall, {rows / cpu_s:,.0f} rows "
          f"per CPU-second; peak RSS {mem.peak / 2**30:.2f} GiB")
    print(f"baseline pyarrow.parquet.read_table: {base_s:.2f} s ({rows / base_s:,.0f} rows/s); "
          f"select / read ratio {sel_s / base_s:.1f}x")
    print(f"cpu: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} (shared machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
