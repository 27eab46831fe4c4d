"""Kimi-K3 "XTML" conversation format as labelled segments (`shared/docs/kimi-k3-format.md` §1-§3).

`build_segments(messages, tools, ...)` -> list[Segment]. Every ENC segment (`Segment.units()`) is tokenized on its
own (§3): control tokens and the image placeholder with `allowed_special="all"`, all text (tag names, attributes,
bodies, content) with `disallowed_special=()`. Consecutive structural units of one label are grouped into one
Segment so their ids can be cached. Labels (`kind`, `message`) let the renderer compute per-assistant-message
supervised spans (§6) without re-encoding text.

Decisions where the spec leaves a choice (§2, §8):
- `thinking_effort="medium"` raises RenderError, as ENC (the checkpoint's `encoding_k3.py`) does; pass
  `effort_aliases={"medium": "high", "xhigh": "max"}` for FW's remapping.
- The output equals ENC's on every input ENC accepts, and RenderError is raised only where ENC raises
  (`messages.check_renderable`): roles other than system/user/assistant/tool and non-dict
  messages are skipped, roles in any order and tool results without a matching call are rendered (the name from
  `tool`/`name`, the next index), non-string reasoning is `str()`-ed, any part with a `text` is text. Whether such
  a conversation makes a training row is decided by validation: `messages.row_problems` (reported by
  `regen show-render`) and the render stage's row checks (`regen.render.rows.check_messages`, rejects with a
  reason).
- Tool-result names and reordering follow ENC exactly: a run of consecutive tool messages is re-sorted into call
  order (and named after the matched call) only if every message of the run matches a call id of the last
  assistant message; otherwise names come from `tool`, then `name`, then the call at the same position.
- `None` / empty reasoning is valid: the think tags stay, the body is empty (§2).
"""
from __future__ import annotations

import json
from typing import NamedTuple

from regen.render.kimi_k3.messages import (  # noqa: F401  (RenderError re-exported)
    RenderError,
    _Num,
    check_renderable,
    dump_value,
    order_tool_results,
    parse_arguments,
    value_type,
)
from regen.render.kimi_k3.tokenizer import CLOSE, END_OF_MSG, OPEN, SEP

IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
VALID_EFFORTS = ("low", "high", "max")  # ENC `_VALID_THINKING_EFFORTS`

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


class Segment(NamedTuple):
    """One tokenization unit of the conversation.

    text: the string. special: encode with control tokens allowed (§3). kind: prompt / assistant_open /
    channel_open / generated / end_of_msg. message: index of the assistant message in the caller's `messages`
    (None outside assistant messages). parts: for a run of consecutive STRUCTURAL segments of one kind (control
    tokens, tag names, attributes, fixed bodies), the ENC segments it stands for as (text, special) pairs: each
    part is still encoded on its own, the run's ids are only cached as a whole; None for content segments.
    """

    text: str
    special: bool = False
    kind: str = PROMPT
    message: int | None = None
    parts: tuple[tuple[str, bool], ...] | None = None

    def units(self) -> tuple[tuple[str, bool], ...]:
        """The ENC segments (text, allow_special) this segment encodes as, in order (§3)."""
        return self.parts if self.parts is not None else ((self.text, self.special),)


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


class _Builder:
    """Appends labelled segments; `kind`/`message` are the current labels (`label()` changes them). Consecutive
    structural pieces of one label are collected into one Segment with `parts` (encoded part by part, cached)."""

    def __init__(self):
        self.out: list[Segment] = []
        self.kind, self.message = PROMPT, None
        self._parts: list[tuple[str, bool]] = []

    def label(self, kind: str, message: int | None = None) -> None:
        self.flush()
        self.kind, self.message = kind, message

    def flush(self) -> None:
        if self._parts:
            parts = tuple(self._parts)
            self._parts = []
            self.out.append(Segment("".join(t for t, _ in parts), True, self.kind, self.message, parts))

    def control(self, text: str) -> None:
        self._parts.append((text, True))

    def struct(self, text: str) -> None:
        if text:
            self._parts.append((text, False))

    def text(self, text) -> None:
        if text:
            self.flush()
            self.out.append(Segment(text, False, self.kind, self.message))

    def open(self, tag: str, attrs=()) -> None:
        self._parts.append((OPEN, True))
        self._parts.append((tag, False))
        for k, v in attrs:
            self._parts.append((f' {k}="{escape_attr(v)}"', False))
        self._parts.append((SEP, True))

    def close(self, tag: str) -> None:
        self._parts += ((CLOSE, True), (tag, False), (SEP, True))

    def internal(self, kind: str, body: str) -> None:
        self.open("message", (("role", "system"), ("type", kind)))
        self.struct(body.strip())
        self.close("message")
        self.control(END_OF_MSG)

    def content(self, content, index: int) -> None:
        """ENC `_render_content`: a string, or parts: image types -> the placeholder, any other -> str(text)
        (shapes ENC refuses were raised by `check_renderable`)."""
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
                self.flush()
                self.out.append(Segment(IMAGE_PLACEHOLDER, True, self.kind, self.message))
            elif isinstance(part, dict) and "text" in part:
                self.text(str(part["text"]))
            else:
                raise RenderError("unknown_content_part", f"content[{j}] has type {ptype!r}; Kimi-K3 renders "
                                  "'text' parts (with a string 'text') and 'image'/'image_url' parts only", index)


def _response_schema(response_format):
    js = response_format.get("json_schema") if isinstance(response_format, dict) else None
    if not isinstance(js, dict):
        return js
    return js.get("schema", js.get("json_schema", js))


def build_segments(messages: list, tools: list | None = None, *, thinking: bool = True,
                   thinking_effort: str | None = "max", add_generation_prompt: bool = True,
                   tool_choice=None, response_format=None, effort_aliases: dict[str, str] | None = None) -> list[Segment]:
    """Segments of one conversation in render order (§2): tool declaration, thinking-effort note, the
    conversation, tool-choice note, response-format note, generation prompt. Empty segments are dropped (§3).

    messages: OpenAI-style dicts (system/user/assistant/tool; `reasoning_content` or `reasoning`; `tool_calls`
        with `function.arguments` as JSON string or dict; content as string or parts). tools: OpenAI tool dicts.
    Defaults are TOK's `apply_chat_template` defaults (thinking on, effort "max", generation prompt on).
    Raises RenderError (see module docstring) for conversations or options that cannot be rendered.
    """
    check_renderable(messages)
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
            b.content(m.get("content"), i)
            b.close("message")
            b.control(END_OF_MSG)
        elif role == "assistant":
            prior_calls = m.get("tool_calls") or []
            tool_index = 0
            _assistant(b, m, i, thinking)
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
            b.content(m.get("content"), i)
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
        b.label(PROMPT)
        b.open("message", (("role", "assistant"),))
        b.open("think" if thinking else "response")
    b.flush()
    return b.out


def _assistant(b: _Builder, m: dict, i: int, thinking: bool) -> None:
    """An assistant message (§2), labelled: assistant_open, channel_open, generated..., end_of_msg."""
    b.label(ASSISTANT_OPEN, i)
    b.open("message", (("role", "assistant"),))
    b.label(CHANNEL_OPEN, i)
    if thinking:
        b.open("think")
        b.label(GENERATED, i)
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        if reasoning is not None and str(reasoning).strip():
            b.text(str(reasoning))
        b.close("think")
        b.open("response")
    else:
        b.open("response")
        b.label(GENERATED, i)
    b.content(m.get("content"), i)
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
    b.label(END, i)
    b.control(END_OF_MSG)
    b.label(PROMPT)
