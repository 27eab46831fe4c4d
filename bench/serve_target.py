"""Benchmark the embedded target's engines side by side: output tokens/s at 1/8/16/32 requests in flight, the
server's CPU seconds per 1K output tokens, its RSS, the answers' stop/length mix, and the ratio of the best levels.

    .venv/bin/python -P bench/serve_target.py [--engines llama.cpp,transformers] [--levels 1,8,16,32]
        [--seconds 60] [--hog N] [--set serve.threads=1 ...] [--no-agreement] [--quick]

Each engine is started as `regen run` starts it (regen.target.server.EmbeddedTarget with the `local` profile's
serve settings, `serve.engine` set per arm) and sent the `local` profile's requests: its sampling (temperature
0.7, top-p 0.9, its `max_tokens`; the engine's own extra samplers off, regen.target.llama_cpp), first turns of
prompts selected from the bundled pool by the profile's select stage, streamed. Per level, C workers each keep one
request in flight for `--seconds`; then the requests still running are closed. Tokens are counted where they were
streamed: an answer's `usage.completion_tokens` spread over its content chunks, by chunk arrival time (an answer
closed at the end counts its chunks). The stop/length mix is over the answers that finished in the windows (a
window closes long answers more often than short ones, in every arm alike; the main job's mix is the whole one).
`--hog N` runs N CPU-bound processes (a Python busy loop each) beside every arm: the shared-machine case.

Then (unless `--no-agreement`) bench/serve_agreement.py: the engine's greedy tokens and top-5 probabilities
against the trainer's transformers target on the same prompts (agreement rate), and the prompt token ids of the
engine's template against the renderer's. Figures depend on the machine and its load (printed: CPU model, flags,
load average). `--quick` (the test suite): llama.cpp only, levels 1 and 4, 5 s, 32 tokens.
"""
from __future__ import annotations

import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
from _preamble import sibling  # noqa: E402 - bench/ off sys.path, the repository root first, HF offline

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import psutil  # noqa: E402

ENGINES = ("llama.cpp", "transformers")


def cpu_line() -> dict:
    """The CPU this ran on: model name, count, and the flags that decide the kernels (AVX2, AVX-512, AMX, bf16)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    keep = [f for f in flags if f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni")]
    return {"cpu": model, "cpus": os.cpu_count(), "flags": keep}


def bench_prompts(n: int, seed: int = 0) -> list[list[dict]]:
    """First-turn messages (plus tools) of `n` prompts the `local` profile's select stage picks from the bundled
    pool: [{"messages": [...], "tools": [...] | None}]."""
    from regen.config import load_profile
    from regen.generate.conversation import tools_from_json
    from regen.generate.runner import iter_prompts
    from regen.generate.stage import prompt_files
    from regen.rundir import RunDir
    from regen.select.stage import run_select
    from schemas.prompt import turn_positions

    profile = load_profile("local")
    run = RunDir(Path(tempfile.mkdtemp(prefix="regen-bench-serve-")))
    run_select(profile.select.model_copy(update={"total": n}), run, seed=seed, progress=False)
    out = []
    for row in iter_prompts(prompt_files(run)):  # the messages as the generate stage sends them
        pos = turn_positions(row["messages"])[0]
        out.append({"messages": row["messages"][:pos], "tools": tools_from_json(row["tools"])})
    return out


async def _stream_one(client: httpx.AsyncClient, url: str, body: dict, rec: dict) -> None:
    async with client.stream("POST", url, json=body, timeout=httpx.Timeout(900, connect=10)) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    rec["chunks"].append(time.perf_counter())
                if ch.get("finish_reason"):
                    rec["finish"] = ch["finish_reason"]
            if chunk.get("usage"):
                rec["tokens"] = chunk["usage"]["completion_tokens"]


async def closed_loop(target, prompts: list[dict], concurrency: int, seconds: float, params: dict) -> dict:
    """`concurrency` workers each keep one streamed request in flight for `seconds` (module docstring)."""
    url = target.base_url + "/chat/completions"
    records: list[dict] = []
    counter = iter(range(10**9))
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.perf_counter()
        end = t0 + seconds

        async def worker() -> None:
            while time.perf_counter() < end:
                p = prompts[next(counter) % len(prompts)]
                body = {"model": target.model, "messages": p["messages"], **params, "stream": True,
                        "stream_options": {"include_usage": True}}
                if p["tools"]:
                    body["tools"] = p["tools"]
                rec = {"chunks": [], "tokens": None, "finish": None}
                records.append(rec)
                try:
                    await asyncio.wait_for(_stream_one(client, url, body, rec), timeout=max(0.1, end - time.perf_counter()))
                except asyncio.TimeoutError:
                    rec["closed"] = True
                except httpx.HTTPError as exc:  # counted, and the loop goes on (a dead server is caught below)
                    rec["error"] = f"{type(exc).__name__}: {exc}"[:200]
                    if target.proc is None or target.proc.poll() is not None:
                        raise RuntimeError(f"the {target.engine} server exited; log: {target.log_path}") from exc
                    await asyncio.sleep(0.2)

        proc = psutil.Process(target.pid)
        cpu0 = _cpu(proc)
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        cpu = _cpu(proc) - cpu0
        wall = time.perf_counter() - t0
        rss = _rss(proc)
    tokens = 0.0
    finish = {"stop": 0, "length": 0}
    for rec in records:
        n = len(rec["chunks"])
        if rec["tokens"] is not None and n:
            tokens += rec["tokens"] * sum(1 for t in rec["chunks"] if t <= end) / n
        else:
            tokens += sum(1 for t in rec["chunks"] if t <= end)
        if rec["finish"] in finish and not rec.get("closed"):
            finish[rec["finish"]] += 1
    errors = [r["error"] for r in records if r.get("error")]
    return {"concurrency": concurrency, "wall_s": round(wall, 1), "tokens": round(tokens), "errors": len(errors),
            "first_error": errors[0] if errors else None,
            "tok_s": round(tokens / seconds, 1), "cpu_s_per_1k_tokens": round(1000 * cpu / max(tokens, 1), 2),
            "server_rss_mb": rss, "finished": finish, "load_avg": round(os.getloadavg()[0], 2)}


def _cpu(proc: psutil.Process) -> float:
    procs = [proc] + proc.children(recursive=True)
    return sum(sum(p.cpu_times()[:2]) for p in procs if p.is_running())


def _rss(proc: psutil.Process) -> int:
    procs = [proc] + proc.children(recursive=True)
    return round(sum(p.memory_info().rss for p in procs if p.is_running()) / 2**20)


def start_hogs(n: int) -> list[subprocess.Popen]:
    """N CPU-bound processes (one busy Python loop each), as another user's job beside the server."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run_engine(engine: str, serve, prompts, levels, seconds, params, log_dir: Path) -> dict:
    from regen.target.server import EmbeddedTarget, engine_identity

    cfg = serve.model_copy(update={"engine": engine})
    ident = engine_identity(cfg)
    if ident["engine"].split()[0] != engine.split()[0]:
        print(json.dumps({"engine": engine, "skipped": "not installed (fallback)", "identity": ident}), flush=True)
        return {"engine": engine, "skipped": True}
    t0 = time.perf_counter()
    with EmbeddedTarget(cfg, log_path=log_dir / f"{engine}.log", sampling=sampling_of(params)) as target:
        head = {**ident, "engine": engine, "server": ident["engine"], "ready_s": round(time.perf_counter() - t0, 1),
                "threads": cfg.threads if engine == "llama.cpp" else None}
        print(json.dumps(head), flush=True)
        rows = []
        for c in levels:
            res = asyncio.run(closed_loop(target, prompts, c, seconds, params))
            rows.append(res)
            print(json.dumps({"engine": engine, **res}), flush=True)
    best = max(rows, key=lambda r: r["tok_s"])
    finish = {k: sum(r["finished"][k] for r in rows) for k in ("stop", "length")}
    total = sum(finish.values())
    return {**head, "levels": rows, "best_level": best["concurrency"], "best_tok_s": best["tok_s"],
            "finished": finish, "stop_share": round(finish["stop"] / total, 3) if total else None}


def sampling_of(params: dict) -> dict:
    return {k: params[k] for k in ("temperature", "top_p") if k in params}


def main(argv: list[str] | None = None) -> int:
    from regen.config import load_profile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--levels", default="1,8,16,32")
    p.add_argument("--seconds", type=float, default=60.0, help="seconds per level (closed loop)")
    p.add_argument("--max-tokens", type=int, default=None, help="default: the local profile's generate.max_tokens")
    p.add_argument("--prompts", type=int, default=96, help="bundled prompts selected (first turns, cycled)")
    p.add_argument("--hog", type=int, default=0, help="CPU-bound processes running beside every arm")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="serve.KEY=VALUE (both engines)")
    p.add_argument("--no-agreement", action="store_true", help="skip bench/serve_agreement.py")
    p.add_argument("--quick", action="store_true", help="llama.cpp, levels 1 and 4, 5 s, 32 tokens (test suite)")
    p.add_argument("--json", default=None, help="also write the summary here")
    p.add_argument("--log-dir", default=None, help="the servers' logs (default: a new temporary directory, kept)")
    args = p.parse_args(argv)
    profile = load_profile("local", [o if o.startswith("serve.") else f"serve.{o}" for o in args.overrides])
    engines = ["llama.cpp"] if args.quick else [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        p.error(f"--engines: unknown {bad}; choose from {', '.join(ENGINES)}")
    levels = [1, 4] if args.quick else [int(x) for x in args.levels.split(",")]
    seconds = 5.0 if args.quick else args.seconds
    g = profile.generate
    params = {"temperature": g.temperature, "top_p": g.top_p,
              "max_tokens": 32 if args.quick else (args.max_tokens or g.max_tokens)}
    prompts = bench_prompts(16 if args.quick else args.prompts)
    print(json.dumps({**cpu_line(), "load_avg": round(os.getloadavg()[0], 2), "levels": levels, "seconds": seconds,
                      "params": params, "prompts": len(prompts), "hog": args.hog}), flush=True)
    hogs = start_hogs(args.hog)
    results = []
    try:
        logs = Path(args.log_dir or tempfile.mkdtemp(prefix="regen-bench-serve-logs-"))
        logs.mkdir(parents=True, exist_ok=True)
        print(json.dumps({"server_logs": str(logs)}), flush=True)
        for engine in engines:
            results.append(run_engine(engine, profile.serve, prompts, levels, seconds, params, logs))
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    done = [r for r in results if not r.get("skipped")]
    base = next((r for r in done if r["engine"] == "transformers"), None)
    summary = {"cpu": cpu_line(), "hog": args.hog, "engines": {r["engine"]: {k: r[k] for k in (
        "best_level", "best_tok_s", "stop_share", "finished", "version", "weights", "threads")} for r in done}}
    for r in done:
        if base and r is not base and base["best_tok_s"]:
            summary["ratio"] = {"engine": r["engine"], "vs": "transformers",
                                "best_tok_s_ratio": round(r["best_tok_s"] / base["best_tok_s"], 2),
                                "goal_4x_met": r["best_tok_s"] >= 4 * base["best_tok_s"]}
    print("SUMMARY " + json.dumps(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    if not args.no_agreement and any(r["engine"] == "llama.cpp" for r in done):
        sibling("serve_agreement").main(["--quick"] if args.quick else [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
