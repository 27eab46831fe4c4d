"""Pure functions of the regeneration client: classes, checks, turns, keys, backoff, the ledger."""
from __future__ import annotations

import asyncio
import json

import pyarrow.parquet as pq
import pytest

from regen.config.generate import GenerateConfig, RetryConfig
from regen.errors import InputError
from regen.generate import ledger
from regen.generate.checks import Completion, check_completion, classify_status
from regen.generate.client import backoff_delay, parse_retry_after
from regen.generate.conversation import fill_missing_call_ids, next_segment, request_body, request_key, turn_positions
from regen.generate.stage import resolve_endpoints


@pytest.mark.parametrize("status,code,klass", [
    (429, None, "rate_limited"), (500, None, "server_error"), (503, None, "server_error"), (502, None, "server_error"),
    (400, None, "bad_request"), (422, None, "bad_request"), (404, None, "bad_request"), (413, None, "context_overflow"),
    (400, "context_length_exceeded", "context_overflow"), (401, None, "auth"), (403, None, "auth"), (408, None, "timeout"),
])
def test_classify_status(status, code, klass):
    assert classify_status(status, code) == klass


@pytest.mark.parametrize("completion,classes", [
    (Completion(content="fine", finish_reason="stop"), []),
    (Completion(empty_body=True), ["empty_body"]),
    (Completion(content="", finish_reason="length", reasoning_content="long thought"), ["truncated", "empty_content"]),
    (Completion(content="  ", finish_reason="stop"), ["empty_content"]),
    (Completion(content="", finish_reason="tool_calls",
                tool_calls=[{"function": {"name": "f", "arguments": "{\"a\": 1}"}}]), []),
    (Completion(content="", finish_reason="tool_calls", tool_calls=[{"function": {"name": "f", "arguments": "{oops"}}]),
     ["invalid_tool_args"]),
    (Completion(content="", finish_reason="tool_calls", tool_calls=[{"function": {"name": "f", "arguments": "[1, 2]"}}]),
     ["invalid_tool_args"]),
    (Completion(content="<think>x</think> answer", finish_reason="stop"), ["reasoning_leak"]),
    (Completion(content="answer </think>", finish_reason="stop"), ["unbalanced_think"]),
    (Completion(content="answer", finish_reason="stop", reasoning_content="<think> open"), ["unbalanced_think"]),
])
def test_check_completion(completion, classes):
    assert check_completion(completion) == classes


def test_turn_positions_cover_every_assistant_and_a_final_user_or_tool():
    u, a, t = {"role": "user"}, {"role": "assistant"}, {"role": "tool"}
    assert turn_positions([u]) == [1]
    assert turn_positions([{"role": "system"}, u, a]) == [2]
    assert turn_positions([u, a, u]) == [1, 3]
    assert turn_positions([u, a, t]) == [1, 3]
    assert turn_positions([{"role": "system"}]) == []


def test_consecutive_user_turns_are_answered_turn_by_turn():
    """MT-Bench `turns` rows are consecutive user messages: each gets its own answer."""
    u, a, t = {"role": "user"}, {"role": "assistant"}, {"role": "tool"}
    assert turn_positions([u, u]) == [1, 2]
    assert turn_positions([u, u, u]) == [1, 2, 3]
    assert turn_positions([u, u, a, u, a]) == [1, 2, 4]
    assert turn_positions([{"role": "system"}, u, u, a]) == [2, 3]
    assert turn_positions([u, a, t, t]) == [1, 4]  # parallel tool results are not split
    assert turn_positions([u, a, t, u]) == [1, 3, 4]  # a tool result the user follows is answered first
    q1, q2, q3 = ({"role": "user", "content": c} for c in ("Name a colour.", "Now a fruit of that colour.", "Why?"))
    original = [q1, q2, q3]
    pos = turn_positions(original)
    history = original[: pos[0]]
    assert history == [q1]
    for k, answer in enumerate(("Red.", "A cherry.")):
        assistant = {"role": "assistant", "content": answer}
        history = history + [assistant] + next_segment(original, pos, k, assistant)
    assert [m["content"] for m in history] == ["Name a colour.", "Red.", "Now a fruit of that colour.", "A cherry.",
                                               "Why?"]
    # a recorded answer in the middle is replaced, not kept beside the regenerated one
    original = [q1, q2, {"role": "assistant", "content": "old"}, q3]
    pos = turn_positions(original)
    assert pos == [1, 2, 4]
    assert next_segment(original, pos, 0, {"content": "x"}) == [q2]
    assert next_segment(original, pos, 1, {"content": "y"}) == [q3]


def test_filled_call_ids_are_unique_within_the_conversation():
    rec = [{"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    original = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": rec},
                {"role": "tool", "tool_call_id": "call_0", "content": "r"}, {"role": "user", "content": "again"}]
    first = {"tool_calls": [{"function": {"name": "f"}}, {"function": {"name": "f"}}]}
    fill_missing_call_ids(first, original, 1)
    ids = [tc["id"] for tc in first["tool_calls"]]
    assert ids[0] == "call_0" and len(set(ids)) == 2
    second = {"tool_calls": [{"function": {"name": "f"}}, {"id": "dup", "function": {"name": "f"}},
                             {"id": "dup", "function": {"name": "f"}}]}
    fill_missing_call_ids(second, original, 4)  # an inserted turn: no recorded call, server sent no or repeated ids
    ids2 = [tc["id"] for tc in second["tool_calls"]]
    assert len(set(ids2)) == 3 and not set(ids2) & set(ids) and "call_0" not in ids2


def test_next_segment_rewrites_tool_ids_and_stops_on_mismatch():
    original = [{"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [{"id": "old", "type": "function",
                                                      "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "old", "content": "r"}, {"role": "assistant", "content": "done"}]
    pos = turn_positions(original)
    same = {"tool_calls": [{"id": "new", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}
    seg = next_segment(original, pos, 0, same)
    assert seg == [{"role": "tool", "tool_call_id": "new", "content": "r"}]
    assert next_segment(original, pos, 0, {"tool_calls": [{"id": "n", "function": {"name": "g"}}]}) is None
    assert next_segment(original, pos, 0, {"content": "no call"}) is None
    two = {"tool_calls": same["tool_calls"] * 2}
    assert next_segment(original, pos, 0, two) is None


def test_request_key_changes_with_everything_that_changes_the_answer():
    cfg = GenerateConfig(model="m")
    msgs = [{"role": "user", "content": "hi"}]
    k = request_key("p", 0, cfg, msgs, None)
    assert k == request_key("p", 0, cfg.model_copy(update={"stream": False}), msgs, None)  # stream does not count
    others = [
        request_key("p", 1, cfg, msgs, None), request_key("q", 0, cfg, msgs, None),
        request_key("p", 0, cfg, [{"role": "user", "content": "hi!"}], None),
        request_key("p", 0, cfg, msgs, [{"type": "function", "function": {"name": "f"}}]),
        request_key("p", 0, cfg.model_copy(update={"model": "m2"}), msgs, None),
        request_key("p", 0, cfg.model_copy(update={"temperature": 0.5}), msgs, None),
        request_key("p", 0, cfg.model_copy(update={"seed": 1}), msgs, None),
        request_key("p", 0, cfg.model_copy(update={"extra_body": {"thinking": True}}), msgs, None),
    ]
    assert len({k, *others}) == len(others) + 1


def test_request_body_sends_optional_fields_only_when_configured():
    msgs = [{"role": "user", "content": "hi"}]
    body = request_body(GenerateConfig(model="m"), msgs, None)
    assert "seed" not in body and "return_token_ids" not in body and "tools" not in body
    kimi = GenerateConfig(model="k", seed=3, return_token_ids=True, extra_body={"thinking": True, "thinking_effort": "max"})
    body = request_body(kimi, msgs, [{"type": "function"}])
    assert body["seed"] == 3 and body["return_token_ids"] is True and body["thinking_effort"] == "max"
    assert body["stream_options"] == {"include_usage": True} and body["tools"]


def test_backoff_is_jittered_exponential_and_honours_retry_after():
    cfg = RetryConfig(base_s=1, max_s=8, max_retry_after_s=30)
    for attempt, hi in ((1, 1), (2, 2), (3, 4), (4, 8), (9, 8)):
        d = [backoff_delay(attempt, cfg) for _ in range(50)]
        assert all(hi / 2 <= x <= hi for x in d) and len(set(d)) > 1
    assert backoff_delay(1, cfg, retry_after_s=12) >= 12
    assert backoff_delay(1, cfg, retry_after_s=1000) <= 45
    assert parse_retry_after("2") == 2 and parse_retry_after("0.5") == 0.5 and parse_retry_after("junk") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0


def test_resolve_endpoints_names_the_problem(monkeypatch):
    monkeypatch.delenv("REGEN_TEST_EP", raising=False)
    with pytest.raises(InputError, match="REGEN_TEST_EP"):
        resolve_endpoints(GenerateConfig(endpoints=["${REGEN_TEST_EP}"]), None)
    monkeypatch.setenv("REGEN_TEST_EP", "http://a:1/v1,http://b:2/v1/")
    assert resolve_endpoints(GenerateConfig(endpoints=["${REGEN_TEST_EP}"]), None) == ["http://a:1/v1", "http://b:2/v1"]
    with pytest.raises(InputError, match="--endpoint"):
        resolve_endpoints(GenerateConfig(), None)


def test_policy_names_are_validated():
    with pytest.raises(ValueError, match="retry_larger"):
        GenerateConfig(policies={"truncated": "ignore"})
    with pytest.raises(ValueError, match="unknown quality class"):
        GenerateConfig(policies={"nonsense": "drop"})


def _row(key, pid="p", turn=0):
    return {"request_key": key, "prompt_id": pid, "turn": turn, "status": "ok", "finished_at": 0, "flags": []}


def test_ledger_rows_are_durable_on_append_and_recovered_after_a_crash(tmp_path):
    async def write():
        led = await ledger.Ledger(tmp_path, "w0", part_rows=3).start()
        await led.append([_row("a"), _row("b", turn=1)])
        await led.append([_row("c", turn=2), _row("d", turn=3)])  # 4 rows >= 3: a part
        await led.append([_row("e", turn=4)])
        led._task.cancel()  # simulate a kill: no close(), the last row only in the journal

    asyncio.run(write())
    assert [p.name for p in ledger.part_paths(tmp_path)] == ["part-w0-00000.parquet"]
    with open(tmp_path / "journal-w0.jsonl", "ab") as f:
        f.write(json.dumps(_row("torn")).encode()[:20])  # a torn last line: never acknowledged
    # a part renamed but not yet listed in the ledger (kill between rename and the ledger line)
    (tmp_path / "ledger-w0.jsonl").write_bytes(b"")
    report = ledger.recover(tmp_path)
    assert report == {"parts_adopted": 1, "journal_rows_recovered": 1}
    keys = sorted(ledger.read_index(tmp_path).column("request_key").to_pylist())
    assert keys == ["a", "b", "c", "d", "e"]
    assert not list(tmp_path.glob("journal-*"))
    assert set(ledger.listed_parts(tmp_path)) == {p.name for p in ledger.part_paths(tmp_path)}
    assert ledger.recover(tmp_path) == {"parts_adopted": 0, "journal_rows_recovered": 0}


def test_recover_drops_journal_rows_already_in_a_part(tmp_path):
    async def write():
        led = await ledger.Ledger(tmp_path, "w0", part_rows=2).start()
        await led.append([_row("a"), _row("b", turn=1)])
        led._task.cancel()

    asyncio.run(write())
    # kill between the part's ledger line and the journal truncation: the journal still holds a and b
    (tmp_path / "journal-w0.jsonl").write_bytes(b"".join(json.dumps(_row(k)).encode() + b"\n" for k in "ab"))
    ledger.recover(tmp_path)
    assert sorted(ledger.read_index(tmp_path).column("request_key").to_pylist()) == ["a", "b"]
    assert sum(pq.read_metadata(p).num_rows for p in ledger.part_paths(tmp_path)) == 2


def test_odd_server_fields_are_normalized_or_malformed():
    from regen.generate.checks import RequestFailure
    from regen.generate.wire import normalize as _normalize

    c = _normalize(Completion(content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                              tool_calls=[{"id": "x", "index": 0, "function": {"name": "f", "arguments": {"k": 1}}}],
                              usage={"prompt_tokens": "7", "completion_tokens": 3}, finish_reason="tool_calls"))
    assert c.content == "ab" and c.tool_calls == [{"id": "x", "type": "function",
                                                   "function": {"name": "f", "arguments": '{"k":1}'}}]
    assert c.usage == {"completion_tokens": 3} and check_completion(c) == []
    with pytest.raises(RequestFailure) as exc:
        _normalize(Completion(content="x", completion_token_ids=["a"]))
    assert exc.value.error_class == "malformed"


VLLM_MSG = ("This model's maximum context length is 32768 tokens. However, you requested 40000 tokens "
            "(39000 in the messages, 1000 in the completion).")


@pytest.mark.parametrize("status,body,klass", [
    (400, {"error": {"message": VLLM_MSG, "type": "BadRequestError", "code": 400}}, "context_overflow"),
    (400, {"object": "error", "message": VLLM_MSG, "type": "BadRequestError", "code": 400}, "context_overflow"),
    (400, {"object": "error", "message": "Requested token count exceeds the model's maximum context length of 32768 "
           "tokens.", "type": "BadRequestError", "code": "400"}, "context_overflow"),
    (400, {"object": "error", "message": "The input (40000 tokens) is longer than the model's context length "
           "(32768 tokens).", "code": 400}, "context_overflow"),
    (422, {"error": "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 5000",
           "error_type": "validation"}, "context_overflow"),
    (400, {"error": {"message": "whatever", "code": "context_length_exceeded"}}, "context_overflow"),
    (400, {"error": {"message": "temperature must be non-negative, got -1.0.", "code": 400}}, "bad_request"),
    (400, {"detail": "max_tokens must be at least 1, got 0."}, "bad_request"),
    (500, {"error": {"message": VLLM_MSG, "code": 500}}, "server_error"),  # the status decides the family
    (404, {"error": {"message": "The model `x` does not exist (maximum context length unknown)"}}, "bad_request"),
])
def test_classify_by_status_and_error_structure(status, body, klass):
    from regen.generate.checks import error_object

    err = error_object(body)
    assert classify_status(status, err.get("code"), err.get("message")) == klass


def test_error_detail_keeps_the_start_of_the_message_bounded_and_without_secrets():
    from regen.generate.checks import DETAIL_CHARS, error_detail

    d = error_detail(400, VLLM_MSG)
    assert d.startswith("HTTP 400: This model's maximum context length is 32768 tokens.")
    long = error_detail(400, "x" * 5000 + "\nnext line")
    assert len(long) <= len("HTTP 400: ") + DETAIL_CHARS + 3 and "\n" not in long
    for secret in ("Authorization: Bearer abc.DEF-123", "sk-proj-abcdefghijklmnop", "api_key=s3cr3tvalue",
                   '"token": "s3cr3tvalue"', "https://user:s3cr3tvalue@host/v1", "hf_abcdefghijklmnop"):
        out = error_detail(400, f"bad request {secret} end")
        assert "[redacted]" in out and "s3cr3tvalue" not in out and "abcdefghijklmnop" not in out, out
        assert "abc.DEF-123" not in out and out.endswith("end")
    assert error_detail(413, None) == "HTTP 413"
