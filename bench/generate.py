"""Benchmark: regen's generation client vs a baseline written as a user would (AsyncOpenAI + a semaphore).

    .venv/bin/python bench/generate.py [--quick] [--requests N] [--concurrency C] [--tokens T] [--rss-in-flight M]

A local fake OpenAI server (regen.testing.openai_server, `fixed` mode: one pre-encoded answer of T content
tokens, one SSE event per token) runs in its own process and answers at once. Each client runs in its own
process, so its CPU time (resource.getrusage(RUSAGE_SELF), user + sys, measured around the run only) and
peak RSS (ru_maxrss) are its own. Clients, at the same concurrency:

  regen      `regen.generate.stage.run_generate` on N single-turn prompts: durability on (journal fsync per
             group, Parquet parts, manifest, accounting)
  transport  `regen.generate.client.ChatClient.complete` alone (no storage): the transport's own cost (aiohttp)
  httpx      raw `httpx.AsyncClient` + aiter_lines + orjson, no storage: the other HTTP stack, measured to choose
  baseline   `openai.AsyncOpenAI` + `asyncio.Semaphore`, results kept in a list and written as JSONL at the end

Printed per client and mode (stream / non-stream): requests/s, output tokens ingested per second per client
CPU core (tokens / client CPU seconds), CPU ms per request, peak RSS; then the ratios regen / baseline.
A last pass holds M requests in flight (the server waits 2 s before answering) and reports peak RSS.
Goals: regen >= baseline req/s with durability on; >= 50,000 streamed tokens/s/core; < 1.5 GiB RSS
at 4,096 in flight.
"""
from __future__ import annotations

import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
from _preamble import ROOT  # noqa: E402 - bench/ off sys.path, the repository root first, HF offline

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


def start_server(tokens: int, delay_s: float = 0.0) -> tuple[subprocess.Popen, str]:
    settings = {"tokens": tokens, "reasoning_tokens": 0, "fixed": True, "log": False, "delay_s": delay_s}
    proc = subprocess.Popen([sys.executable, "-m", "regen.testing.openai_server", "--port", "0", "--settings",
                             json.dumps(settings)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return proc, line.split("listening on", 1)[1].strip()


def _usage() -> tuple[float, int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime, ru.ru_maxrss * 1024


def _prompts(run_root: Path, n: int) -> None:
    import pyarrow as pa

    from regen.rundir import RunDir
    from schemas.io import write_json_atomic, write_parquet_atomic
    from schemas.prompt import PROMPT_SCHEMA, PromptRecord, prompt_id_of

    run = RunDir.at(run_root)
    rows = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"benchmark prompt number {i}"}]
        rows.append(PromptRecord(prompt_id_of(msgs, None), msgs, None, "general", "en", "bench", "bench", i).to_arrow_row())
    info = write_parquet_atomic(pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA), run.prompts / "part-00000.parquet",
                                PROMPT_SCHEMA)
    write_json_atomic({"parts": [info]}, run.prompts / "manifest.json")


def client_main(args) -> None:
    """One measurement in this (fresh) process; prints a JSON line."""
    stream = args.mode == "stream"
    n, c, url = args.requests, args.concurrency, args.url
    messages = lambda i: [{"role": "user", "content": f"benchmark prompt number {i}"}]  # noqa: E731
    tokens = 0
    peak = None  # requests in flight at once, where the client can tell
    if args.client == "regen":
        from regen.config.generate import GenerateConfig
        from regen.generate.stage import run_generate
        from regen.rundir import RunDir

        root = Path(tempfile.mkdtemp(prefix="regen-bench-")) / "run"
        _prompts(root, n)
        cfg = GenerateConfig(model="fake", max_in_flight=c, max_tokens=4096, stream=stream)
        cpu0, _ = _usage()
        t0 = time.perf_counter()
        m = run_generate(cfg, RunDir.at(root), endpoints=[url], progress=False)
        wall = time.perf_counter() - t0
        cpu1, rss = _usage()
        tokens = m["metrics"]["output_tokens"]
        peak = m["metrics"]["peak_in_flight"]
        assert m["accounting"]["generated"] == n, m["accounting"]
    elif args.client == "transport":
        from regen.generate.client import ChatClient

        async def go():
            nonlocal tokens, peak
            async with ChatClient([url], max_in_flight=c) as client:
                async def one(i):
                    body = {"model": "fake", "messages": messages(i), "max_tokens": 4096, "stream": stream}
                    if stream:
                        body["stream_options"] = {"include_usage": True}
                    return await client.complete(body)

                results = await asyncio.gather(*[one(i) for i in range(n)])
                tokens = sum(r.num_completion_tokens for r in results)
                peak = client.peak_in_flight

        cpu0, _ = _usage()
        t0 = time.perf_counter()
        asyncio.run(go())
        wall = time.perf_counter() - t0
        cpu1, rss = _usage()
    elif args.client == "httpx":
        import httpx
        import orjson

        async def go():
            nonlocal tokens
            limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
            async with httpx.AsyncClient(limits=limits, timeout=3600.0) as client:
                async def one(i):
                    body = {"model": "fake", "messages": messages(i), "max_tokens": 4096, "stream": stream}
                    if not stream:
                        r = await client.post(url + "/chat/completions", json=body)
                        return orjson.loads(r.content)["usage"]["completion_tokens"]
                    n_tok = 0
                    async with client.stream("POST", url + "/chat/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                                ch = orjson.loads(line[5:])["choices"]
                                n_tok += bool(ch and ch[0]["delta"].get("content"))
                    return n_tok

                tokens = sum(await asyncio.gather(*[one(i) for i in range(n)]))

        cpu0, _ = _usage()
        t0 = time.perf_counter()
        asyncio.run(go())
        wall = time.perf_counter() - t0
        cpu1, rss = _usage()
    else:
        from openai import AsyncOpenAI

        async def go():
            nonlocal tokens
            client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600.0)
            sem = asyncio.Semaphore(c)

            async def one(i):
                async with sem:
                    if stream:
                        parts = []
                        resp = await client.chat.completions.create(model="fake", messages=messages(i), max_tokens=4096,
                                                                    stream=True)
                        async for chunk in resp:
                            if chunk.choices and chunk.choices[0].delta.content:
                                parts.append(chunk.choices[0].delta.content)
                        return {"i": i, "content": "".join(parts), "tokens": len(parts)}
                    resp = await client.chat.completions.create(model="fake", messages=messages(i), max_tokens=4096)
                    return {"i": i, "content": resp.choices[0].message.content, "tokens": resp.usage.completion_tokens}

            results = await asyncio.gather(*[one(i) for i in range(n)])
            tokens = sum(r["tokens"] for r in results)
            with open(Path(tempfile.mkdtemp(prefix="baseline-")) / "out.jsonl", "w") as f:
                for r in results:
                    f.write(json.dumps(r) + "\n")
            await client.close()

        cpu0, _ = _usage()
        t0 = time.perf_counter()
        asyncio.run(go())
        wall = time.perf_counter() - t0
        cpu1, rss = _usage()
    cpu = cpu1 - cpu0
    print(json.dumps({"client": args.client, "mode": args.mode, "requests": n, "concurrency": c, "wall_s": wall,
                      "cpu_s": cpu, "tokens": tokens, "req_per_s": n / wall, "tok_per_cpu_s": tokens / max(cpu, 1e-9),
                      "cpu_ms_per_req": 1000 * cpu / n, "peak_rss_mib": rss / 2**20,
                      "peak_in_flight": peak}))


def measure(client: str, mode: str, url: str, n: int, c: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--client", client, "--mode", mode, "--url", url,
                          "--requests", str(n), "--concurrency", str(c)], capture_output=True, text=True, cwd=ROOT,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{client}/{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def fmt(r: dict) -> str:
    return (f"{r['client']:<9} {r['mode']:<6} {r['req_per_s']:>9.0f} req/s {r['tok_per_cpu_s']:>10.0f} tok/s/core "
            f"{r['cpu_ms_per_req']:>7.2f} CPU ms/req {r['peak_rss_mib']:>7.0f} MiB peak RSS  ({r['requests']} req, "
            f"{r['concurrency']} allowed in flight" + (f", {r['peak_in_flight']} reached" if r.get("peak_in_flight") else "")
            + f", {r['wall_s']:.1f} s)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None, help="content tokens (SSE events) per answer")
    parser.add_argument("--rss-in-flight", type=int, default=None)
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--url", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client_main(args)
        return 0
    n = args.requests or (300 if args.quick else 2000)
    c = args.concurrency or (64 if args.quick else 256)
    tokens = args.tokens or (64 if args.quick else 256)
    rss_n = args.rss_in_flight or (256 if args.quick else 4096)
    results = {}
    proc, url = start_server(tokens)
    try:
        print(f"server {url}: {tokens} tokens per answer, answers at once; {n} requests, {c} in flight")
        for mode in ("stream", "whole"):
            for client in ("baseline", "httpx", "transport", "regen"):
                r = results[(client, mode)] = measure(client, mode, url, n, c)
                print(fmt(r), flush=True)
    finally:
        proc.kill()
        proc.wait()
    for mode in ("stream", "whole"):
        b, g = results[("baseline", mode)], results[("regen", mode)]
        print(f"ratio regen/baseline {mode:<6}: req/s x{g['req_per_s'] / b['req_per_s']:.2f}, tok/s/core "
              f"x{g['tok_per_cpu_s'] / b['tok_per_cpu_s']:.2f}, CPU ms/req x{g['cpu_ms_per_req'] / b['cpu_ms_per_req']:.2f}")
    proc, url = start_server(16, delay_s=2.0)
    try:
        print(f"peak RSS with {rss_n} requests in flight (server waits 2 s before answering):")
        for client in ("baseline", "regen"):
            r = measure(client, "stream", url, rss_n, rss_n)
            print(fmt(r), flush=True)
            results[(client, "rss")] = r
    finally:
        proc.kill()
        proc.wait()
    g = results[("regen", "stream")]
    print("note: the baseline's AsyncOpenAI uses its default httpx pool (at most 1,000 connections), as a user's would")
    print(f"goals: streamed tok/s/core {g['tok_per_cpu_s']:.0f} (>= 50000: {g['tok_per_cpu_s'] >= 50000}); "
          f"regen req/s >= baseline (stream): {g['req_per_s'] >= results[('baseline', 'stream')]['req_per_s']}; "
          f"RSS at {rss_n} in flight {results[('regen', 'rss')]['peak_rss_mib']:.0f} MiB (< 1536: "
          f"{results[('regen', 'rss')]['peak_rss_mib'] < 1536})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
