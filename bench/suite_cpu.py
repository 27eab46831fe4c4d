"""Where the test suite's time goes: wall and CPU seconds per test module, on every pytest-xdist worker.

As a pytest plugin it appends one JSON line per test to `$REGEN_SUITE_CPU_DIR/<worker>.jsonl`; as a script it sums
them per module:

    REGEN_SUITE_CPU_DIR=/tmp/suite-cpu PYTHONPATH=bench .venv/bin/python -m pytest -q -n 2 -p suite_cpu
    .venv/bin/python bench/suite_cpu.py /tmp/suite-cpu

Per test (setup, call and teardown together, seconds): `wall`; `self`, the CPU time of the worker's own threads
(`getrusage(RUSAGE_SELF)`); `children`, that of the processes it started and waited for (`RUSAGE_CHILDREN`: a
server's own children that it did not wait for are not in it, so a vLLM server's engine process is missing);
`host_idle`, the seconds every core of the host spent idle meanwhile (`/proc/stat` idle + iowait, all cores: shared
by the workers: each worker's line sums it over its own tests). A module whose wall time is far above its CPU time
waits (sleeps, timeouts, a server's uncounted children) or waits for a core.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path


def _host_idle_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (fields[3] + fields[4]) / os.sysconf("SC_CLK_TCK")


def _cpu_s(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


try:
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        out = os.environ.get("REGEN_SUITE_CPU_DIR")
        if not out:
            yield
            return
        t0, idle0 = time.monotonic(), _host_idle_s()
        self0, kids0 = _cpu_s(resource.RUSAGE_SELF), _cpu_s(resource.RUSAGE_CHILDREN)
        yield
        rec = {"id": item.nodeid, "start": t0, "wall": time.monotonic() - t0,
               "self": _cpu_s(resource.RUSAGE_SELF) - self0, "children": _cpu_s(resource.RUSAGE_CHILDREN) - kids0,
               "host_idle": _host_idle_s() - idle0}
        Path(out).mkdir(parents=True, exist_ok=True)
        with open(Path(out) / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
except ImportError:  # the summary needs no pytest
    pass


def summarize(folder: Path, top: int = 30) -> str:
    """The per-module table of the JSON lines in `folder`, longest wall time first, and each worker's span."""
    lines, modules = [], defaultdict(lambda: defaultdict(float))
    for path in sorted(folder.glob("*.jsonl")):
        recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        if not recs:
            continue
        span = max(r["start"] + r["wall"] for r in recs) - min(r["start"] for r in recs)
        cpu, idle = sum(r["self"] + r["children"] for r in recs), sum(r["host_idle"] for r in recs)
        lines.append(f"{path.stem}: {len(recs)} tests, span {span:.0f} s, CPU {cpu:.0f} s, the host's cores idle "
                     f"{idle:.0f} s meanwhile")
        for r in recs:
            m = modules[r["id"].split("::")[0]]
            m["tests"] += 1
            for k in ("wall", "self", "children"):
                m[k] += r[k]
    total = sum(m["wall"] for m in modules.values())
    lines.append(f"{'wall s':>7} {'share':>6} {'self s':>7} {'child s':>7} {'tests':>5}  module")
    for name, m in sorted(modules.items(), key=lambda kv: -kv[1]["wall"])[:top]:
        lines.append(f"{m['wall']:7.1f} {m['wall'] / total:6.1%} {m['self']:7.1f} {m['children']:7.1f} "
                     f"{int(m['tests']):5d}  {name}")
    lines.append(f"all modules: {total:.0f} s of worker wall time")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: bench/suite_cpu.py DIR (the REGEN_SUITE_CPU_DIR of a pytest run with -p suite_cpu)")
    print(summarize(Path(sys.argv[1])))
