"""Kimi-K3 "XTML" conversation format as labelled segments (`shared/docs/kimi-k3-format.md` §1-§3).

`build_segments(messages, tools, ...)` -> list[Segment]. Each Segment is tokenized on its own (§3): `special`
segments with `allowed_special="all"`, all others with `disallowed_special=()`. Labels (`kind`, `message`) let the
renderer compute per-assistant-message supervised spans (§6) without re-encoding text.

Decisions where the spec leaves a choice (§2, §8):
- `thinking_effort="medium"` raises RenderError, as ENC (the checkpoint's `encoding_k3.py`) does; pass
  `effort_aliases={"medium": "high", "xhigh": "max"}` for FW's remapping.
- Roles other than system/user/assistant/tool raise RenderError (`unknown_roles="error"`): ENC skips them
  silently, which drops content without a trace; `unknown_roles="skip"` reproduces ENC.
- Tool-result names and reordering follow ENC exactly: a run of consecutive tool messages is re-sorted into call
  order (and named after the matched call) only if every message of the run matches a call id of the last
  assistant message; otherwise names come from `tool`, then `name`, then the call at the same position.
- `strict=True` (default) also rejects what ENC would render silently but a training row must not contain:
  role-order errors, tool results without a call, unknown content parts, non-string reasoning.
  `None` / empty reasoning is valid: the think tags stay, the body is empty (§2).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from regen.tokenizer import CLOSE, END_OF_MSG, OPEN, SEP

IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
VALID_EFFORTS = ("low", "high", "max")  # ENC `_VALID_THINKING_EFFORTS`
KNOWN_ROLES = ("system", "user", "assistant", "tool")

# Segment kinds. Everything outside assistant messages is "prompt" (incl. the generation prompt).
PROMPT, ASSISTANT_OPEN, CHANNEL_OPEN, GENERATED, END = "prompt", "assistant_open", "channel_open", "generated", "end_of_msg"

EFFORT_BODY = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
               "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
               "Now the system is invoked with `thinking_effort={e}`.")
TOOLS_BODY = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{j}\n```"
DYNAMIC_TOOLS_BODY = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                      "You have access to all existing and extended tools.\nHere are the specs for the extended "
                      "tools.\n\n```json\n{j}\n```")
TOOL_CHOICE_BODY = "The system is invoked with `tool_choice={x}`.\nYou MUST {req} in the next message."
JSON_OBJECT_BODY = ("The system is invoked with `response_format={t}`.\nYour response must be raw JSON data without "
                    "markdown code blocks (```json) or any additional formatting.")
JSON_SCHEMA_TAIL = "\nThe JSON data must match the following schema:\n```json\n{j}\n```"


class RenderError(ValueError):
    """A conversation that cannot be rendered as a training row. `reason` is a short code for `rejected/`
    (role_order, tool_result_without_call, bad_arguments, unknown_content_part, unknown_role, bad_message,
    bad_option); `index` is the offending position in `messages` (None for an option). The message names both
    and the fix."""

    def __init__(self, reason: str, detail: str, index: int | None = None):
        where = f"messages[{index}]: " if index is not None else ""
        super().__init__(f"{where}{detail}")
        self.reason, self.index = reason, index


@dataclass(frozen=True, slots=True)
class Segment:
    """One tokenization unit. text: the string; special: encode with control tokens allowed; kind: one of
    prompt/assistant_open/channel_open/generated/end_of_msg; message: index of the assistant message in the
    caller's `messages` (None outside assistant messages); cached: structural text worth caching (tag names,
    attributes, fixed bodies)."""

    text: str
    special: bool = False
    kind: str = PROMPT
    message: int | None = None
    cached: bool = False


def escape_attr(value) -> str:
    """§1 attribute escaping (ENC): `&` -> `&amp;`, then `"` -> `&quot;`; nothing else."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def deep_sort(obj):
    """Recursively sort dict keys (list order kept), §2 tool declaration."""
    if isinstance(obj, dict):
        return {k: deep_sort(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [deep_sort(v) for v in obj]
    return obj


def compact_json(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class _Num(str):
    """A JSON number kept in its source spelling (`1e2` stays `1e2`, §2)."""


def parse_arguments(arguments, index: int, call: int) -> tuple[dict | None, str | None]:
    """`function.arguments` -> (arguments dict, None) or (None, raw text for a `json` block). §2 Tools section.

    None / "" / whitespace -> ({}, None); a non-JSON string -> (None, raw); numbers in a JSON string keep their
    spelling. Raises RenderError(bad_arguments) for JSON that is not an object or a value of another type.
    """
    if arguments is None:
        return {}, None
    if isinstance(arguments, dict):
        return arguments, None
    if not isinstance(arguments, str):
        raise RenderError("bad_arguments", f"tool_calls[{call}].function.arguments is a {type(arguments).__name__}; "
                                           "give a JSON object string or a dict", index)
    if not arguments.strip():
        return {}, None
    try:
        parsed = json.loads(arguments, parse_float=_Num, parse_int=_Num, parse_constant=_Num)
    except ValueError:
        return None, arguments
    if not isinstance(parsed, dict):
        raise RenderError("bad_arguments", f"tool_calls[{call}].function.arguments is JSON {type(parsed).__name__}, "
                                           "not an object; Kimi-K3 arguments must be a JSON object", index)
    return parsed, None


def value_type(v) -> str:
    """XTML `type` attribute of an argument value (ENC `_xtml_type`)."""
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    if isinstance(v, (_Num, int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    return "object" if isinstance(v, dict) else "array"


def dump_value(v) -> str:
    """JSON with `, ` and `: ` separators, source key order, non-ASCII kept, numbers in source spelling."""
    if isinstance(v, _Num):
        return str.__str__(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)}: {dump_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(dump_value(x) for x in v) + "]"
    return json.dumps(v, ensure_ascii=False)


class _Builder:
    """Appends labelled segments; `kind`/`message` are the current labels."""

    def __init__(self):
        self.out: list[Segment] = []
        self.kind, self.message = PROMPT, None

    def control(self, text: str) -> None:
        self.out.append(Segment(text, True, self.kind, self.message, True))

    def text(self, text, cached: bool = False) -> None:
        if text:
            self.out.append(Segment(text, False, self.kind, self.message, cached))

    def open(self, tag: str, attrs=()) -> None:
        self.control(OPEN)
        self.text(tag, True)
        for k, v in attrs:
            self.text(f' {k}="{escape_attr(v)}"', True)
        self.control(SEP)

    def close(self, tag: str) -> None:
        self.control(CLOSE)
        self.text(tag, True)
        self.control(SEP)

    def internal(self, kind: str, body: str) -> None:
        self.open("message", (("role", "system"), ("type", kind)))
        self.text(body.strip(), cached=len(body) <= 8192)
        self.close("message")
        self.control(END_OF_MSG)

    def content(self, content, index: int, strict: bool) -> None:
        if content is None:
            return
        if isinstance(content, str):
            self.text(content)
            return
        if not isinstance(content, list):
            raise RenderError("bad_message", f"content is a {type(content).__name__}; give a string, null or a "
                                             "list of content parts", index)
        for j, part in enumerate(content):
            ptype = part.get("type") if isinstance(part, dict) else None
            if ptype in ("image", "image_url"):
                self.out.append(Segment(IMAGE_PLACEHOLDER, True, self.kind, self.message))
            elif isinstance(part, dict) and isinstance(part.get("text"), str) and (ptype == "text" or not strict):
                self.text(part["text"])
            else:
                raise RenderError("unknown_content_part", f"content[{j}] has type {ptype!r}; Kimi-K3 renders "
                                  "'text' parts (with a string 'text') and 'image'/'image_url' parts only", index)


def _call_index(message: dict) -> dict[str, tuple[int, str | None]]:
    found: dict[str, tuple[int, str | None]] = {}
    for pos, call in enumerate(message.get("tool_calls") or [], start=1):
        fn = call.get("function", call) if isinstance(call, dict) else {}
        if isinstance(call, dict) and call.get("id") is not None:
            found.setdefault(str(call["id"]), (pos, fn.get("name") if isinstance(fn, dict) else None))
    return found


def order_tool_results(messages: list) -> list[tuple[int, dict, str | None]]:
    """(original index, message, name from the matched call) in render order: ENC
    `normalize_xtml_tool_result_messages` (§2 Reordering)."""
    out: list[tuple[int, dict, str | None]] = []
    calls: dict[str, tuple[int, str | None]] = {}
    i = 0
    while i < len(messages):
        m = messages[i]
        if not (isinstance(m, dict) and m.get("role") == "tool"):
            if isinstance(m, dict) and m.get("role") == "assistant":
                calls = _call_index(m)
            out.append((i, m, None))
            i += 1
            continue
        run = []
        resolved = True
        while i < len(messages) and isinstance(messages[i], dict) and messages[i].get("role") == "tool":
            t = messages[i]
            cid = t.get("tool_call_id", t.get("id"))
            target = calls.get(str(cid)) if cid is not None else None
            resolved = resolved and target is not None
            run.append((target[0] if target else 0, i, t, target[1] if target else None))
            i += 1
        if resolved:
            run.sort(key=lambda r: r[0])
            out.extend((j, t, name) for _, j, t, name in run)
        else:
            out.extend((j, t, None) for _, j, t, _ in run)
    return out


def _validate(messages: list, strict: bool, unknown_roles: str) -> None:
    if not isinstance(messages, list):
        raise RenderError("bad_message", f"messages is a {type(messages).__name__}; give a list of message dicts")
    if strict and not messages:
        raise RenderError("bad_message", "messages is empty; give at least one message")
    prev, pending_calls, calls, ids, results = None, False, [], set(), 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            if strict:
                raise RenderError("bad_message", "each message must be a dict with a string 'role'", i)
            continue
        role = m["role"]
        if role not in KNOWN_ROLES:
            if unknown_roles == "error":
                raise RenderError("unknown_role", f"role {role!r} is not one of {list(KNOWN_ROLES)}; map it (e.g. "
                                  "developer -> system) or set unknown_roles='skip' (ENC drops it)", i)
            continue
        if role == "assistant":
            for j, call in enumerate(m.get("tool_calls") or []):
                fn = call.get("function", call) if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise RenderError("bad_arguments", f"tool_calls[{j}] has no string function.name", i)
            rc = m.get("reasoning_content", m.get("reasoning"))
            if strict and rc is not None and not isinstance(rc, str):
                raise RenderError("bad_message", f"reasoning_content is a {type(rc).__name__}; give a string or null", i)
            if strict and prev == "assistant":
                raise RenderError("role_order", "two assistant messages in a row; merge them or insert the "
                                  "user/tool message between them", i)
            if strict and pending_calls:
                raise RenderError("role_order", "assistant message follows tool_calls that have no tool results; "
                                  "add the tool messages or drop the calls", i)
            calls = m.get("tool_calls") or []
            ids = {str(c.get("id")) for c in calls if isinstance(c, dict) and c.get("id") is not None}
            pending_calls, results = bool(calls), 0
        elif role == "tool":
            results += 1
            if strict:
                if not calls:
                    raise RenderError("tool_result_without_call", "tool result with no tool_calls in the last "
                                      "assistant message; drop it or add the assistant's call", i)
                cid = m.get("tool_call_id", m.get("id"))
                if cid is not None and ids and str(cid) not in ids:
                    raise RenderError("tool_result_without_call", f"tool_call_id {cid!r} matches none of the last "
                                      f"assistant's call ids {sorted(ids)}; fix the id", i)
                if results > len(calls):
                    raise RenderError("tool_result_without_call", f"tool result #{results} after an assistant "
                                      f"message with {len(calls)} tool call(s); drop the extra result", i)
            pending_calls = False
        elif strict and pending_calls and role == "user":
            raise RenderError("role_order", "user message right after tool_calls without tool results; add "
                              "the tool messages first", i)
        prev = role


def _response_schema(response_format):
    js = response_format.get("json_schema") if isinstance(response_format, dict) else None
    if not isinstance(js, dict):
        return js
    return js.get("schema", js.get("json_schema", js))


def build_segments(messages: list, tools: list | None = None, *, thinking: bool = True,
                   thinking_effort: str | None = "max", add_generation_prompt: bool = True,
                   tool_choice=None, response_format=None, strict: bool = True, unknown_roles: str = "error",
                   effort_aliases: dict[str, str] | None = None) -> list[Segment]:
    """Segments of one conversation in render order (§2): tool declaration, thinking-effort note, the
    conversation, tool-choice note, response-format note, generation prompt. Empty segments are dropped (§3).

    messages: OpenAI-style dicts (system/user/assistant/tool; `reasoning_content` or `reasoning`; `tool_calls`
        with `function.arguments` as JSON string or dict; content as string or parts). tools: OpenAI tool dicts.
    Defaults are TOK's `apply_chat_template` defaults (thinking on, effort "max", generation prompt on).
    Raises RenderError (see module docstring) for conversations or options that cannot be rendered.
    """
    if unknown_roles not in ("error", "skip"):
        raise RenderError("bad_option", f"unknown_roles={unknown_roles!r}; give 'error' or 'skip'")
    _validate(messages, strict, unknown_roles)
    effort = (effort_aliases or {}).get(thinking_effort, thinking_effort) if thinking_effort is not None else None
    if thinking and effort is not None and effort not in VALID_EFFORTS:
        raise RenderError("bad_option", f"thinking_effort={thinking_effort!r}; Kimi-K3 accepts {list(VALID_EFFORTS)} "
                          "or None (ENC raises on 'medium'; map it with effort_aliases={'medium': 'high'})")
    b = _Builder()
    if tools:
        b.internal("tool-declare", TOOLS_BODY.format(j=compact_json(deep_sort(tools))))
    if thinking and effort:
        b.internal("thinking-effort", EFFORT_BODY.format(e=effort))
    prior_calls: list = []
    tool_index = 0
    for i, m, matched_name in order_tool_results(messages):
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        if role == "system" and m.get("tools"):
            b.internal("tool-declare", DYNAMIC_TOOLS_BODY.format(j=compact_json(deep_sort(m["tools"]))))
        elif role in ("user", "system"):
            attrs = [("role", role)] + ([("name", m["name"])] if m.get("name") else [])
            b.open("message", attrs)
            b.content(m.get("content"), i, strict)
            b.close("message")
            b.control(END_OF_MSG)
        elif role == "assistant":
            prior_calls = m.get("tool_calls") or []
            tool_index = 0
            _assistant(b, m, i, thinking, strict)
        elif role == "tool":
            tool_index += 1
            name = matched_name if matched_name is not None else m.get("tool", m.get("name"))
            if name is None and tool_index <= len(prior_calls):
                call = prior_calls[tool_index - 1]
                name = call.get("function", call).get("name")
            if name is None:
                raise RenderError("tool_result_without_call", "tool message has no resolvable tool name (no "
                                  "matching tool_call_id, 'tool' or 'name' key, or call at its position)", i)
            b.open("message", (("role", "tool"), ("tool", name), ("index", tool_index)))
            b.content(m.get("content"), i, strict)
            b.close("message")
            b.control(END_OF_MSG)
    if tool_choice in ("required", "none"):
        req = "call tools" if tool_choice == "required" else "NOT call any tools"
        b.internal("tool-choice", TOOL_CHOICE_BODY.format(x=tool_choice, req=req))
    rtype = response_format.get("type") if isinstance(response_format, dict) else response_format
    if rtype == "json_object":
        b.internal("response-format", JSON_OBJECT_BODY.format(t="json_object"))
    elif rtype == "json_schema":
        schema = compact_json(deep_sort(_response_schema(response_format)))
        b.internal("response-format", JSON_OBJECT_BODY.format(t="json_schema") + JSON_SCHEMA_TAIL.format(j=schema))
    if add_generation_prompt:
        b.kind, b.message = PROMPT, None
        b.open("message", (("role", "assistant"),))
        b.open("think" if thinking else "response")
    return b.out


def _assistant(b: _Builder, m: dict, i: int, thinking: bool, strict: bool) -> None:
    """An assistant message (§2), labelled: assistant_open, channel_open, generated..., end_of_msg."""
    b.kind, b.message = ASSISTANT_OPEN, i
    b.open("message", (("role", "assistant"),))
    b.kind = CHANNEL_OPEN
    if thinking:
        b.open("think")
        b.kind = GENERATED
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        if reasoning is not None and str(reasoning).strip():
            b.text(str(reasoning))
        b.close("think")
        b.open("response")
    else:
        b.open("response")
        b.kind = GENERATED
    b.content(m.get("content"), i, strict)
    b.close("response")
    calls = m.get("tool_calls") or []
    if calls:
        b.open("tools")
        for n, call in enumerate(calls, start=1):
            fn = call.get("function", call)
            args, raw = parse_arguments(fn.get("arguments"), i, n - 1)
            b.open("call", (("tool", fn["name"]), ("index", n)))
            if raw is not None:
                b.open("json", (("type", "object"),))
                b.text(raw)
                b.close("json")
            else:
                for key, value in args.items():
                    b.open("argument", (("key", key), ("type", value_type(value))))
                    try:
                        b.text(value if isinstance(value, str) and not isinstance(value, _Num) else dump_value(value))
                    except (TypeError, ValueError) as exc:
                        raise RenderError("bad_arguments", f"tool_calls[{n - 1}] argument {key!r}: {exc}", i) from None
                    b.close("argument")
            b.close("call")
        b.close("tools")
    b.close("message")
    b.kind = END
    b.control(END_OF_MSG)
    b.kind, b.message = PROMPT, None
