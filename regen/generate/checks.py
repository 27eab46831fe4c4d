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
* quality classes of a 200 OK (`QUALITY_CLASSES`, checked in this order): `empty_body`, `truncated`
  (finish_reason "length": thinking or answer cut by max_tokens), `empty_content` (no content and no tool
  calls), `invalid_tool_args` (function.arguments not a JSON object), `unbalanced_think` (think markers not
  paired in content or reasoning), `reasoning_leak` (a paired think block inside content). Each has a policy
  from the profile (`GenerateConfig.policy`): retry, retry_larger (max_tokens grows), keep_flagged (row kept
  with status ok and the class in `flags`), drop (error row at once).

Source of the wire shapes: OpenAI chat-completions API reference (choices[].message, finish_reason, usage,
error.code); vLLM's `return_token_ids` (top-level `prompt_token_ids`, `choices[].token_ids`).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

TRANSIENT = ("rate_limited", "server_error", "timeout", "connection", "malformed")
PERMANENT = ("bad_request", "context_overflow")
FATAL = ("auth",)
QUALITY_CLASSES = (
    "empty_body", "truncated", "empty_content", "invalid_tool_args", "unbalanced_think", "reasoning_leak",
)
# quality class -> broad kind, for the style guide's (transient, permanent, truncated, invalid) grouping
QUALITY_KIND = {
    "empty_body": "invalid", "truncated": "truncated", "empty_content": "invalid",
    "invalid_tool_args": "invalid", "unbalanced_think": "invalid", "reasoning_leak": "invalid",
}


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
        return int(value) if value is not None else None

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


def check_completion(c: Completion, think_markers: tuple[str, str] | list[str] = ("<think>", "</think>")) -> list[str]:
    """Quality classes of a 200 OK, in QUALITY_CLASSES order; [] means the completion is clean.

    >>> check_completion(Completion(content="hi", finish_reason="stop"))
    []
    >>> check_completion(Completion(content="", finish_reason="length"))
    ['truncated', 'empty_content']
    """
    if c.empty_body:
        return ["empty_body"]
    found = []
    if c.finish_reason == "length":
        found.append("truncated")
    content = c.content or ""
    if not content.strip() and not c.tool_calls:
        found.append("empty_content")
    if c.tool_calls and not all(_args_ok((tc.get("function") or {}).get("arguments")) for tc in c.tool_calls):
        found.append("invalid_tool_args")
    open_m, close_m = think_markers[0], think_markers[1]
    n_open, n_close = content.count(open_m), content.count(close_m)
    reasoning = c.reasoning_content or ""
    if n_open != n_close or reasoning.count(open_m) != reasoning.count(close_m):
        found.append("unbalanced_think")
    elif n_open:
        found.append("reasoning_leak")
    return found


def tool_names(tool_calls: list[dict] | None) -> list[str]:
    """Function names of tool calls in order ([] for None)."""
    return [((tc.get("function") or {}).get("name") or "") for tc in (tool_calls or [])]
