"""The faults `regen.testing.openai_server` injects, and the SSE events of its streamed answers.

Each fault reproduces a behaviour of a real server, named by its public report:

* HTTP errors (`ERROR_FAULTS`): status + the servers' own error bodies (OpenAI, vLLM, SGLang, a proxy's HTML).
* answer faults (`answer_fault`), streamed and not:
  - finish reasons: `abort` (vLLM's finish_reason "abort" then [DONE] when the engine aborts, vLLM #57082),
    `finish_null` (every chunk says null, then [DONE], vLLM #27572; not streamed: `"finish_reason": null`),
    `finish_missing` (no finish_reason key at all), `content_filter`, `finish_other` (`Settings.finish_other`,
    default TGI's "eos_token");
  - text past the stop (SGLang #31599, vLLM PR #47616), with `Settings.end_marker` (default SmolLM2's
    `<|im_end|>`): `after_end` (marker then more text in content), `echo_end` (one marker ending the content,
    nothing after), `after_end_reasoning` (in the reasoning), `after_end_tool` (inside a call's arguments);
  - usage that contradicts itself: `usage_reasoning` (reasoning_tokens > completion_tokens, SGLang #39826),
    `usage_over_max` (completion_tokens > the request's max_tokens, SGLang #31599), `usage_negative`;
  - the older ones: truncated, empty_content, leak, unbalanced, bad_tool_json.
* an error object inside a 200 (`ERROR_200`): in a stream as an SSE error event after some content, or as the
  whole 200 body: `error_event_overflow` (OpenAI shape, code 400, vLLM's overflow message),
  `error_event_flat` (vLLM's flat `{"object": "error", ...}` 400, not an overflow), `error_event_flat_overflow`,
  `error_event_500`, `error_event_429` (code "429"), `error_event_typed` (type invalid_request_error, code null),
  `error_event_text` (`{"error": "text"}`), `error_event_auth` (401).
* streamed tool-call deltas (`TOOL_STYLES`; not streamed, these answer with the calls as usual):
  `tool_no_index` (one call over three deltas without `index`, openai-python #2806), `tool_no_index_parallel`
  (two calls with ids, no index), `tool_no_index_names` (two calls with names, no ids, no index),
  `tool_repeat_id` (every delta repeats id and name, no index), `tool_no_index_orphan` (arguments before any
  id or name: undecidable), `tool_no_index_ambiguous` (a complete call, then more argument text alone).
"""
from __future__ import annotations

import json

VLLM_OVERFLOW = ("This model's maximum context length is 32768 tokens. However, you requested 40000 tokens "
                 "(39000 in the messages, 1000 in the completion). Please reduce the length of the messages or completion.")
SGLANG_OVERFLOW = ("Requested token count exceeds the model's maximum context length of 32768 tokens. You requested a "
                   "total of 40000 tokens: 39000 tokens from the input messages and 1000 tokens for the completion.")
# error fault -> (HTTP status, body builder(message override or None) -> JSON object or bytes)
ERROR_FAULTS = {
    "429": (429, lambda m: {"error": {"message": m or "injected 429", "code": None}}),
    "500": (500, lambda m: {"error": {"message": m or "injected 500", "code": None}}),
    "503": (503, lambda m: {"error": {"message": m or "injected 503", "code": None}}),
    "401": (401, lambda m: {"error": {"message": m or "injected 401", "code": None}}),
    "400": (400, lambda m: {"error": {"message": m or "injected 400", "code": None}}),
    "overflow": (400, lambda m: {"error": {"message": m or "This model's maximum context length is 32768 tokens. However, "
                                           "your messages resulted in 40000 tokens.", "type": "invalid_request_error",
                                           "param": "messages", "code": "context_length_exceeded"}}),
    "overflow_vllm": (400, lambda m: {"error": {"message": m or VLLM_OVERFLOW, "type": "BadRequestError",
                                                "param": None, "code": 400}}),
    "overflow_vllm_legacy": (400, lambda m: {"object": "error", "message": m or VLLM_OVERFLOW,
                                             "type": "BadRequestError", "param": None, "code": 400}),
    "overflow_sglang": (400, lambda m: {"object": "error", "message": m or SGLANG_OVERFLOW,
                                        "type": "BadRequestError", "param": None, "code": "400"}),
    "overflow_sglang_input": (400, lambda m: {"object": "error", "message": m or "The input (40000 tokens) is longer "
                                              "than the model's context length (32768 tokens).",
                                              "type": "BadRequestError", "param": None, "code": 400}),
    "overflow_413": (413, lambda m: (m or "<html><body><h1>413 Request Entity Too Large</h1></body></html>").encode()),
    "400_vllm": (400, lambda m: {"error": {"message": m or "temperature must be non-negative, got -1.0.",
                                           "type": "BadRequestError", "param": None, "code": 400}}),
    "unknown_field": (400, lambda m: {"error": {"message": m or "unknown field", "code": "invalid_request"}}),
}
# error object inside a 200 (an SSE error event, or the whole body); message override or None -> the object
ERROR_200 = {
    "error_event_overflow": lambda m: {"error": {"message": m or VLLM_OVERFLOW, "type": "BadRequestError",
                                                 "param": None, "code": 400}},
    "error_event_flat": lambda m: {"object": "error", "message": m or "top_k must be -1 or at least 1, got 0.",
                                   "type": "BadRequestError", "param": None, "code": 400},
    "error_event_flat_overflow": lambda m: {"object": "error", "message": m or SGLANG_OVERFLOW,
                                            "type": "BadRequestError", "param": None, "code": "400"},
    "error_event_500": lambda m: {"error": {"message": m or "engine dead: CUDA error: an illegal memory access",
                                            "type": "InternalServerError", "code": 500}},
    "error_event_429": lambda m: {"error": {"message": m or "too many requests in the queue", "code": "429"}},
    "error_event_typed": lambda m: {"error": {"message": m or "'messages' must hold a user turn",
                                              "type": "invalid_request_error", "param": None, "code": None}},
    "error_event_text": lambda m: {"error": m or "internal error while decoding"},
    "error_event_auth": lambda m: {"error": {"message": m or "token expired", "type": "authentication_error",
                                             "code": 401}},
}
TOOL_STYLES = ("tool_no_index", "tool_no_index_parallel", "tool_no_index_names", "tool_repeat_id",
               "tool_no_index_orphan", "tool_no_index_ambiguous")
FINISH_FAULTS = {"abort": "abort", "finish_null": None, "finish_missing": None, "content_filter": "content_filter"}
ANSWER_FAULTS = ("truncated", "empty_content", "leak", "unbalanced", "bad_tool_json", *FINISH_FAULTS, "finish_other",
                 "after_end", "echo_end", "after_end_reasoning", "after_end_tool", "usage_reasoning",
                 "usage_over_max", "usage_negative", *TOOL_STYLES)
FAULT_KINDS = (*ERROR_FAULTS, "stall", "stall_stream", "close", "malformed", "empty", *ANSWER_FAULTS, *ERROR_200)


def _call(call_id: str | None, name: str, query: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps({"query": query})}}


def _tool_names(body: dict) -> list[str]:
    names = [t.get("function", {}).get("name") for t in body.get("tools") or [] if isinstance(t, dict)]
    return [n for n in names if n] or ["search"]


def answer_fault(fault: str | None, ans: dict, body: dict, settings) -> dict:
    """`ans` (the deterministic answer: reasoning/content pieces, tool_calls, finish_reason, usage) as `fault`
    changes it; unchanged for a fault that is not an answer fault."""
    marker = settings.end_marker
    if fault == "truncated":
        return {**ans, "content": [], "tool_calls": [], "finish_reason": "length"}
    if fault == "empty_content":
        return {**ans, "content": [], "tool_calls": [], "finish_reason": "stop"}
    if fault == "leak":
        return {**ans, "content": ["<think>", "hidden ", "</think>"] + ans["content"]}
    if fault == "unbalanced":
        return {**ans, "content": ans["content"] + ["</think>"]}
    if fault == "bad_tool_json":
        return {**ans, "tool_calls": [{"id": "call_bad", "type": "function",
                                       "function": {"name": "tool", "arguments": "{\"query\": oops"}}],
                "finish_reason": "tool_calls"}
    if fault in FINISH_FAULTS:
        return {**ans, "finish_reason": FINISH_FAULTS[fault], "finish_missing": fault == "finish_missing"}
    if fault == "finish_other":
        return {**ans, "finish_reason": settings.finish_other}
    if fault == "after_end":
        return {**ans, "content": ans["content"] + [marker, " Extra tokens", " after the stop."]}
    if fault == "echo_end":
        return {**ans, "content": ans["content"] + [marker]}
    if fault == "after_end_reasoning":
        return {**ans, "reasoning": ans["reasoning"] + [marker, " then more thinking"]}
    if fault == "after_end_tool":
        name = _tool_names(body)[0]
        return {**ans, "content": [], "finish_reason": "tool_calls",
                "tool_calls": [_call("call_end", name, f"x{marker} and more")]}
    if fault in ("usage_reasoning", "usage_over_max", "usage_negative"):
        return {**ans, "usage_fault": fault}
    if fault in TOOL_STYLES:
        names = _tool_names(body)
        n = 2 if fault in ("tool_no_index_parallel", "tool_no_index_names", "tool_no_index_ambiguous") else 1
        ids = [None] * n if fault == "tool_no_index_names" else [f"call_{fault[-4:]}{i}" for i in range(n)]
        return {**ans, "content": [], "finish_reason": "tool_calls", "tool_style": fault,
                "tool_calls": [_call(ids[i], names[i % len(names)], f"q{i}") for i in range(n)]}
    return ans


def usage(ans: dict, body: dict) -> dict:
    """The usage object of `ans` (reasoning tokens in completion_tokens_details), as its usage fault changes it."""
    n_reason, n_content = len(ans["reasoning"]), len(ans["content"])
    prompt = len(ans["prompt_token_ids"])
    out = {"prompt_tokens": prompt, "completion_tokens": n_reason + n_content,
           "total_tokens": prompt + n_reason + n_content, "completion_tokens_details": {"reasoning_tokens": n_reason}}
    fault = ans.get("usage_fault")
    if fault == "usage_reasoning":
        out["completion_tokens_details"]["reasoning_tokens"] = out["completion_tokens"] + 7
    elif fault == "usage_over_max":
        out["completion_tokens"] = (body.get("max_tokens") or 1 << 20) + 3
    elif fault == "usage_negative":
        out["completion_tokens"] = -1
    return out


def tool_deltas(ans: dict) -> list[list[dict]]:
    """The `delta.tool_calls` lists of the streamed tool calls of `ans`, one list per SSE event (module doc)."""
    style, calls = ans.get("tool_style"), ans["tool_calls"]
    out = []
    for i, tc in enumerate(calls):
        fn, args = tc["function"], tc["function"]["arguments"]
        third = max(1, len(args) // 3)
        pieces = [args[:third], args[third:2 * third], args[2 * third:]]
        head = {"id": tc["id"], "type": "function", "function": {"name": fn["name"], "arguments": pieces[0]}}
        if tc["id"] is None:
            del head["id"]
        if style is None:  # OpenAI's shape: index on every delta, id and name on the first
            out += [[{"index": i, **head}], [{"index": i, "function": {"arguments": pieces[1] + pieces[2]}}]]
        elif style == "tool_repeat_id":
            out += [[head]] + [[{"id": tc["id"], "function": {"name": fn["name"], "arguments": p}}] for p in pieces[1:]]
        elif style == "tool_no_index_orphan":
            out += [[{"function": {"arguments": pieces[0]}}], [{"id": tc["id"], "function": {"name": fn["name"],
                                                                                        "arguments": pieces[1]}}]]
        elif style == "tool_no_index_ambiguous" and i > 0:
            out += [[{"function": {"arguments": args}}]]  # a whole second object with no id, name or index
        else:
            out += [[head]] + [[{"function": {"arguments": p}}] for p in pieces[1:]]
    return out


def stream_events(base: dict, ans: dict, body: dict, want_ids: bool, reasoning_field: str | None,
                  fault: str | None, error_message: str | None) -> list[dict]:
    """The chat.completion.chunk events (and an error event for ERROR_200 faults) of a streamed answer."""
    first = {**base, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
    if want_ids:
        first["prompt_token_ids"] = ans["prompt_token_ids"]
    events = [first]
    ids = iter(ans["token_ids"])
    for field_name, pieces in ((reasoning_field, ans["reasoning"]), ("content", ans["content"])):
        for piece in pieces:
            ch = {"index": 0, "delta": {field_name: piece}, "finish_reason": None}
            if want_ids:
                ch["token_ids"] = [next(ids, 0)]
            events.append({**base, "choices": [ch]})
    if fault in ERROR_200:  # the engine fails mid-answer: an error event, then the stream ends
        return events[:2] + [ERROR_200[fault](error_message)]
    for deltas in tool_deltas(ans) if ans["tool_calls"] else []:
        events.append({**base, "choices": [{"index": 0, "finish_reason": None, "delta": {"tool_calls": deltas}}]})
    events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": ans["finish_reason"]}]})
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append({**base, "choices": [], "usage": usage(ans, body)})
    return events
