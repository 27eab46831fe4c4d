"""Benchmark the embedded target (`transformers serve`, regen.serve.server.EmbeddedTarget): time to ready, server RSS,
and output tokens/s at 1 request in flight (the baseline) and at 8 and 16 concurrent requests.

    .venv/bin/python -P bench/serve_target.py [--quick] [--max-tokens 64] [--set serve.cb_num_blocks=64 ...]
    # the other prepared model (default: serve.model_dir's default, smollm2-135m)
    .venv/bin/python -P bench/serve_target.py --set serve.model_dir=data/models/gemma3-270m

Prints one JSON line per concurrency with `tok_s`, `ratio` (= tok_s / tok_s at concurrency 1, same run), the
server's CPU seconds per output token (robust to other load on a shared machine) and the load average.
Greedy decoding; each request asks for exactly `--max-tokens` tokens of a short user prompt (the server may stop
early at `<end_of_turn>`, the count is the server's `usage.completion_tokens`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import httpx
import psutil

from regen.config.serve import ServeConfig
from regen.serve.server import EmbeddedTarget

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash table works.",
    "List five uses of copper.",
    "Translate 'good morning' into French and German.",
    "What is the capital of Australia, and why?",
    "Describe the water cycle for a child.",
    "Give three tips for writing clear code.",
    "Summarize the plot of Hamlet.",
]


async def _one(client: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int) -> int:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + f" ({i})"}]}
    r = await client.post(url, json=body, timeout=600)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


async def _round(target: EmbeddedTarget, concurrency: int, num_requests: int, max_tokens: int) -> dict:
    url = target.base_url + "/chat/completions"
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient() as client:
        async def run(i):
            async with sem:
                return await _one(client, url, target.model, i, max_tokens)

        proc = psutil.Process(target.pid)
        cpu0 = sum(proc.cpu_times()[:2])
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(run(i) for i in range(num_requests)))
        wall = time.perf_counter() - t0
        cpu = sum(proc.cpu_times()[:2]) - cpu0
    # server CPU seconds per output token: less sensitive than tokens/s to other load on a shared machine
    return {"concurrency": concurrency, "requests": num_requests, "tokens": sum(tokens), "wall_s": round(wall, 2),
            "tok_s": round(sum(tokens) / wall, 2), "server_cpu_s_per_token": round(cpu / max(1, sum(tokens)), 3),
            "load_avg": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="concurrency 1 and 4 only, 16 tokens")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--set", dest="overrides", action="append", default=[], help="serve.KEY=VALUE")
    args = p.parse_args()
    fields = {}
    from regen.config import parse_override

    for o in args.overrides:
        k, v = parse_override(o)
        fields[k.removeprefix("serve.")] = v
    cfg = ServeConfig(**fields)
    levels = [1, 4] if args.quick else [1, 8, 16]
    max_tokens = 16 if args.quick else args.max_tokens
    t0 = time.perf_counter()
    with EmbeddedTarget(cfg) as target:
        print(json.dumps({"ready_s": round(time.perf_counter() - t0, 1), "model": target.model, "load_avg": os.getloadavg()[0],
                          "cb_num_blocks": cfg.cb_num_blocks, "cb_max_batch_tokens": cfg.cb_max_batch_tokens}))
        base = None
        for c in levels:
            res = asyncio.run(_round(target, c, max(2, c * 2) if c > 1 else 3, max_tokens))
            base = base or res["tok_s"]
            res["ratio"] = round(res["tok_s"] / base, 2)
            res["server_rss_mb"] = round(psutil.Process(target.pid).memory_info().rss / 2**20)
            print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
