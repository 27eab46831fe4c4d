"""The client against a real local OpenAI-compatible server that injects faults (regen.testing.openai_server)."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import pyarrow.parquet as pq
import pytest
from conftest import TOOLS, conversations, fast_config, write_prompts

from regen.config.generate import HealthConfig, TimeoutConfig
from regen.errors import InputError
from regen.generate import ledger
from regen.generate.checks import PERMANENT, QUALITY_CLASSES, TRANSIENT
from regen.generate.client import ChatClient
from regen.generate.stage import run_generate
from regen.report.query import query
from regen.testing.openai_server import ServerThread, Settings

pytestmark = pytest.mark.timeout(120)


def rows_of(run) -> list[dict]:
    out = []
    for p in ledger.part_paths(run.generations):
        out.extend(pq.read_table(p).to_pylist())
    return out


def control(server, **settings):
    req = urllib.request.Request(server.base_url.removesuffix("/v1") + "/_control", data=json.dumps(settings).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req).read()


FAULT_MIX = {k: 0.2 / 14 for k in ("429", "500", "503", "400", "overflow", "stall", "close", "malformed", "empty",
                                    "empty_content", "truncated", "leak", "unbalanced", "bad_tool_json")}


@pytest.mark.parametrize("stream", [True, False])
def test_twenty_percent_faults_every_unit_ends_as_exactly_one_row(server, run_dir, stream):
    control(server, faults={**FAULT_MIX, **({"stall_stream": 0.01} if stream else {})}, seed=7)
    write_prompts(run_dir, conversations(120))
    cfg = fast_config(stream=stream, timeouts={"first_byte": 0.5, "between_chunks": 0.3})
    manifest = run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False)
    acc = manifest["accounting"]
    assert acc["balanced"], acc
    assert acc["generated"] + acc["error"] + acc["skipped"] == acc["units"] == 240
    rows = rows_of(run_dir)
    keys = [(r["prompt_id"], r["turn"]) for r in rows]
    assert len(keys) == len(set(keys)) == 240
    log = server.server.log
    faults = [e["fault"] for e in log if e["fault"]]
    assert 0.12 < len(faults) / len(log) < 0.3  # the mix really was ~20% faulty
    errors = [r for r in rows if r["status"] == "error"]
    assert errors, "permanent faults must give error rows"
    allowed = set(TRANSIENT) | set(PERMANENT) | set(QUALITY_CLASSES)
    assert all(r["error_class"] in allowed for r in errors)
    assert {r["error_class"] for r in errors} >= {"bad_request", "context_overflow"}
    for r in rows:
        if r["status"] == "ok":
            assert r["content"] and r["finish_reason"] in ("stop", "tool_calls") and r["attempts"] >= 1
        if r["status"] == "skipped":
            assert r["stop_reason"] == "previous_turn_error"
    assert any(r["flags"] == ["reasoning_leak"] for r in rows if r["status"] == "ok")  # keep_flagged default
    assert max(r["attempts"] for r in rows) > 1
    cols, out = query(run_dir.root, "SELECT status, error_class, finish_reason, num_completion_tokens, latency_s "
                                    "FROM generations LIMIT 1")
    assert cols == ["status", "error_class", "finish_reason", "num_completion_tokens", "latency_s"] and out


EXPECTED = {
    "429": "rate_limited", "500": "server_error", "503": "server_error", "400": "bad_request",
    "overflow": "context_overflow", "stall": "timeout", "stall_stream": "timeout", "close": "connection",
    "malformed": "malformed", "empty": "empty_body", "empty_content": "empty_content", "truncated": "truncated",
    "unbalanced": "unbalanced_think", "bad_tool_json": "invalid_tool_args",
}


@pytest.mark.parametrize("stream", [True, False])
def test_each_fault_kind_has_its_own_class(server, run_dir, stream):
    kinds = [k for k in EXPECTED if stream or k != "stall_stream"] + ["leak"]
    convs = [([{"role": "user", "content": f"q [[fault:{k}]]"}], None) for k in kinds]
    records = write_prompts(run_dir, convs)
    cfg = fast_config(stream=stream, retry={"max_attempts": 2},
                      timeouts={"first_byte": 0.5, "between_chunks": 0.3})
    manifest = run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False)
    by_prompt = {r["prompt_id"]: r for r in rows_of(run_dir)}
    # what the first failure of each transport class said, for a user who sees only counts in the progress line
    examples, failures = manifest["metrics"]["failure_examples"], manifest["metrics"]["failures_by_class"]
    assert set(examples) <= set(failures) and {"connection", "timeout", "rate_limited", "server_error"} <= set(examples)
    assert examples["rate_limited"] == "HTTP 429: injected 429" and examples["connection"].endswith(server.base_url)
    assert "timeout at " in examples["timeout"]
    sent = {}
    for e in server.server.log:
        sent[e["key"]] = sent.get(e["key"], 0) + 1
    for kind, rec in zip(kinds, records):
        row = by_prompt[rec.prompt_id]
        if kind == "leak":
            assert row["status"] == "ok" and row["flags"] == ["reasoning_leak"]
            continue
        assert (row["status"], row["error_class"]) == ("error", EXPECTED[kind]), kind
        permanent = EXPECTED[kind] in PERMANENT
        assert row["attempts"] == sent[row["request_key"]] == (1 if permanent else 2), kind


def test_policies_from_the_profile_drop_and_keep_flagged(server, run_dir):
    convs = [([{"role": "user", "content": "q [[fault:empty_content]]"}], None),
             ([{"role": "user", "content": "q [[fault:unbalanced]]"}], None)]
    write_prompts(run_dir, convs)
    cfg = fast_config(policies={"empty_content": "drop", "unbalanced_think": "keep_flagged"})
    run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False)
    rows = sorted(rows_of(run_dir), key=lambda r: r["status"])
    assert [(r["status"], r["error_class"], r["attempts"], r["flags"]) for r in rows] == [
        ("error", "empty_content", 1, ["empty_content"]), ("ok", None, 1, ["unbalanced_think"])]


def test_truncated_is_retried_with_a_larger_budget(server, run_dir):
    control(server, tokens=8, reasoning_tokens=4)
    write_prompts(run_dir, [([{"role": "user", "content": "long"}], None)])
    run_generate(fast_config(max_tokens=5), run_dir, endpoints=[server.base_url], progress=False)
    (row,) = rows_of(run_dir)
    assert [e["body"]["max_tokens"] for e in server.server.log] == [5, 10, 20]
    assert (row["status"], row["attempts"], row["finish_reason"]) == ("ok", 3, "stop")


def test_reasoning_field_and_token_ids_are_stored(server, run_dir, tmp_path):
    from regen.rundir import RunDir

    for i, (field, stream) in enumerate([("reasoning", True), ("reasoning", False), ("reasoning_content", True)]):
        control(server, reasoning_field=field, tokens=6, reasoning_tokens=3)
        run = RunDir.at(tmp_path / f"r{i}")
        write_prompts(run, [([{"role": "user", "content": "hello there"}], None)])
        run_generate(fast_config(stream=stream, return_token_ids=True), run, endpoints=[server.base_url], progress=False)
        (row,) = rows_of(run)
        assert len(row["reasoning_content"].split()) == 3 and len(row["content"].split()) == 6
        assert len(row["completion_token_ids"]) == 9 == row["num_completion_tokens"]
        assert row["prompt_token_ids"] and row["num_reasoning_tokens"] == 3


def test_a_server_that_rejects_unknown_fields_works_unless_they_are_opted_in(server, run_dir, tmp_path):
    from regen.rundir import RunDir

    control(server, strict=True)
    write_prompts(run_dir, conversations(4))
    m = run_generate(fast_config(), run_dir, endpoints=[server.base_url], progress=False)
    assert m["accounting"]["generated"] == m["accounting"]["units"]
    run2 = RunDir.at(tmp_path / "opt-in")
    write_prompts(run2, conversations(4))
    m = run_generate(fast_config(return_token_ids=True), run2, endpoints=[server.base_url], progress=False)
    assert m["accounting"]["balanced"] and m["metrics"]["error_rows_by_class"]["bad_request"] == 4


def test_tool_result_mismatch_stops_the_conversation_keeping_what_was_generated(server, run_dir):
    messages = [{"role": "user", "content": "find it"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "other_tool", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
                {"role": "assistant", "content": "it is 42"}, {"role": "user", "content": "thanks"}]
    write_prompts(run_dir, [(messages, TOOLS)])
    m = run_generate(fast_config(), run_dir, endpoints=[server.base_url], progress=False)
    rows = sorted(rows_of(run_dir), key=lambda r: r["turn"])
    assert [(r["turn"], r["status"], r["stop_reason"]) for r in rows] == [
        (0, "ok", "tool_result_mismatch"), (1, "skipped", "tool_result_mismatch"), (2, "skipped", "tool_result_mismatch")]
    assert rows[0]["tool_calls"][0]["function"]["name"] == "search"
    assert m["accounting"] == {**m["accounting"], "generated": 1, "skipped": 2, "balanced": True}


def test_multi_turn_history_is_the_regenerated_one(server, run_dir):
    messages = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "OLD-1"},
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "OLD-2"}]
    write_prompts(run_dir, [(messages, None)])
    run_generate(fast_config(), run_dir, endpoints=[server.base_url], progress=False)
    r0, r1 = sorted(rows_of(run_dir), key=lambda r: r["turn"])
    sent = server.server.log[1]["body"]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[1]["content"] == r0["content"] and sent[1]["reasoning_content"] == r0["reasoning_content"]
    assert "OLD" not in json.dumps(sent) and r1["messages"][1]["content"] == r0["content"]


def test_consecutive_user_turns_are_answered_one_by_one(server, run_dir):
    """An MT-Bench `turns` row (two user messages, no answers): turn 1 is answered, then asked with turn 2."""
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "user", "content": "Now name a fruit of that colour."}]
    write_prompts(run_dir, [(messages, None)])
    m = run_generate(fast_config(), run_dir, endpoints=[server.base_url], progress=False)
    r0, r1 = sorted(rows_of(run_dir), key=lambda r: r["turn"])
    assert (r0["status"], r1["status"]) == ("ok", "ok") and m["accounting"]["units"] == 2
    assert [mm["content"] for mm in r0["messages"]] == ["Name a colour."]
    assert [mm["role"] for mm in r1["messages"]] == ["user", "assistant", "user"]
    assert r1["messages"][1]["content"] == r0["content"] and r1["messages"][2]["content"] == messages[1]["content"]


@pytest.mark.integration
def test_api_key_is_sent_but_never_written(tmp_path, run_dir, monkeypatch):
    secret = "sk-test-SECRET-9f8e7d6c5b4a"
    monkeypatch.setenv("REGEN_TEST_KEY", secret)
    with ServerThread(Settings(api_key=secret)) as srv:
        write_prompts(run_dir, conversations(6))
        m = run_generate(fast_config(api_key_env="REGEN_TEST_KEY"), run_dir, endpoints=[srv.base_url], progress=False)
        assert m["accounting"]["generated"] == m["accounting"]["units"]
        assert all(e["status"] == 200 for e in srv.server.log)
        monkeypatch.setenv("REGEN_TEST_KEY", "wrong-key")
        from regen.rundir import RunDir

        run2 = RunDir.at(tmp_path / "bad")
        write_prompts(run2, conversations(6))
        with pytest.raises(InputError, match="API key"):
            run_generate(fast_config(api_key_env="REGEN_TEST_KEY"), run2, endpoints=[srv.base_url], progress=False)
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_retry_after_cools_the_endpoint_down(server, run_dir):
    control(server, retry_after="0.4")
    write_prompts(run_dir, [([{"role": "user", "content": "x [[fault:429]]"}], None)])
    cfg = fast_config(retry={"max_attempts": 3, "max_retry_after_s": 5})
    run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False)
    times = [e["t"] for e in server.server.log]
    assert len(times) == 3 and all(b - a >= 0.39 for a, b in zip(times, times[1:]))


@pytest.mark.integration
def test_least_outstanding_routing_and_health_checks():
    async def scenario(a, b):
        health = HealthConfig(fail_threshold=2, interval_s=0.1, max_wait_s=5)
        async with ChatClient([a.base_url, b.base_url], max_in_flight=64, health=health,
                              timeouts=TimeoutConfig(first_byte=5, total=10)) as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
            await asyncio.gather(*[client.complete(body) for _ in range(40)])
            counts = [e.num_requests for e in client.pool.endpoints]
            assert min(counts) >= 10  # both used (least outstanding spreads concurrent requests)
            a.server.settings.down = True
            await asyncio.gather(*[client.complete(body) for _ in range(30)], return_exceptions=True)
            ep_a, ep_b = client.pool.endpoints
            assert not ep_a.healthy  # taken out after fail_threshold consecutive failures
            before_a, before_b = ep_a.num_requests, ep_b.num_requests
            await asyncio.gather(*[client.complete(body) for _ in range(20)])  # all succeed, on b
            assert ep_a.num_requests == before_a and ep_b.num_requests == before_b + 20
            a.server.settings.down = False
            for _ in range(50):
                await asyncio.sleep(0.1)
                if ep_a.healthy:
                    break
            assert ep_a.healthy
            before = ep_a.num_requests
            await asyncio.gather(*[client.complete(body) for _ in range(20)])
            assert ep_a.num_requests > before

    with ServerThread(Settings(delay_s=0.02)) as a, ServerThread(Settings(delay_s=0.02)) as b:
        asyncio.run(scenario(a, b))


def test_bounded_in_flight(server):
    async def scenario():
        async with ChatClient([server.base_url], max_in_flight=5) as client:
            peak = 0

            async def one():
                nonlocal peak
                task = asyncio.create_task(client.complete({"model": "m", "messages": [], "stream": True}))
                while not task.done():
                    peak = max(peak, client.in_flight)
                    await asyncio.sleep(0.005)
                return await task

            await asyncio.gather(*[one() for _ in range(30)])
            return peak

    control(server, delay_s=0.05)
    assert asyncio.run(scenario()) == 5


def test_a_storm_of_429s_cools_down_instead_of_hammering(server, run_dir):
    """The first 48 requests get 429 + Retry-After 0.25: after each 429 the endpoint pauses (only requests
    already in flight arrive within the next 0.25 s) and its concurrency halves; every unit still ends ok."""
    control(server, faults={"429": 1.0}, fault_budget=48, retry_after="0.25")
    write_prompts(run_dir, [([{"role": "user", "content": f"storm {i}"}], None) for i in range(64)])
    cfg = fast_config(max_in_flight=32, retry={"max_attempts": 20, "max_retry_after_s": 1.0})
    m = run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False)
    failed = [(r["error_class"], r["error_detail"], r["attempts"]) for r in rows_of(run_dir) if r["status"] != "ok"]
    assert m["accounting"]["generated"] == 64, failed
    log = server.server.log
    storm = [e for e in log if e["status"] == 429]
    assert len(storm) == 48 and m["metrics"]["endpoints"][0]["rate_limited"] == 48
    t = storm[0]["t"]
    assert sum(t < e["t"] < t + 0.24 for e in log) <= 32  # only what was already in flight


OVERFLOW_KINDS = {"overflow": "context_overflow", "overflow_vllm": "context_overflow",
                  "overflow_vllm_legacy": "context_overflow", "overflow_sglang": "context_overflow",
                  "overflow_sglang_input": "context_overflow", "overflow_413": "context_overflow",
                  "400_vllm": "bad_request", "400": "bad_request"}


@pytest.mark.parametrize("stream", [True, False])
def test_context_overflow_in_each_servers_wording_is_its_own_class_with_the_message_kept(server, run_dir, stream):
    kinds = list(OVERFLOW_KINDS)
    records = write_prompts(run_dir, [([{"role": "user", "content": f"q [[fault:{k}]]"}], None) for k in kinds])
    run_generate(fast_config(stream=stream), run_dir, endpoints=[server.base_url], progress=False)
    by_prompt = {r["prompt_id"]: r for r in rows_of(run_dir)}
    for kind, rec in zip(kinds, records):
        row = by_prompt[rec.prompt_id]
        assert (row["status"], row["error_class"], row["attempts"]) == ("error", OVERFLOW_KINDS[kind], 1), kind
        assert row["error_detail"].startswith("HTTP 413: <html>" if kind == "overflow_413" else "HTTP 400: "), kind
    detail = by_prompt[records[kinds.index("overflow_vllm")].prompt_id]["error_detail"]
    assert "maximum context length is 32768 tokens. However, you requested 40000 tokens" in detail


def test_error_detail_from_the_server_is_bounded_and_redacted(server, run_dir):
    control(server, error_message="context length exceeded; caller sent Authorization: Bearer sk-live-abcdefgh123 "
                                  + "and more " * 200)
    write_prompts(run_dir, [([{"role": "user", "content": "q [[fault:overflow_vllm]]"}], None)])
    run_generate(fast_config(), run_dir, endpoints=[server.base_url], progress=False)
    (row,) = rows_of(run_dir)
    assert row["error_class"] == "context_overflow"
    assert "sk-live" not in row["error_detail"] and "[redacted]" in row["error_detail"]
    assert len(row["error_detail"]) < 330
