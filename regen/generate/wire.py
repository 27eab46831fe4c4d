"""What the wire says: an HTTP answer of `/v1/chat/completions` -> a `Completion`, or a `RequestFailure` with its class.

Used by `regen.generate.client` for every attempt. Three shapes of answer:

* a non-200 status: classified by the status and the body's error object (`http_failure`);
* a non-streamed 200 (`parse_body`): a chat.completion object, or an error object sent with status 200;
* a streamed 200 (`read_stream`): SSE `data:` events of chat.completion.chunk objects (OpenAI streaming reference)
  up to `data: [DONE]`, or an error event inside the stream.

An error object inside a 200 (an SSE error event, a 200 body holding `{"error": {...}}`, vLLM's flat
`{"object": "error", ...}`) is classed as the HTTP error of the same code and body would be (`error_failure`):
`code` 400 with a context-length message is `context_overflow`, 429 `rate_limited`, 401 `auth`, ...; without a
numeric code, the OpenAI/vLLM error `type` names the status (`ERROR_TYPE_STATUS`); with neither it is a
`server_error` (transient). The server's message is kept, redacted (`checks.error_detail`).

Streamed tool calls (`ToolCallDeltas`): deltas are merged by `index`. A delta without an index (openai-python
#2806) that carries a new `id` or a new `name` starts a new call; one with only argument text continues the call
before it; argument text with no call before it, or after a call whose arguments already form a complete JSON
object, cannot be placed and the attempt fails as `malformed` with that reason.
"""
from __future__ import annotations

import asyncio
import json
import time
from email.utils import parsedate_to_datetime

import aiohttp

from regen.generate.checks import Completion, RequestFailure, classify_status, error_detail, error_object

try:
    import orjson

    _loads, dumps = orjson.loads, orjson.dumps
except ImportError:  # pragma: no cover - orjson ships with prefect
    _loads = json.loads

    def dumps(obj):
        return json.dumps(obj, ensure_ascii=False).encode()

# error `type` of OpenAI's error objects and of vLLM/SGLang's (their exception names) -> the HTTP status it stands for
ERROR_TYPE_STATUS = {
    "invalid_request_error": 400, "BadRequestError": 400, "context_length_exceeded": 400,
    "authentication_error": 401, "AuthenticationError": 401, "permission_error": 403,
    "PermissionDeniedError": 403, "not_found_error": 404, "NotFoundError": 404, "rate_limit_error": 429,
    "RateLimitError": 429, "server_error": 500, "api_error": 500, "InternalServerError": 500,
    "overloaded_error": 503, "ServiceUnavailableError": 503,
}


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After header (delta-seconds, fractional accepted, or an HTTP date; RFC 9110 10.2.3) -> seconds."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def error_status(err: dict) -> int | None:
    """The HTTP status an error object stands for: its numeric `code` (int or digit string, 400-599), else its
    `type` (`ERROR_TYPE_STATUS`), else None."""
    code = err.get("code")
    if isinstance(code, str) and code.strip().isdigit():
        code = int(code)
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
        return code
    kind = err.get("type")
    return ERROR_TYPE_STATUS.get(kind) if isinstance(kind, str) else None


def error_failure(err: dict, where: str) -> RequestFailure:
    """A RequestFailure for an error object found inside a 200 answer (`where`: "stream" or "body"), classed as
    the HTTP error of the same code would be (module doc); the detail keeps the redacted message."""
    status = error_status(err)
    code = err.get("code")
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    klass = classify_status(status if status is not None else 500, code, err.get("message"))
    what = f"error {'event in a 200 stream' if where == 'stream' else 'object in a 200 response'}"
    head = f"{what} (code {err.get('code')!r}{', type ' + repr(err['type']) if err.get('type') else ''})"
    return RequestFailure(klass, error_detail(200, f"{head}: {err.get('message')}"), status)


async def http_failure(resp: aiohttp.ClientResponse) -> RequestFailure:
    """A non-200 response -> RequestFailure classified by status and the body's error object (`checks.error_object`);
    its detail keeps the start of the server's message (bounded, secrets redacted: `checks.error_detail`)."""
    code = message = None
    try:
        raw = await resp.content.read(65536)
    except (aiohttp.ClientError, OSError):
        raw = b""
    try:
        err = error_object(_loads(raw)) if raw else None
    except ValueError:
        err = None
    if err is not None:
        code, message = err.get("code"), err.get("message")
        if isinstance(code, str) and code.isdigit():
            code = int(code)
    elif raw:  # not JSON (a proxy's HTML or text page): keep its start for humans, never classify by it
        message = raw[:1024].decode("utf-8", "replace")
    retry_after = parse_retry_after(resp.headers.get("Retry-After"))
    klass = classify_status(resp.status, code, message if err is not None else None)
    return RequestFailure(klass, error_detail(resp.status, message), resp.status, retry_after)


def _text(value) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: keep the text parts
        return "".join(p.get("text") or "" if isinstance(p, dict) else str(p) for p in value)
    return dumps(value).decode()


def _ids(value) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise RequestFailure("malformed", "token ids are not a list of integers")
    return value


def normalize(c: Completion) -> Completion:
    """Coerce a parsed completion into the types the generation schema stores; RequestFailure("malformed")
    when a field cannot be (a server's answer must never crash the writer)."""
    c.content, c.reasoning_content = _text(c.content), _text(c.reasoning_content)
    if c.finish_reason is not None and not isinstance(c.finish_reason, str):
        c.finish_reason = str(c.finish_reason)
    if c.tool_calls is not None:
        if not isinstance(c.tool_calls, list):
            raise RequestFailure("malformed", "tool_calls is not a list")
        calls = []
        for tc in c.tool_calls:
            fn = tc.get("function") if isinstance(tc, dict) else None
            if not isinstance(fn, dict):
                raise RequestFailure("malformed", "tool call without a function object")
            args = fn.get("arguments")
            calls.append({"id": _text(tc.get("id")), "type": _text(tc.get("type")) or "function",
                          "function": {"name": _text(fn.get("name")),
                                       "arguments": args if args is None or isinstance(args, str) else _text(args)}})
        c.tool_calls = calls or None
    c.prompt_token_ids, c.completion_token_ids = _ids(c.prompt_token_ids), _ids(c.completion_token_ids)
    if c.usage is not None and not isinstance(c.usage, dict):
        c.usage = None
    if c.usage:
        for k in ("prompt_tokens", "completion_tokens"):
            if not isinstance(c.usage.get(k), (int, type(None))):
                c.usage = {kk: v for kk, v in c.usage.items() if kk != k}
    return c


def _message_fields(c: Completion, msg: dict) -> None:
    c.content = msg.get("content")
    c.reasoning_content = msg.get("reasoning_content") or msg.get("reasoning")
    c.tool_calls = msg.get("tool_calls") or None


def parse_body(data: bytes) -> Completion:
    """A non-streamed 200 body -> Completion; empty -> empty_body; not JSON -> RequestFailure("malformed"); an
    error object (OpenAI `{"error": ...}` or vLLM's flat `{"object": "error"}`) -> `error_failure`."""
    if not data.strip():
        return Completion(empty_body=True)
    try:
        obj = _loads(data)
    except ValueError as exc:
        raise RequestFailure("malformed", "response body is not JSON") from exc
    if not isinstance(obj, dict):
        raise RequestFailure("malformed", "response body is not a JSON object")
    choices = obj.get("choices")
    if not choices and (err := error_object(obj)) is not None:
        raise error_failure(err, "body")
    if not choices:
        return Completion(empty_body=True, usage=obj.get("usage"))
    ch = choices[0]
    if not isinstance(ch, dict) or not isinstance(ch.get("message"), dict):
        raise RequestFailure("malformed", "choices[0].message missing")
    c = Completion(finish_reason=ch.get("finish_reason"), usage=obj.get("usage"))
    _message_fields(c, ch["message"])
    c.prompt_token_ids = obj.get("prompt_token_ids") or ch.get("prompt_token_ids")
    c.completion_token_ids = ch.get("token_ids")
    return c


async def read_stream(resp: aiohttp.ClientResponse, cm, t0: float, between_s: float) -> Completion:
    """Parse an SSE stream of chat.completion.chunk events (OpenAI streaming reference) into a Completion.

    Moves the timeout `cm` to now + between_s at most once a second. A stream that ends without `[DONE]`
    and without a finish_reason raises RequestFailure("connection") (closed mid-stream); an error event raises
    `error_failure` (module doc).
    """
    loop = asyncio.get_running_loop()
    content, reasoning, token_ids = [], [], []
    calls = ToolCallDeltas()
    c = Completion(streamed=True)
    done = seen_choice = False
    buf = b""
    last_move = -1.0
    async for data in resp.content.iter_any():
        now = loop.time()
        if c.ttft_s is None:
            c.ttft_s = now - t0
        if now - last_move > 1.0:
            cm.reschedule(now + between_s)
            last_move = now
        buf += data
        if b"\n" not in data:
            continue
        lines = buf.split(b"\n")
        buf = lines.pop()
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            try:
                obj = _loads(payload)
                choices = obj.get("choices")
            except (ValueError, AttributeError) as exc:
                raise RequestFailure("malformed", "SSE event is not a JSON object") from exc
            c.num_chunks += 1
            if not choices and (err := error_object(obj)) is not None:
                raise error_failure(err, "stream")
            if obj.get("usage"):
                c.usage = obj["usage"]
            if obj.get("prompt_token_ids"):
                c.prompt_token_ids = obj["prompt_token_ids"]
            if not choices:
                continue
            ch = choices[0]
            if not isinstance(ch, dict):
                raise RequestFailure("malformed", "SSE event's choices[0] is not an object")
            seen_choice = True
            delta = ch.get("delta") or {}
            piece = delta.get("content")
            if piece:
                content.append(piece)
            piece = delta.get("reasoning_content") or delta.get("reasoning")
            if piece:
                reasoning.append(piece)
            if delta.get("tool_calls"):
                calls.add(delta["tool_calls"])
            ids = ch.get("token_ids")
            if ids:
                token_ids.extend(ids)
            if ch.get("prompt_token_ids"):
                c.prompt_token_ids = ch["prompt_token_ids"]
            if ch.get("finish_reason") is not None:
                c.finish_reason = ch["finish_reason"]
    if not done and c.finish_reason is None:
        raise RequestFailure("connection", "stream ended before [DONE]")
    if not seen_choice:
        c.empty_body = True
        return c
    c.content = "".join(content) if content else ("" if c.finish_reason else None)
    c.reasoning_content = "".join(reasoning) or None
    c.tool_calls = calls.result() or None
    c.completion_token_ids = token_ids or None
    return c


def _complete_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class ToolCallDeltas:
    """Streamed tool-call deltas -> tool calls (module doc: by `index`, else by `id`/`name`, else continuing)."""

    def __init__(self):
        self.calls: list[dict] = []
        self.by_index: dict[int, dict] = {}
        self.current: dict | None = None
        self.indexed_only = True

    def _new(self) -> dict:
        call = {"id": None, "type": "function", "function": {"name": None, "arguments": ""}}
        self.calls.append(call)
        return call

    def add(self, deltas) -> None:
        """Merge one chunk's `delta.tool_calls` list; RequestFailure("malformed") for a delta that cannot be placed."""
        if not isinstance(deltas, list):
            raise RequestFailure("malformed", "delta.tool_calls is not a list")
        for d in deltas:
            if not isinstance(d, dict):
                raise RequestFailure("malformed", "a tool-call delta is not an object")
            fn = d.get("function") if isinstance(d.get("function"), dict) else {}
            args = fn.get("arguments")
            if args is not None and not isinstance(args, str):
                args = dumps(args).decode() if isinstance(args, dict) else None
                if args is None:
                    raise RequestFailure("malformed", "a tool-call delta's arguments are neither text nor an object")
            call = self._place(d, fn, args or "")
            if d.get("id"):
                call["id"] = d["id"]
            if fn.get("name"):
                call["function"]["name"] = fn["name"]
            if args:
                call["function"]["arguments"] += args
            self.current = call

    def _place(self, d: dict, fn: dict, args: str) -> dict:
        index = d.get("index")
        if isinstance(index, str) and index.isdigit():
            index = int(index)
        if isinstance(index, int) and not isinstance(index, bool):
            if index not in self.by_index:
                self.by_index[index] = self._new()
            return self.by_index[index]
        self.indexed_only = False
        cur, cid, name = self.current, d.get("id"), fn.get("name")
        if cur is None:
            if not cid and not name and args.strip():
                raise RequestFailure("malformed", "a tool-call delta without index, id or name carries arguments "
                                                  "before any call: cannot tell which call they belong to")
            return self._new()
        if cid:
            if cid == cur["id"] or (cur["id"] is None and not _complete_object(cur["function"]["arguments"])):
                return cur
            return self._new()
        if name:
            same = name == cur["function"]["name"]
            done = _complete_object(cur["function"]["arguments"])
            return self._new() if cur["function"]["name"] is not None and (not same or done) else cur
        if args.strip() and _complete_object(cur["function"]["arguments"]):
            raise RequestFailure("malformed", f"a tool-call delta without index, id or name carries arguments after "
                                              f"call {len(self.calls) - 1}'s arguments form a complete JSON object: "
                                              "cannot tell whether they start another call")
        return cur

    def result(self) -> list[dict]:
        """The calls: in index order when every delta had an index (as the OpenAI stream defines), else in order."""
        if self.indexed_only:
            return [self.by_index[i] for i in sorted(self.by_index)]
        return list(self.calls)
