"""The wire kinds, against the real fault-injecting server (regen.testing.openai_server): finished answers
only (the finish_reason allow-list), text past the end of the turn, usage that contradicts itself, error objects
inside a 200, streamed tool calls without index. Each kind streamed and not, first and later turns."""
from __future__ import annotations

import json
import urllib.request

import pyarrow.parquet as pq
import pytest
from conftest import fast_config, write_prompts

from regen.errors import InputError
from regen.generate import ledger
from regen.generate.stage import run_generate

pytestmark = pytest.mark.timeout(120)
TWO_TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
             for n in ("search", "fetch")]


def rows_of(run) -> list[dict]:
    return [r for p in ledger.part_paths(run.generations) for r in pq.read_table(p).to_pylist()]


def control(server, **settings):
    req = urllib.request.Request(server.base_url.removesuffix("/v1") + "/_control", data=json.dumps(settings).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req).read()


def one_row_per_kind(server, run_dir, kinds, stream, tools=None, **cfg):
    """One single-turn prompt per fault kind (forced by its marker on every attempt) -> {kind: row}."""
    records = write_prompts(run_dir, [([{"role": "user", "content": f"q [[fault:{k}]]"}], tools) for k in kinds])
    run_generate(fast_config(stream=stream, **{"retry": {"max_attempts": 2}, **cfg}), run_dir,
                 endpoints=[server.base_url], progress=False)
    by_prompt = {r["prompt_id"]: r for r in rows_of(run_dir)}
    return {k: by_prompt[rec.prompt_id] for k, rec in zip(kinds, records)}


def sent_per_key(server) -> dict:
    out: dict = {}
    for e in server.server.log:
        out[e["key"]] = out.get(e["key"], 0) + 1
    return out


# ------------------------------------------------------------------------------------------ 1. finish_reason


@pytest.mark.parametrize("stream", [True, False])
def test_only_finished_answers_are_kept_and_the_raw_value_stays(server, run_dir, stream):
    control(server, finish_other="eos_token")
    kinds = ["abort", "finish_null", "finish_missing", "finish_other", "content_filter"]
    rows = one_row_per_kind(server, run_dir, kinds, stream)
    sent = sent_per_key(server)
    expected = {"abort": ("unfinished", "abort"), "finish_null": ("unfinished", None),
                "finish_missing": ("unfinished", None), "finish_other": ("unfinished", "eos_token"),
                "content_filter": ("content_filter", "content_filter")}
    for kind, (klass, raw) in expected.items():
        row = rows[kind]
        assert (row["status"], row["error_class"], row["finish_reason"]) == ("error", klass, raw), kind
        # the partial (or filtered) answer is never kept, not even in the error row
        assert row["content"] is None and row["reasoning_content"] is None and row["tool_calls"] is None, kind
        assert row["completion_token_ids"] is None, kind
    assert "'abort'" in rows["abort"]["error_detail"] and "vLLM #57082" in rows["abort"]["error_detail"]
    assert "'eos_token'" in rows["finish_other"]["error_detail"]
    if stream:
        assert "every chunk" in rows["finish_null"]["error_detail"]
    assert sent[rows["abort"]["request_key"]] == 2  # unfinished: retried (policy retry)
    assert sent[rows["content_filter"]["request_key"]] == 1  # content_filter: dropped at once (policy drop)


def test_an_unfinished_later_turn_stops_the_conversation_and_retry_errors_resends_it_by_default(server, run_dir):
    convs = [([{"role": "user", "content": "first"}, {"role": "assistant", "content": "old"},
               {"role": "user", "content": "second"}, {"role": "assistant", "content": "old"},
               {"role": "user", "content": "third"}], None)]
    write_prompts(run_dir, convs)
    control(server, faults={"abort": 1.0}, fault_budget=10)
    cfg = fast_config(retry={"max_attempts": 2})
    run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False)
    rows = sorted(rows_of(run_dir), key=lambda r: r["turn"])
    assert [(r["status"], r["error_class"]) for r in rows] == [("error", "unfinished"), ("skipped", None),
                                                              ("skipped", None)]
    control(server, faults={})  # the engine is back: a plain --retry-errors (no --classes) re-sends them
    manifest = run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False, retry_classes="")
    assert manifest["last_retry"]["recovered"] == 1 and manifest["accounting"]["generated"] == 3


# ------------------------------------------------------------------------------------------ 2. text after the end


@pytest.mark.parametrize("stream", [True, False])
def test_text_after_the_end_of_turn_is_a_reject_and_one_echoed_marker_is_stripped(server, run_dir, stream):
    kinds = ["after_end", "echo_end", "after_end_reasoning", "after_end_tool"]
    records = write_prompts(run_dir, [([{"role": "user", "content": f"q [[fault:{k}]]"}],
                                       TWO_TOOLS if k == "after_end_tool" else None) for k in kinds]
                            + [([{"role": "user", "content": "call [[fault:echo_end]]"}], TWO_TOOLS)])
    run_generate(fast_config(stream=stream, retry={"max_attempts": 2}, end_of_turn_markers=["<|im_end|>"]), run_dir,
                 endpoints=[server.base_url], progress=False)
    by_prompt = {r["prompt_id"]: r for r in rows_of(run_dir)}
    rows = {k: by_prompt[rec.prompt_id] for k, rec in zip(kinds + ["echo_then_call"], records)}
    for kind in ("after_end", "after_end_reasoning", "after_end_tool", "echo_then_call"):
        assert (rows[kind]["status"], rows[kind]["error_class"]) == ("error", "text_after_end"), kind
        assert "'<|im_end|>'" in rows[kind]["error_detail"] and "more characters" in rows[kind]["error_detail"]
    assert "content holds" in rows["after_end"]["error_detail"]
    assert "reasoning_content holds" in rows["after_end_reasoning"]["error_detail"]
    assert "tool_calls[0].function.arguments holds" in rows["after_end_tool"]["error_detail"]
    echo = rows["echo_end"]  # one marker ending the content, nothing after it: stripped and counted
    assert echo["status"] == "ok" and echo["flags"] == ["end_marker_stripped"]
    assert "<|im_end|>" not in echo["content"] and echo["content"].strip()


def test_the_markers_are_the_targets_and_later_turns_are_judged_too(server, run_dir):
    """Another template's marker (Gemma's), in the second turn only; the first turn is clean."""
    control(server, end_marker="<end_of_turn>")
    convs = [([{"role": "user", "content": "first"}, {"role": "assistant", "content": "old"},
               {"role": "user", "content": "second [[fault:after_end]]"}], None),
             ([{"role": "user", "content": "plain [[fault:after_end]]"}], None)]
    write_prompts(run_dir, convs)
    run_generate(fast_config(retry={"max_attempts": 1}, end_of_turn_markers=["<end_of_turn>", "<eos>"]), run_dir,
                 endpoints=[server.base_url], progress=False)
    rows = sorted(rows_of(run_dir), key=lambda r: (len(r["messages"]), r["turn"]))
    by_turns = [(r["turn"], r["status"], r["error_class"]) for r in rows]
    assert sorted(by_turns) == sorted([(0, "error", "text_after_end"), (0, "ok", None), (1, "error", "text_after_end")])
    assert all("'<end_of_turn>'" in r["error_detail"] for r in rows if r["status"] == "error")


def test_without_configured_markers_nothing_is_judged_as_text_after_end(server, run_dir):
    rows = one_row_per_kind(server, run_dir, ["after_end"], True)
    assert rows["after_end"]["status"] == "ok"  # no generate.end_of_turn_markers: render's guard is the one left


# ------------------------------------------------------------------------------------------ 4. usage


@pytest.mark.parametrize("stream", [True, False])
def test_usage_that_contradicts_itself_is_flagged_or_rejected_with_its_numbers(server, run_dir, stream):
    rows = one_row_per_kind(server, run_dir, ["usage_reasoning", "usage_over_max", "usage_negative"], stream)
    flagged = rows["usage_reasoning"]
    assert flagged["status"] == "ok" and flagged["flags"] == ["usage_inconsistent"]  # policy keep_flagged
    assert "reasoning_tokens 19 > usage.completion_tokens 12" in flagged["error_detail"]
    over = rows["usage_over_max"]
    assert (over["status"], over["error_class"]) == ("error", "over_max_tokens")
    assert "usage.completion_tokens 67 > max_tokens 64" in over["error_detail"]
    assert rows["usage_negative"]["flags"] == ["usage_inconsistent"] and "-1 < 0" in rows["usage_negative"]["error_detail"]


def test_the_usage_policy_can_reject(server, run_dir):
    rows = one_row_per_kind(server, run_dir, ["usage_reasoning"], True, policies={"usage_inconsistent": "drop"})
    row = rows["usage_reasoning"]
    assert (row["status"], row["error_class"], row["attempts"]) == ("error", "usage_inconsistent", 1)
    assert "reasoning_tokens 19 > usage.completion_tokens 12" in row["error_detail"]


def test_keep_flagged_is_refused_for_classes_whose_answer_must_not_become_data():
    from pydantic import ValidationError

    for klass in ("unfinished", "content_filter", "text_after_end"):
        with pytest.raises(ValidationError, match="must not become a row"):
            fast_config(policies={klass: "keep_flagged"})


# ------------------------------------------------------------------------------------------ 5. error inside a 200


ERROR_200_CLASS = {
    "error_event_overflow": ("context_overflow", 1, "maximum context length is 32768"),
    "error_event_flat": ("bad_request", 1, "top_k must be -1"),
    "error_event_flat_overflow": ("context_overflow", 1, "Requested token count exceeds"),
    "error_event_500": ("server_error", 2, "illegal memory access"),
    "error_event_429": ("rate_limited", 2, "too many requests"),
    "error_event_typed": ("bad_request", 1, "must hold a user turn"),
    "error_event_text": ("server_error", 2, "internal error while decoding"),
}


@pytest.mark.parametrize("stream", [True, False])
def test_an_error_inside_a_200_is_classed_as_the_http_error_and_keeps_its_message(server, run_dir, stream):
    rows = one_row_per_kind(server, run_dir, list(ERROR_200_CLASS), stream)
    sent = sent_per_key(server)
    for kind, (klass, attempts, words) in ERROR_200_CLASS.items():
        row = rows[kind]
        assert (row["status"], row["error_class"]) == ("error", klass), kind
        assert row["attempts"] == sent[row["request_key"]] == attempts, kind
        assert words in row["error_detail"] and row["error_detail"].startswith("HTTP 200: error "), kind


def test_an_error_event_keeps_its_message_redacted(server, run_dir):
    control(server, error_message="context length exceeded for key sk-live-abcdef1234567890")
    rows = one_row_per_kind(server, run_dir, ["error_event_flat"], True)
    detail = rows["error_event_flat"]["error_detail"]
    assert rows["error_event_flat"]["error_class"] == "context_overflow"  # the message says so (code 400)
    assert "sk-live" not in detail and "[redacted]" in detail


def test_an_auth_error_inside_a_200_stops_the_run_as_a_401_would(server, run_dir):
    write_prompts(run_dir, [([{"role": "user", "content": "q [[fault:error_event_auth]]"}], None)])
    with pytest.raises(InputError, match="auth"):
        run_generate(fast_config(), run_dir, endpoints=[server.base_url], progress=False)
    assert len(server.server.log) == 1


# ------------------------------------------------------------------------------------------ 6. tool-call deltas


@pytest.mark.parametrize("stream", [True, False])
def test_streamed_tool_calls_without_index_are_merged_or_rejected_with_a_reason(server, run_dir, stream):
    kinds = ["tool_no_index", "tool_no_index_parallel", "tool_no_index_names", "tool_repeat_id",
             "tool_no_index_orphan", "tool_no_index_ambiguous"]
    rows = one_row_per_kind(server, run_dir, kinds, stream, tools=TWO_TOOLS)
    calls = {k: [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in rows[k]["tool_calls"] or []]
             for k in kinds if rows[k]["status"] == "ok"}
    assert calls["tool_no_index"] == [("search", {"query": "q0"})]
    assert calls["tool_repeat_id"] == [("search", {"query": "q0"})]
    assert calls["tool_no_index_parallel"] == [("search", {"query": "q0"}), ("fetch", {"query": "q1"})]
    assert calls["tool_no_index_names"] == [("search", {"query": "q0"}), ("fetch", {"query": "q1"})]
    if not stream:  # the same calls as a whole message: nothing to merge
        assert all(rows[k]["status"] == "ok" for k in kinds)
        return
    for kind, words in (("tool_no_index_orphan", "before any call"), ("tool_no_index_ambiguous", "complete JSON object")):
        row = rows[kind]
        assert (row["status"], row["error_class"]) == ("error", "malformed"), kind
        assert words in row["error_detail"], kind


# ------------------------------------------------------------------------------------------ the pure parts


def merged(*chunks):
    from regen.generate.wire import ToolCallDeltas

    m = ToolCallDeltas()
    for deltas in chunks:
        m.add(deltas)
    return [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in m.result()]


def test_tool_call_deltas_variants():
    from regen.generate.checks import RequestFailure

    fn = lambda name=None, args=None: {k: v for k, v in (("name", name), ("arguments", args)) if v is not None}  # noqa: E731
    # OpenAI's shape, out of order by index: kept in index order (as before)
    assert merged([{"index": 1, "id": "b", "function": fn("g", "{}")}], [{"index": 0, "id": "a", "function": fn("f", "{")}],
                  [{"index": 0, "function": fn(args="}")}]) == [("a", "f", "{}"), ("b", "g", "{}")]
    # an index sent as a string
    assert merged([{"index": "0", "id": "a", "function": fn("f", "{")}], [{"index": "0", "function": fn(args="}")}]) \
        == [("a", "f", "{}")]
    # no index: the same name repeated on a continuing delta (arguments incomplete) is the same call
    assert merged([{"function": fn("f", '{"a":')}], [{"function": fn("f", "1}")}]) == [(None, "f", '{"a":1}')]
    # no index: the same name again after complete arguments is a second call of that function
    assert merged([{"function": fn("f", '{"a":1}')}], [{"function": fn("f", '{"a":2}')}]) \
        == [(None, "f", '{"a":1}'), (None, "f", '{"a":2}')]
    # no index: an id on the second delta of a call that had none yet continues it
    assert merged([{"function": fn("f", '{"a"')}], [{"id": "x", "function": fn(args=":1}")}]) == [("x", "f", '{"a":1}')]
    # arguments sent as an object
    assert merged([{"id": "a", "function": {"name": "f", "arguments": {"k": 1}}}]) == [("a", "f", '{"k":1}')]
    # an indexed call, then index-less argument text: continues the call just touched
    assert merged([{"index": 0, "id": "a", "function": fn("f", '{"k"')}], [{"function": fn(args=": 2}")}]) \
        == [("a", "f", '{"k": 2}')]
    for bad, words in (([[{"function": fn(args='{"a": 1}')}]], "before any call"),
                       ([[{"id": "a", "function": fn("f", "{}")}], [{"function": fn(args="{}")}]], "complete JSON object"),
                       ([["not an object"]], "not an object"),
                       ([[{"id": "a", "function": {"name": "f", "arguments": [1]}}]], "neither text nor an object")):
        with pytest.raises(RequestFailure) as exc:
            merged(*bad)
        assert exc.value.error_class == "malformed" and words in exc.value.detail


@pytest.mark.parametrize("err,klass", [
    ({"message": "This model's maximum context length is 4096 tokens", "code": 400}, "context_overflow"),
    ({"message": "x", "code": "context_length_exceeded", "type": "invalid_request_error"}, "context_overflow"),
    ({"message": "bad top_p", "code": "422"}, "bad_request"),
    ({"message": "slow down", "type": "RateLimitError", "code": None}, "rate_limited"),
    ({"message": "nope", "type": "PermissionDeniedError"}, "auth"),
    ({"message": "boom", "code": 503}, "server_error"),
    ({"message": "boom", "code": "oops"}, "server_error"),
    ({"message": None, "code": None}, "server_error"),
])
def test_an_error_object_is_classed_by_its_code_then_its_type(err, klass):
    from regen.generate.wire import error_failure

    failure = error_failure(err, "stream")
    assert failure.error_class == klass and failure.detail.startswith("HTTP 200: error event in a 200 stream")


def test_finish_reason_detail_and_usage_numbers_are_pure_functions():
    from regen.generate.checks import Completion, judge, strip_echoed_end

    c = Completion(content="ok", finish_reason="stop", usage={"completion_tokens": 10,
                                                              "completion_tokens_details": {"reasoning_tokens": 12}})
    assert judge(c, max_tokens=8) == [
        ("over_max_tokens", "usage.completion_tokens 10 > max_tokens 8 of the request: the server generated past its "
                            "limit (SGLang #31599)"),
        ("usage_inconsistent", "usage.completion_tokens_details.reasoning_tokens 12 > usage.completion_tokens 10 "
                               "(SGLang #39826)")]
    ids = Completion(content="ok", finish_reason="length", completion_token_ids=list(range(9)))
    assert [k for k, _ in judge(ids, max_tokens=8)] == ["truncated", "over_max_tokens"]
    assert judge(Completion(content="ok", finish_reason="function_call")) == []  # the legacy value is finished
    assert [k for k, _ in judge(Completion(content="ok", finish_reason="STOP"))] == ["unfinished"]  # exact values only
    two = Completion(content="a<|im_end|>b<|im_end|>", finish_reason="stop")
    assert strip_echoed_end(two, ["<|im_end|>"]) is None  # two markers: not an echo, a fault
    assert [k for k, _ in judge(two, end_markers=["<|im_end|>"])] == ["text_after_end"]
    tail = Completion(content="The answer is 42.<|im_end|>\n", finish_reason="stop")
    assert strip_echoed_end(tail, ["<|eot_id|>", "<|im_end|>"]) == "<|im_end|>" and tail.content == "The answer is 42."


@pytest.mark.parametrize("stream", [True, False])
def test_the_kinds_in_a_later_turn_and_in_a_tool_answer(server, run_dir, stream):
    """The fault in turn 1 of 3 (turn 0 clean, turn 2 skipped), and in an answer that calls a tool."""
    later = lambda k: ([{"role": "user", "content": "first"}, {"role": "assistant", "content": "old"},  # noqa: E731
                        {"role": "user", "content": f"second [[fault:{k}]]"}, {"role": "assistant", "content": "old"},
                        {"role": "user", "content": "third"}], None)
    kinds = {"abort": "unfinished", "content_filter": "content_filter", "error_event_overflow": "context_overflow",
             "after_end": "text_after_end", "usage_over_max": "over_max_tokens", "tool_no_index_orphan": "malformed"}
    records = write_prompts(run_dir, [later(k) for k in kinds]
                            + [([{"role": "user", "content": f"call [[fault:{k}]]"}], TWO_TOOLS) for k in kinds])
    run_generate(fast_config(stream=stream, retry={"max_attempts": 2}, end_of_turn_markers=["<|im_end|>"]), run_dir,
                 endpoints=[server.base_url], progress=False)
    rows = {(r["prompt_id"], r["turn"]): r for r in rows_of(run_dir)}
    for (kind, klass), rec in zip(kinds.items(), records):
        t0, t1, t2 = (rows[(rec.prompt_id, t)] for t in range(3))
        if kind == "tool_no_index_orphan":  # a call the recorded conversation never made: it stops there anyway
            assert t1["status"] == ("error" if stream else "ok") and t2["status"] == "skipped", kind
            continue
        assert t0["status"] == "ok" and (t1["status"], t1["error_class"]) == ("error", klass), kind
        assert t2["status"] == "skipped" and t2["stop_reason"] == "previous_turn_error", kind
    for (kind, klass), rec in zip(kinds.items(), records[len(kinds):]):
        if kind == "tool_no_index_orphan" and not stream:
            continue
        row = rows[(rec.prompt_id, 0)]
        assert (row["status"], row["error_class"]) == ("error", klass), kind
        if klass in ("unfinished", "content_filter"):
            assert row["tool_calls"] is None and row["content"] is None, kind
