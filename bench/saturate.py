"""Benchmark `generate.max_in_flight: auto` against the best fixed concurrency, side by side in one run.

    python -P bench/saturate.py [--quick] [--skip-embedded | --only-embedded] [--seconds S] [--slots N] [--levels 4,8,16,...]

For each target, sweep fixed concurrencies (a closed loop of C requests always in flight through
`regen.generate.client.ChatClient` for S seconds each), take the one with the most output tokens/s as the best,
then run `auto` (the same client with `ConcurrencyController` per endpoint) for S seconds. Targets:

  slots          `regen.testing.openai_server` in its own process with a fixed capacity: N decode slots, a queue
                 beyond, ITL growing with the batch, long-tailed answers of reasoning + content (no /metrics: the
                 controller sees only throughput, TTFT, 429/503)
  slots+metrics  the same server exposing vLLM's /metrics gauges (running, waiting, KV cache usage)
  embedded       the local profile's embedded target (`regen.target.server.EmbeddedTarget` with the profile's serve
                 settings and sampling, transformers serve on CPU), 128-token answers; slow here (1 minute per
                 level, levels 1/4/8/16/32; `--only-embedded --seconds 180` is the fair length: each doubling
                 of auto waits one turnover, 6-20 s on this server): --skip-embedded leaves it out,
                 --only-embedded runs only it

Printed per run: output tokens/s, p50 latency (s), requests; then per target the ratios auto / best fixed.
Goals: auto >= 0.95x the best fixed concurrency's tokens/s with p50 latency <= 1.5x its p50.
Measured over the whole S seconds for every run (auto's ramp from `concurrency.initial` included; the goals are
judged on these), and again, by the same rule for every arm, over the answers that ended in the second half of each
run (`second_half`: the best fixed level is chosen again there), which separates the ramp from the steady state.
`--quick` (test server only, about 15 s) is run by the test suite, which checks that the figures are printed and
sane, not the goals. Wall-clock figures depend on the machine's load (printed).
"""
from __future__ import annotations

import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
from _preamble import ROOT  # noqa: E402 - bench/ off sys.path, the repository root first, HF offline

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402

from regen.config.generate import ConcurrencyConfig, TimeoutConfig  # noqa: E402
from regen.generate.client import ChatClient  # noqa: E402


def start_server(settings: dict) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "regen.testing.openai_server", "--port", "0", "--settings",
                             json.dumps(settings)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"test server did not start: {line!r}")
    return proc, line.split("listening on", 1)[1].strip()


async def closed_loop(url: str, model: str, seconds: float, concurrency: int | None, max_tokens: int,
                      auto: ConcurrencyConfig | None) -> dict:
    """C workers (or, auto, as many as auto.max) each sending one request after another for `seconds`."""
    workers = concurrency or auto.max
    done: list[tuple[float, int, float]] = []  # (end s since the start, output tokens, latency_s) per answer
    timeouts = TimeoutConfig(first_byte=600, between_chunks=300, total=1200)
    async with ChatClient([url], max_in_flight=workers, auto=auto, timeouts=timeouts) as client:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        end = t0 + seconds

        async def worker(w: int) -> None:
            i = 0
            while loop.time() < end:
                i += 1
                body = {"model": model, "messages": [{"role": "user", "content": f"Tell me about item {w}-{i}."}],
                        "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
                try:
                    c = await client.complete(body)
                except Exception:  # a refused or failed attempt counts nothing
                    await asyncio.sleep(0.05)
                    continue
                if (now := loop.time()) <= end:
                    done.append((now - t0, c.num_completion_tokens or c.num_chunks, c.latency_s))

        await asyncio.gather(*[worker(w) for w in range(workers)])
        wall = loop.time() - t0
        limits = client.limits()
        history = client.limit_history()
    out = {"concurrency": concurrency or "auto", **figures(done, 0.0, seconds), "wall_s": round(wall, 1),
           "second_half": figures(done, seconds / 2, seconds)}
    if limits:
        h = next(iter(history.values()))
        out["final_limit"] = next(iter(limits.values()))
        out["limit_changes"] = len(h) - 1
        out["limit_path"] = [x[1] for x in h][:12]
    return out


def figures(done: list[tuple[float, int, float]], start: float, end: float) -> dict:
    """Output tokens/s and p50 latency of the answers that ended in [start, end] seconds of a run."""
    mine = [d for d in done if start <= d[0] <= end]
    lat = [d[2] for d in mine]
    return {"tok_s": round(sum(d[1] for d in mine) / (end - start), 1),
            "p50_latency_s": round(statistics.median(lat), 3) if lat else None, "requests": len(mine)}


def ratios_of(name: str, rows: list[dict], auto: dict) -> dict:
    """auto / the best fixed level (most tokens/s) under one measurement rule; the goals in this module's docstring."""
    best = max(rows, key=lambda r: r["tok_s"])
    out = {"target": name, "best_fixed": best["concurrency"], "best_tok_s": best["tok_s"], "auto_tok_s": auto["tok_s"],
           "tok_s_ratio": round(auto["tok_s"] / best["tok_s"], 3) if best["tok_s"] else None,
           "p50_ratio": (round(auto["p50_latency_s"] / best["p50_latency_s"], 3)
                         if auto["p50_latency_s"] and best["p50_latency_s"] else None)}
    out["goals_met"] = bool(out["tok_s_ratio"] and out["tok_s_ratio"] >= 0.95
                            and out["p50_ratio"] is not None and out["p50_ratio"] <= 1.5)
    return out


def sweep(name: str, url: str, model: str, levels: list[int], seconds: float, max_tokens: int,
          auto: ConcurrencyConfig) -> dict:
    rows = []
    for c in levels:
        r = asyncio.run(closed_loop(url, model, seconds, c, max_tokens, None))
        print(json.dumps({"target": name, **r, "load_avg": round(os.getloadavg()[0], 2)}), flush=True)
        rows.append(r)
    r = asyncio.run(closed_loop(url, model, seconds, None, max_tokens, auto))
    print(json.dumps({"target": name, **r, "load_avg": round(os.getloadavg()[0], 2)}), flush=True)
    ratios = ratios_of(name, rows, r)
    # the same rule for every arm: only answers that ended in the second half of each run
    ratios["second_half"] = ratios_of(name, [{"concurrency": x["concurrency"], **x["second_half"]} for x in rows],
                                      r["second_half"])
    del ratios["second_half"]["target"]
    print("RATIO " + json.dumps(ratios), flush=True)
    return ratios


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="test server only, short runs (the test suite's mode)")
    p.add_argument("--skip-embedded", action="store_true", help="leave out the embedded target (slow on CPU)")
    p.add_argument("--only-embedded", action="store_true", help="only the embedded target (about 6 minutes)")
    p.add_argument("--seconds", type=float, default=None, help="seconds per run (default 30; quick 2.5)")
    p.add_argument("--slots", type=int, default=32, help="decode slots of the test server")
    p.add_argument("--levels", default=None, help="fixed concurrencies, comma separated")
    args = p.parse_args(argv)
    seconds = args.seconds or (2.5 if args.quick else 30.0)
    slots = 8 if args.quick else args.slots
    levels = [int(x) for x in args.levels.split(",")] if args.levels else (
        [4, 8, 16, 32] if args.quick else [s for s in (slots // 4, slots // 2, slots, 2 * slots, 4 * slots) if s >= 1])
    auto = ConcurrencyConfig(initial=4, max=max(levels) * 2, min_window_s=0.25 if args.quick else 1.0,
                             metrics_poll_s=0.25 if args.quick else 0.5, min_samples=8 if args.quick else 16)
    print(json.dumps({"seconds_per_run": seconds, "slots": slots, "levels": levels, "cpus": os.cpu_count(),
                      "load_avg": round(os.getloadavg()[0], 2), "auto": auto.model_dump()}), flush=True)
    server = {"slots": slots, "itl_s": 0.004, "load_factor": 1.0, "prefill_s": 0.005, "tokens": 48,
              "reasoning_tokens": 48, "length_sigma": 0.6, "log": False}
    results = []
    for name, extra in () if args.only_embedded else (("slots", {}), ("slots+metrics", {"metrics": "vllm"})):
        proc, url = start_server({**server, **extra})
        try:
            results.append(sweep(name, url, "fake", levels, seconds, 4096, auto))
        finally:
            proc.terminate()
            proc.wait(10)
    if not (args.quick or args.skip_embedded):
        from regen.config import load_profile
        from regen.target.server import EmbeddedTarget, sampling

        local = load_profile("local")  # the main job's server settings and sampling
        emb_auto = ConcurrencyConfig(initial=2, max=32, min_window_s=5.0, metrics_poll_s=2.0, min_samples=8)
        with EmbeddedTarget(local.serve, sampling=sampling(local.generate)) as target:
            # 128-token answers: the main job's answers are longer still (p50 245 tokens), so decode dominates
            results.append(sweep("embedded", target.base_url, target.model, [1, 4, 8, 16, 32], max(seconds, 60.0),
                                 128, emb_auto))
    print("SUMMARY " + json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
