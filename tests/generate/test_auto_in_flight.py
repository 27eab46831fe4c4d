"""`max_in_flight: auto` through the real client and the test server's capacity model (slots, queue, /metrics)."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
from conftest import conversations, fast_config, write_prompts

from regen.generate.client import ChatClient
from regen.generate.concurrency import parse_gauges
from regen.generate.metrics import format_stats
from regen.generate.stage import _in_flight_arg, run_generate
from regen.testing.openai_server import ServerThread, Settings

VLLM = """# HELP vllm:num_requests_running x
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 3.0
vllm:num_requests_running{model_name="b"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="a"} 0.25
"""


@pytest.mark.parametrize("text, expected", [
    (VLLM, (5.0, 4.0, 0.25)),
    (VLLM.replace("kv_cache_usage_perc", "gpu_cache_usage_perc"), (5.0, 4.0, 0.25)),  # vLLM before v0.10
    (VLLM.replace("vllm:kv_cache_usage_perc", "other"), (5.0, 4.0, None)),
    ("sglang:num_running_reqs 7\nsglang:num_queue_reqs 1\nsglang:token_usage 0.5\n", (7.0, 1.0, 0.5)),
    ("process_cpu_seconds_total 12\n", None),  # a /metrics without serving gauges
    ("vllm:num_requests_running 3\n", None),  # running without waiting
    ("<html>not found</html>", None),
])
def test_parse_gauges(text, expected):
    assert parse_gauges(text) == expected


def test_in_flight_cli_value_and_progress_line():
    assert _in_flight_arg("auto") == "auto" and _in_flight_arg("12") == 12
    with pytest.raises(Exception, match="number of requests or auto"):
        _in_flight_arg("lots")
    snap = {"req_per_s": 2.0, "out_tok_per_s": 10.0, "failures": {}}
    assert "in flight 7/12 auto" in format_stats(snap, 7, 12)
    assert "auto" not in format_stats(snap, 7)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


@pytest.mark.integration
@pytest.mark.parametrize("names", ["vllm", "sglang"])
def test_capacity_model_queues_beyond_its_slots_and_shows_it_in_metrics(names):
    srv = ServerThread(Settings(slots=2, itl_s=0.01, tokens=40, reasoning_tokens=10, metrics=names, log=False))
    seen = []

    async def go():
        async with ChatClient([srv.base_url], max_in_flight=16) as c:
            async def one(i):
                body = {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}], "stream": True}
                return await c.complete(body)

            task = asyncio.gather(*[one(i) for i in range(6)])
            await asyncio.sleep(0.3)
            seen.append(await asyncio.to_thread(_get, srv.base_url.removesuffix("/v1") + "/metrics"))
            return await task

    try:
        results = asyncio.run(go())
    finally:
        srv.stop()
    status, text = seen[0]
    assert status == 200
    running, waiting, cache = parse_gauges(text)
    assert (running, waiting) == (2.0, 4.0) and cache == 1.0  # 2 slots busy, 4 queued
    assert all(r.reasoning_content and r.content for r in results)
    assert all(r.ttft_s < r.latency_s for r in results)  # streamed as decoded, not at once
    lat = sorted(r.latency_s for r in results)
    assert lat[-1] > 2 * lat[0]  # the last two waited for two rounds of slots


@pytest.mark.integration
def test_capacity_model_bounds_its_queue_and_lengths_are_long_tailed():
    srv = ServerThread(Settings(slots=1, itl_s=0.01, tokens=100, reasoning_tokens=0, max_waiting=1,
                                length_sigma=1.0, log=False))
    try:
        status, _ = _get(srv.base_url.removesuffix("/v1") + "/metrics")
        assert status == 404  # no metrics unless asked

        async def go():
            async with ChatClient([srv.base_url], max_in_flight=8) as c:
                async def one(i):
                    body = {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 100000}
                    try:
                        return (await c.complete(body)).num_completion_tokens
                    except Exception as exc:
                        return getattr(exc, "status", None)
                return await asyncio.gather(*[one(i) for i in range(4)])

        out = asyncio.run(go())
        assert out.count(503) == 2  # 1 running + 1 waiting; the others are refused at once
        srv.server.settings.max_waiting = None
        srv.server.settings.slots = 0
        lengths = [srv.server.answer({"model": "m", "messages": [{"role": "user", "content": str(i)}]})
                   for i in range(400)]
        n = sorted(len(a["content"]) for a in lengths)
        assert 70 < sum(n) / len(n) < 130 and n[-1] > 4 * n[len(n) // 2]  # mean kept, long right tail
    finally:
        srv.stop()


@pytest.mark.integration
@pytest.mark.parametrize("metrics", ["vllm", None])
def test_auto_adapts_each_endpoint_and_records_the_history(run_dir, metrics):
    small = ServerThread(Settings(slots=2, itl_s=0.002, tokens=20, reasoning_tokens=5, metrics=metrics, log=False))
    big = ServerThread(Settings(slots=24, itl_s=0.002, tokens=20, reasoning_tokens=5, metrics=metrics, log=False))
    try:
        write_prompts(run_dir, conversations(400))
        cfg = fast_config(max_in_flight="auto", concurrency={"initial": 4, "max": 64, "min_window_s": 0.2,
                                                             "metrics_poll_s": 0.1, "min_samples": 8})
        m = run_generate(cfg, run_dir, endpoints=[small.base_url, big.base_url], progress=False)
    finally:
        small.stop()
        big.stop()
    assert m["accounting"]["balanced"]
    limits = m["metrics"]["in_flight_limits"]
    assert set(limits) == {small.base_url, big.base_url}
    for h in limits.values():
        assert h["history"][0][1:] == [4, "initial"] or tuple(h["history"][0][1:]) == (4, "initial")
        assert all(1 <= lim <= 64 for _, lim, _ in h["history"])
    assert max(x[1] for x in limits[big.base_url]["history"]) > max(x[1] for x in limits[small.base_url]["history"])
    json.dumps(m)  # the history is stored in the manifest
