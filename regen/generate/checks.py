"""What a response is: a parsed completion, the failure classes, and the checks a "200 OK" must pass.

Two families of classes, each stored in `generations.error_class` (or `flags`):

* transport classes, decided by exception type and HTTP status only (never by message text):
  `rate_limited` (429), `server_error` (5xx), `timeout`, `connection` (refused, reset, closed mid-body or
  mid-stream), `malformed` (a body or SSE event that is not the JSON the protocol defines) are transient and
  retried with backoff; `bad_request` (400, 404, 405, 422, other 4xx) and `context_overflow` are permanent
  and become error rows at once. `context_overflow` is HTTP 413, or a 400/422 whose error object (OpenAI
  `{"error": {...}}`, vLLM/SGLang `{"object": "error", ...}` with `code` 400 or "400") has the code
  `context_length_exceeded` or a message about the context length (`OVERFLOW_MESSAGE`: the message is matched
  only to separate overflow from other 400s, never to decide a status family);
  `auth` (401, 403) is fatal: no request can succeed, so the run stops with an InputError.
* quality classes of a 200 OK (`QUALITY_CLASSES`, in the order `judge` reports them; the first whose policy
  acts decides): `empty_body`; `content_filter` (finish_reason "content_filter": never training data);
  `unfinished` (a finish_reason outside `FINISHED`, kept raw in the row: vLLM's "abort" (vLLM #57082), a stream
  whose chunks all said null before [DONE] (vLLM #27572), "error", "eos_token", ...); `truncated`
  (finish_reason "length": thinking or answer cut by max_tokens), `empty_content` (no content and no tool
  calls), `invalid_tool_args` (function.arguments not a JSON object), `unbalanced_think` (think markers not
  paired in content or reasoning), `reasoning_leak` (a paired think block inside content); `text_after_end`
  (an end-of-turn marker of `generate.end_of_turn_markers` inside the answer with text after it: tokens past
  the stop, SGLang #31599, vLLM PR #47616); `over_max_tokens` (usage.completion_tokens, or the server's
  completion token ids, more than the request's max_tokens, SGLang #31599); `usage_inconsistent`
  (completion_tokens_details.reasoning_tokens > completion_tokens, SGLang #39826, or a negative count). Each has
  a policy from the profile (`GenerateConfig.policy`): retry, retry_larger (max_tokens grows), keep_flagged (row
  kept with status ok and the class in `flags`), drop (error row at once). `unfinished` and `content_filter`
  rows never keep the answer (`NO_PARTIAL`), and their policy cannot be keep_flagged. `judge` gives each class
  its detail (the raw value, the numbers), stored in `error_detail`. An answer that merely ends with one echoed
  end-of-turn marker (nothing after it) is not a fault: `strip_echoed_end` removes it and the row is flagged
  `end_marker_stripped`.

Source of the wire shapes: OpenAI chat-completions API reference (choices[].message, finish_reason, usage,
error.code); vLLM's `return_token_ids` (top-level `prompt_token_ids`, `choices[].token_ids`).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from filters.control_tokens import strip_echoed_end as strip_echo
from filters.control_tokens import text_after_end as marker_after_end

TRANSIENT = ("rate_limited", "server_error", "timeout", "connection", "malformed")
PERMANENT = ("bad_request", "context_overflow")
FATAL = ("auth",)
QUALITY_CLASSES = (
    "empty_body", "content_filter", "unfinished", "truncated", "empty_content", "invalid_tool_args",
    "unbalanced_think", "reasoning_leak", "text_after_end", "over_max_tokens", "usage_inconsistent",
)
# quality class -> broad kind, for the style guide's (transient, permanent, truncated, invalid) grouping
QUALITY_KIND = {
    "empty_body": "invalid", "content_filter": "invalid", "unfinished": "transient", "truncated": "truncated",
    "empty_content": "invalid", "invalid_tool_args": "invalid", "unbalanced_think": "invalid",
    "reasoning_leak": "invalid", "text_after_end": "invalid", "over_max_tokens": "invalid",
    "usage_inconsistent": "invalid",
}
# finish_reason values that mean a finished answer (OpenAI chat-completions reference; function_call: legacy)
FINISHED = ("stop", "length", "tool_calls", "function_call")
# quality classes whose error rows keep no answer text: the answer is partial or filtered, never training data
NO_PARTIAL = ("unfinished", "content_filter")
# server faults that a new sample fixes: with the transient classes, what `--retry-errors` re-sends by default
RESAMPLE = ("unfinished", "text_after_end", "over_max_tokens")
RETRY_DEFAULT = TRANSIENT + RESAMPLE
END_MARKER_STRIPPED = "end_marker_stripped"  # flag of a row whose one echoed trailing end marker was removed


class RequestFailure(Exception):
    """A request that produced no usable completion. `error_class` is one of TRANSIENT, PERMANENT or FATAL.

    `status`: HTTP status or None; `retry_after_s`: the server's Retry-After in seconds, or None.
    `detail` is for humans (never parsed) and never contains request headers.
    """

    def __init__(self, error_class: str, detail: str = "", status: int | None = None,
                 retry_after_s: float | None = None):
        super().__init__(f"{error_class}: {detail}")
        self.error_class = error_class
        self.detail = detail
        self.status = status
        self.retry_after_s = retry_after_s

    @property
    def transient(self) -> bool:
        return self.error_class in TRANSIENT

    @property
    def fatal(self) -> bool:
        return self.error_class in FATAL


# Wordings of a context overflow in a 400's error message: vLLM ("This model's maximum context length is 32768
# tokens. However, you requested 40000 tokens ..."), SGLang ("Requested token count exceeds the model's maximum
# context length of ..." / "The input (40000 tokens) is longer than the model's context length (32768 tokens)"),
# TGI ("Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096"), OpenAI ("... context length").
OVERFLOW_MESSAGE = re.compile(
    r"context[ _-]?(?:length|window|size)|maximum (?:model |input |sequence )?(?:length|len\b)|max_model_len"
    r"|longer than the model|too many (?:input )?tokens|(?:prompt|input) is too long|tokens \+ `?max_new_tokens",
    re.IGNORECASE)
DETAIL_CHARS = 300  # the start of a server's error message kept in `error_detail`

_SECRETS = [
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]+"), r"\1 [redacted]"),
    (re.compile(r"\b(?:sk|pk|rk|hf|ghp|gho|xox[abp])[-_][A-Za-z0-9_-]{6,}"), "[redacted]"),
    (re.compile(r"(?i)\b(api[_-]?key|access[_-]?token|token|secret|password|authorization)(\"?\s*[:=]\s*\"?)[^\s\"',&;]+"),
     r"\1\2[redacted]"),
    (re.compile(r"(?i)(https?://)[^/\s:@]+:[^/\s@]+@"), r"\1[redacted]@"),
]


def redact_secrets(text: str) -> str:
    """`text` with bearer tokens, API keys (sk-..., hf_...), key=value secrets and URL credentials replaced by
    `[redacted]`.

    >>> redact_secrets("bad key Bearer sk-abc123def456 for api_key=xyz")
    'bad key Bearer [redacted] for api_key=[redacted]'
    """
    for pattern, repl in _SECRETS:
        text = pattern.sub(repl, text)
    return text


def error_detail(status: int | None, message: str | None) -> str:
    """`error_detail` of a failed request: "HTTP <status>" plus the start of the server's message (one line,
    at most DETAIL_CHARS characters, secrets redacted)."""
    head = f"HTTP {status}" if status is not None else "error"
    if not message:
        return head
    text = redact_secrets(" ".join(str(message).split()))
    if len(text) > DETAIL_CHARS:
        text = text[:DETAIL_CHARS] + "..."
    return f"{head}: {text}"


def error_object(body) -> dict | None:
    """The error object of a parsed error body, whatever the server's shape: OpenAI `{"error": {...}}`,
    vLLM/SGLang `{"object": "error", "message", "type", "code"}`, `{"error": "text"}`, FastAPI `{"detail": ...}`.
    Returns a dict with at least `message` (str or None) and `code` (as sent: int, str or None), or None."""
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    if isinstance(err, dict):
        return {**err, "message": _str_or_none(err.get("message")), "code": err.get("code")}
    if isinstance(err, str):
        return {"message": err, "code": body.get("code")}
    if body.get("object") == "error" or ("message" in body and ("code" in body or "type" in body)):
        return {**body, "message": _str_or_none(body.get("message")), "code": body.get("code")}
    if "detail" in body:
        return {"message": _str_or_none(body["detail"]), "code": None}
    return None


def _str_or_none(value) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)[:2 * DETAIL_CHARS]


def classify_status(status: int, error_code: str | int | None = None, message: str | None = None) -> str:
    """HTTP status (+ the structured `error.code` and `error.message` of the body, when any) -> error class.

    The status decides the family; within 400/422 the code `context_length_exceeded` or a message matching
    OVERFLOW_MESSAGE separates `context_overflow` from `bad_request`.

    >>> classify_status(429), classify_status(503), classify_status(400, "context_length_exceeded")
    ('rate_limited', 'server_error', 'context_overflow')
    >>> classify_status(400, 400, "This model's maximum context length is 32768 tokens. However, you requested 40000")
    'context_overflow'
    """
    if status == 429:
        return "rate_limited"
    if status >= 500 or status == 408:
        return "server_error" if status != 408 else "timeout"
    if status in (401, 403):
        return "auth"
    if status == 413 or error_code == "context_length_exceeded":
        return "context_overflow"
    if status in (400, 422) and message and OVERFLOW_MESSAGE.search(message):
        return "context_overflow"
    return "bad_request"


@dataclass
class Completion:
    """One parsed chat completion (choice 0), streamed or not.

    Token ids are int lists when the server returned them (`return_token_ids`), else None.
    `latency_s`/`ttft_s`: seconds from sending to the last / first body byte.
    """

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None
    finish_reason: str | None = None
    usage: dict | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    empty_body: bool = False
    latency_s: float = 0.0
    ttft_s: float | None = None
    endpoint: str = ""
    num_chunks: int = 0  # SSE events with a JSON payload (streamed responses)
    streamed: bool = False

    @property
    def num_completion_tokens(self) -> int | None:
        if self.usage and self.usage.get("completion_tokens") is not None:
            return int(self.usage["completion_tokens"])
        if self.completion_token_ids is not None:
            return len(self.completion_token_ids)
        return None

    @property
    def num_prompt_tokens(self) -> int | None:
        if self.usage and self.usage.get("prompt_tokens") is not None:
            return int(self.usage["prompt_tokens"])
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        return None

    @property
    def num_reasoning_tokens(self) -> int | None:
        details = (self.usage or {}).get("completion_tokens_details") or {}
        value = details.get("reasoning_tokens") if isinstance(details, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def assistant_message(self) -> dict:
        """The regenerated assistant turn as an OpenAI message (history for the next turn)."""
        msg: dict = {"role": "assistant", "content": self.content or ""}
        if self.reasoning_content:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def _args_ok(arguments) -> bool:
    if isinstance(arguments, dict):
        return True
    if not isinstance(arguments, str):
        return False
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def check_completion(c: Completion, think_markers: tuple[str, str] | list[str] = ("<think>", "</think>"),
                     end_markers: tuple[str, ...] | list[str] = (), max_tokens: int | None = None) -> list[str]:
    """Quality classes of a 200 OK, in QUALITY_CLASSES order; [] means the completion is clean (see `judge`).

    >>> check_completion(Completion(content="hi", finish_reason="stop"))
    []
    >>> check_completion(Completion(content="", finish_reason="length"))
    ['truncated', 'empty_content']
    >>> check_completion(Completion(content="partial", finish_reason="abort"))
    ['unfinished']
    """
    return [klass for klass, _ in judge(c, think_markers, end_markers, max_tokens)]


def judge(c: Completion, think_markers: tuple[str, str] | list[str] = ("<think>", "</think>"),
          end_markers: tuple[str, ...] | list[str] = (), max_tokens: int | None = None) -> list[tuple[str, str]]:
    """`(quality class, detail)` of every fault of a 200 OK, in QUALITY_CLASSES order; [] means clean.

    `end_markers`: the target template's end-of-turn strings (`generate.end_of_turn_markers`); `max_tokens`: the
    request's. An empty body, a content_filter stop or an unfinished answer is reported alone (the rest of such an
    answer is not judged: it is not an answer). The detail names the raw value or the numbers (for error_detail).
    """
    if c.empty_body:
        return [("empty_body", "200 with no choice")]
    if c.finish_reason == "content_filter":
        return [("content_filter", "finish_reason 'content_filter': the server's filter stopped the answer")]
    if c.finish_reason not in FINISHED:
        return [("unfinished", unfinished_detail(c))]
    found = []
    if c.finish_reason == "length":
        found.append(("truncated", "finish_reason 'length': cut at max_tokens"))
    content = c.content or ""
    if not content.strip() and not c.tool_calls:
        found.append(("empty_content", "no content and no tool calls"))
    if c.tool_calls and not all(_args_ok((tc.get("function") or {}).get("arguments")) for tc in c.tool_calls):
        found.append(("invalid_tool_args", "a tool call's function.arguments is not a JSON object"))
    open_m, close_m = think_markers[0], think_markers[1]
    n_open, n_close = content.count(open_m), content.count(close_m)
    reasoning = c.reasoning_content or ""
    if n_open != n_close or reasoning.count(open_m) != reasoning.count(close_m):
        found.append(("unbalanced_think", f"{n_open} {open_m!r} and {n_close} {close_m!r} in content"))
    elif n_open:
        found.append(("reasoning_leak", f"{n_open} paired {open_m!r} block(s) in content"))
    after = text_after_end(c, end_markers)
    if after:
        found.append(("text_after_end", after))
    found.extend(usage_faults(c, max_tokens))
    return found


def unfinished_detail(c: Completion) -> str:
    """Why an answer is not finished, with the raw finish_reason."""
    if c.finish_reason is None:
        if c.streamed:
            return ("finish_reason null in every chunk before [DONE]: the stream ended without saying the answer "
                    "finished (vLLM #27572)")
        return "finish_reason null or missing in the response"
    return (f"finish_reason {c.finish_reason!r} is not one of {', '.join(FINISHED)} (vLLM sends 'abort' when the "
            "engine aborts a request, vLLM #57082): a partial answer")


def _answer_texts(c: Completion):
    """(where, text) of every generated text of `c`, in generation order: reasoning, content, tool arguments."""
    yield "reasoning_content", c.reasoning_content or ""
    yield "content", c.content or ""
    for j, tc in enumerate(c.tool_calls or []):
        args = (tc.get("function") or {}).get("arguments")
        yield f"tool_calls[{j}].function.arguments", args if isinstance(args, str) else ""


def text_after_end(c: Completion, end_markers) -> str | None:
    """The detail of the first end-of-turn marker inside the answer (reasoning, content, tool arguments), or None.

    Run after `strip_echoed_end`: any marker still present is followed by more generated text."""
    return marker_after_end(list(_answer_texts(c)), end_markers) if end_markers else None


def strip_echoed_end(c: Completion, end_markers) -> str | None:
    """Remove one end-of-turn marker that ends the content with nothing after it (whitespace aside), when it is
    the only marker in the answer and no tool call follows; returns the marker removed, else None."""
    if not end_markers or c.tool_calls or not (c.content or "").strip():
        return None
    c.content, marker = strip_echo(c.content, [c.reasoning_content or ""], end_markers)
    return marker


def usage_faults(c: Completion, max_tokens: int | None) -> list[tuple[str, str]]:
    """`over_max_tokens` / `usage_inconsistent` findings of the server's usage (and token ids), with the numbers."""
    out = []
    usage = c.usage or {}
    completion = usage.get("completion_tokens")
    completion = completion if isinstance(completion, int) and not isinstance(completion, bool) else None
    num_ids = len(c.completion_token_ids) if c.completion_token_ids is not None else None
    if max_tokens is not None:
        over = [f"{what} {n}" for what, n in (("usage.completion_tokens", completion), ("completion token ids", num_ids))
                if n is not None and n > max_tokens]
        if over:
            out.append(("over_max_tokens", f"{' and '.join(over)} > max_tokens {max_tokens} of the request: the "
                                           "server generated past its limit (SGLang #31599)"))
    bad = []
    reasoning = c.num_reasoning_tokens
    for name, n in (("prompt_tokens", usage.get("prompt_tokens")), ("completion_tokens", completion),
                    ("completion_tokens_details.reasoning_tokens", reasoning)):
        if isinstance(n, int) and n < 0:
            bad.append(f"usage.{name} {n} < 0")
    if reasoning is not None and completion is not None and reasoning > completion:
        bad.append(f"usage.completion_tokens_details.reasoning_tokens {reasoning} > usage.completion_tokens "
                   f"{completion} (SGLang #39826)")
    if bad:
        out.append(("usage_inconsistent", "; ".join(bad)))
    return out


def tool_names(tool_calls: list[dict] | None) -> list[str]:
    """Function names of tool calls in order ([] for None)."""
    return [((tc.get("function") or {}).get("name") or "") for tc in (tool_calls or [])]
