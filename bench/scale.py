"""Benchmark: the `kimi-k3` profile's generate stage at full size, simulated on loopback, with one actor killed.

    python -P bench/scale.py [--prompts 150000] [--quick] [--max-in-flight N] [--kill-at 0.4] [--keep DIR]

What runs: N prompts resampled from the bundled pool (`regen select --profile local` over data/prompts, then
copies with a `[copy k]` suffix on their first user message so every prompt id is unique; multi-turn and tool rows
included), the `kimi-k3` profile's generate config (thinking, policies, retries, timeouts, return_token_ids
on) against 8 `regen.testing.openai_server` processes on 127.0.0.1 streaming reasoning + content with long-tailed
lengths and token ids, through Ray with 2 actors on loopback (`regen.generate.ray_runner`). When `--kill-at` of the
units are recorded, one actor gets SIGKILL; the run ends with the other actor's shard done and an error, and the
same command (resume) finishes the killed shard.

Printed (JSON lines, then a summary): wall time; client CPU-seconds per 1,000 output tokens (both actors'
user + sys CPU, from psutil, over both sessions); peak RSS per actor; peak journal bytes and final part bytes;
requests re-sent after the kill (keys the servers received in the first session and again in the resume) and the
requests in flight at the kill from the client's side (sent, by the servers' /_timings, but not recorded in a
part or journal line when the first session ended; see `in_flight_at_kill`): the two sets must be equal; the
requests of the resume per shard (only the killed actor's shard may appear); rows lost and duplicated from the
accounting (must be 0); the projection: client cores per 1M output tokens/s = CPU-s per token x 1e6.
With `--keep DIR` the run directory stays, with `bench-scale.json` (kill pid and time, both timings snapshots,
the keys recorded after the first session).

Sizes: the full 150,000 prompts took 155 s on this 2-core machine (2026-12-01; answers scaled down to about 60
tokens, servers answering after 50 ms); `--prompts N` for a medium run; `--quick` (400 prompts, in-flight 8)
is run by the test suite, which checks that the figures are printed and that nothing was lost or duplicated.
"""
from __future__ import annotations

import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
from _preamble import ROOT  # noqa: E402 - bench/ off sys.path, the repository root first, HF offline

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

os.chdir(ROOT)  # the local profile's source paths are relative to the repository root

import psutil  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from regen.config import load_profile  # noqa: E402
from regen.generate import ledger  # noqa: E402
from regen.generate.stage import accounting, prompt_files, run_generate  # noqa: E402
from regen.rundir import RunDir  # noqa: E402
from regen.select.stage import run_select  # noqa: E402
from schemas.io import write_json_atomic, write_parquet_atomic  # noqa: E402
from schemas.prompt import PROMPT_SCHEMA, prompt_id_of  # noqa: E402

SERVER = {"tokens": 30, "reasoning_tokens": 30, "length_sigma": 0.8, "delay_s": 0.05, "log": False,
          "models": ["moonshotai/Kimi-K3"],  # the kimi-k3 profile's model, as the endpoint check asks
          "timings": True, "seed": 0}


def pool_rows(where: Path, total: int) -> list[dict]:
    """The bundled pool's selected prompts (local profile's sources), as PROMPT_SCHEMA rows, selected into `where`
    (this run's own temporary folder: no state is shared between runs). No progress bar: stdout holds only the
    bench's JSON lines."""
    run = RunDir.at(where)
    profile = load_profile("local", {"select.total": total})
    run_select(profile.select, run, seed=0, progress=False)
    return [r for f in sorted(run.prompts.glob("part-*.parquet")) for r in pq.read_table(f).to_pylist()]


def resample(pool: list[dict], n: int, run: RunDir) -> Counter:
    """n prompts: pool rows in turn, copy k > 0 with ` [copy k]` on its first user message (a new prompt id)."""
    kinds = Counter()
    rows = []
    for i in range(n):
        src = pool[i % len(pool)]
        k = i // len(pool)
        row = dict(src)
        msgs = [dict(m) for m in src["messages"]]
        if k:
            first = next(j for j, m in enumerate(msgs) if m["role"] == "user")
            msgs[first]["content"] = (msgs[first]["content"] or "") + f" [copy {k}]"
        tools = json.loads(src["tools"]) if src["tools"] else None
        from schemas.messages import message_from_arrow

        row["messages"] = msgs
        row["prompt_id"] = prompt_id_of([message_from_arrow(m) for m in msgs], tools)
        rows.append(row)
        kinds["tool"] += bool(tools)
        kinds["multi_turn"] += sum(m["role"] == "user" for m in msgs) > 1
    for start in range(0, n, 50_000):
        table = pa.Table.from_pylist(rows[start:start + 50_000], schema=PROMPT_SCHEMA)
        info = write_parquet_atomic(table, run.prompts / f"part-{start // 50_000:05d}.parquet", PROMPT_SCHEMA)
        kinds["parts"] += 1
        parts = (json.loads((run.prompts / "manifest.json").read_text())["parts"]
                 if (run.prompts / "manifest.json").exists() else [])
        write_json_atomic({"parts": parts + [info]}, run.prompts / "manifest.json")
    return kinds


def start_servers(n: int) -> list[tuple[subprocess.Popen, str]]:
    out = []
    for _ in range(n):
        proc = subprocess.Popen([sys.executable, "-m", "regen.testing.openai_server", "--port", "0", "--settings",
                                 json.dumps(SERVER)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        line = proc.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"test server did not start: {line!r}")
        out.append((proc, line.split("listening on", 1)[1].strip()))
    return out


def server_timings(urls: list[str]) -> list[list]:
    """Every server's [request_key, received_t, ended_t] rows so far (GET /_timings), in arrival order per server."""
    out = []
    for url in urls:
        with urllib.request.urlopen(url.removesuffix("/v1") + "/_timings", timeout=60) as r:
            out += json.loads(r.read())
    return out


def in_flight_at_kill(first: list | None, durable: set[str], timings: list, kill_t: float | None) -> dict:
    """Requests in flight at the kill, from the client's side, and the requests the resume re-sent.

    In flight at the kill = request keys the servers received in the first session whose rows were not recorded
    when it ended (`durable`: parts + complete journal lines, read before the resume's recover). The killed actor
    records nothing after its SIGKILL and the other actor records every request it sent, so this is exactly the
    killed actor's requests that were sent but not yet recorded (a journal line written but not yet fsynced counts
    as recorded: the page cache outlives a killed process, and recover() reads it). Re-sent = keys received in
    the first session and again in the second. The promise: re-sent == in flight. `open_at_servers_at_kill`
    counts the narrower server-side view (received <= kill <= ended); `answered_before_kill_not_recorded` the
    answers the servers had finished sending while the client had not yet recorded them (parsing, checking or
    the journal's group commit), with the oldest one's age at the kill.
    """
    if first is None:
        return {"figures": {"in_flight_at_kill": 0, "resent_after_kill": 0, "resent_not_in_flight": 0,
                            "in_flight_not_resent": 0}}
    sent_first = {k for k, _, _ in first}
    first_count = Counter(k for k, _, _ in first)
    all_count = Counter(k for k, _, _ in timings)
    sent_again = {k for k in sent_first if all_count[k] > first_count[k]}
    flight = sent_first - durable
    ended = {k: b for k, _, b in first}
    answered = [kill_t - ended[k] for k in flight if kill_t and ended[k] < kill_t]
    figures = {
        "in_flight_at_kill": len(flight), "resent_after_kill": len(sent_again),
        "resent_not_in_flight": len(sent_again - flight), "in_flight_not_resent": len(flight - sent_again),
        "open_at_servers_at_kill": sum(1 for k, a, b in first if kill_t and a <= kill_t <= b),
        "received_by_servers_after_kill": sum(1 for k, a, b in first if kill_t and a > kill_t),
        "answered_before_kill_not_recorded": len(answered),
        "oldest_unrecorded_answer_age_s": round(max(answered, default=0.0), 2),
    }
    return {"figures": figures}


class Watch(threading.Thread):
    """Samples the actors (CPU, RSS) and the journal every 0.5 s; kills one actor at `kill_at` of the units."""

    def __init__(self, gen_dir: Path, total_units: int, kill_at: float | None):
        super().__init__(daemon=True)
        self.gen_dir, self.total_units, self.kill_at = gen_dir, total_units, kill_at
        self.cpu: dict[int, float] = {}
        self.rss: dict[int, int] = {}
        self.names: dict[int, str] = {}
        self.journal_peak = 0
        self.killed: tuple[int, float] | None = None
        self.stop = threading.Event()

    def actors(self) -> list[psutil.Process]:
        out = []
        for p in psutil.Process().children(recursive=True):
            try:
                if "GenerateActor" in " ".join(p.cmdline()):
                    out.append(p)
            except psutil.Error:
                pass
        return out

    def recorded(self) -> int:
        n = 0
        for j in self.gen_dir.glob("journal-*.jsonl"):
            with open(j, "rb") as f:
                n += sum(1 for _ in f)
        return n + sum(e.get("rows", 0) for e in ledger.listed_parts(self.gen_dir).values())

    def run(self) -> None:
        last_sample = 0.0
        # the kill is checked every 50 ms (a quick run lasts seconds: a 0.5 s poll could miss the window and kill
        # an actor that had already finished its shard); the actors are sampled every 0.5 s
        while not self.stop.wait(0.05 if self.killed is None and self.kill_at is not None else 0.5):
            self.maybe_kill()
            if time.time() - last_sample < 0.5:
                continue
            last_sample = time.time()
            for p in self.actors():
                try:
                    t = p.cpu_times()
                    self.cpu[p.pid] = t.user + t.system
                    self.rss[p.pid] = max(self.rss.get(p.pid, 0), p.memory_info().rss)
                except psutil.Error:
                    pass
            self.journal_peak = max(self.journal_peak, sum(j.stat().st_size for j in self.gen_dir.glob("journal-*.jsonl")))

    def maybe_kill(self) -> None:
        if self.kill_at is not None and self.killed is None and self.recorded() >= self.kill_at * self.total_units:
            victims = self.actors()
            if victims:
                victim = victims[0]
                self.killed = (victim.pid, time.time())
                os.kill(victim.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=150_000)
    p.add_argument("--quick", action="store_true", help="400 prompts, in-flight 8 (the test suite's mode)")
    p.add_argument("--max-in-flight", default=None, help="per actor (default: the kimi-k3 profile's 4096; quick 64)")
    p.add_argument("--servers", type=int, default=8)
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--kill-at", type=float, default=0.4, help="fraction of units recorded when one actor is killed")
    p.add_argument("--keep", default=None, help="run directory to keep (default: a temporary one, removed)")
    args = p.parse_args(argv)
    n = 400 if args.quick else args.prompts
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="regen-scale-")) / "run"
    run = RunDir.at(root)
    t_setup = time.time()
    scratch = Path(tempfile.mkdtemp(prefix="regen-scale-pool-"))
    try:
        pool = pool_rows(scratch / "pool", 2000)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    kinds = resample(pool, n, run)
    profile = load_profile("kimi-k3")
    # quick: 8 in flight, so the run lasts long enough to kill mid-shard
    in_flight = args.max_in_flight or (8 if args.quick else profile.generate.max_in_flight)
    in_flight = in_flight if in_flight == "auto" else int(in_flight)
    servers = start_servers(args.servers)
    urls = [u for _, u in servers]
    cfg = profile.generate.model_copy(update={"endpoints": urls, "return_token_ids": True, "api_key_env": None,
                                              "max_in_flight": in_flight, "ray_actors": args.actors})
    files = prompt_files(run)
    from regen.generate.conversation import turn_positions
    from regen.generate.runner import in_shard, iter_prompts

    units = sum(len(turn_positions(r["messages"])) for r in iter_prompts(files))
    print(json.dumps({"prompts": n, "units": units, "pool": len(pool), **kinds, "servers": len(urls),
                      "actors": args.actors, "max_in_flight_per_actor": in_flight, "setup_s": round(time.time() - t_setup, 1),
                      "cpus": os.cpu_count(), "load_avg": round(os.getloadavg()[0], 2)}), flush=True)
    watch = Watch(run.generations, units, args.kill_at)
    watch.start()
    t0 = time.time()
    sessions = []
    first: list | None = None  # the servers' timings when the first session ended
    durable: set[str] = set()  # request keys recorded (parts + journal lines) when the first session ended
    try:
        for session in (1, 2):
            try:
                m = run_generate(cfg, run, ray_address="local", progress=False)
                sessions.append({"session": session, "complete": m["complete"], "wall_s": round(time.time() - t0, 1)})
                if m["complete"]:
                    break
            except Exception as exc:  # the killed actor's error: resume with the same command
                sessions.append({"session": session, "error": type(exc).__name__, "wall_s": round(time.time() - t0, 1)})
            print(json.dumps(sessions[-1]), flush=True)
            if session == 1:  # before the resume's recover() turns the journals into parts
                first, durable = server_timings(urls), ledger.recorded_keys(run.generations)
    finally:
        wall = time.time() - t0
        watch.stop.set()
        watch.join()
        timings = server_timings(urls)
        for proc, _ in servers:
            proc.terminate()
            proc.wait(10)
    acc = accounting(run.generations, files)
    out_tokens = 0
    for f in ledger.part_paths(run.generations):
        t = pq.read_table(f, columns=["status", "num_completion_tokens"]).to_pydict()
        out_tokens += sum(x or 0 for s, x in zip(t["status"], t["num_completion_tokens"]) if s == "ok")
    part_bytes = sum(f.stat().st_size for f in ledger.part_paths(run.generations))
    kill_t = watch.killed[1] if watch.killed else None
    flight = in_flight_at_kill(first, durable, timings, kill_t)
    if first is not None:  # which shards the resume asked for: only the killed actor's may appear
        index = ledger.read_index(run.generations, ["request_key", "prompt_id"]).to_pydict()
        shard_of = {k: next(i for i in range(args.actors) if in_shard(pid, (i, args.actors)))
                    for k, pid in zip(index["request_key"], index["prompt_id"])}
        resumed = Counter(k for k, _, _ in timings) - Counter(k for k, _, _ in first)
        per_shard = Counter()
        for k, c in resumed.items():
            per_shard[shard_of.get(k, -1)] += c
        flight["figures"]["resume_requests_per_shard"] = {str(i): per_shard[i] for i in sorted(per_shard)}
    cpu_s = sum(watch.cpu.values())
    per_1k = cpu_s / max(1, out_tokens) * 1000
    summary = {
        "prompts": n, "units": units, "wall_s": round(wall, 1), "sessions": sessions,
        "output_tokens": out_tokens, "output_tok_s": round(out_tokens / wall, 1),
        "client_cpu_s": round(cpu_s, 1), "client_cpu_s_per_1k_output_tokens": round(per_1k, 4),
        "peak_rss_mb_per_actor_process": sorted(round(v / 2**20) for v in watch.rss.values()),  # both sessions
        "journal_peak_bytes": watch.journal_peak, "part_bytes": part_bytes,
        "killed_actor": bool(watch.killed), "requests_received": len(timings), **flight.pop("figures"),
        "rows_lost": acc["missing"], "rows_duplicated": acc["duplicates"], "balanced": acc["balanced"],
        "projection_client_cores_per_1M_output_tok_s": round(per_1k * 1000, 1),
        "load_avg": round(os.getloadavg()[0], 2),
    }
    print("SUMMARY " + json.dumps(summary), flush=True)
    if args.keep:  # what the figures were computed from, for a closer look
        write_json_atomic({"kill": {"pid": watch.killed[0], "t": kill_t} if watch.killed else None,
                           "first_session_timings": first, "timings": timings, "durable_after_first": sorted(durable)},
                          root / "bench-scale.json")
    if not args.keep:
        shutil.rmtree(root.parent, ignore_errors=True)
    return 0 if acc["balanced"] and not summary["resent_not_in_flight"] and not summary["in_flight_not_resent"] else 1


if __name__ == "__main__":
    sys.exit(main())
