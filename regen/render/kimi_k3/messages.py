"""Message-level rules of the Kimi-K3 format (`shared/docs/kimi-k3-format.md` §2): validation with RenderError,
tool-call arguments (source number spelling kept), and the tool-result ordering of ENC."""
from __future__ import annotations

import json

KNOWN_ROLES = ("system", "user", "assistant", "tool")
# RenderError.reason: the code a `render` reject's reason starts with (docs/errors.md says what each means)
RENDER_REASONS = ("role_order", "tool_result_without_call", "bad_arguments", "unknown_content_part", "unknown_role",
                  "bad_message", "bad_option")


class RenderError(ValueError):
    """A conversation that cannot be rendered as a training row. `reason` is a short code for `rejected/`
    (one of RENDER_REASONS); `index` is the offending position in `messages` (None for an option). The message names both
    and the fix."""

    def __init__(self, reason: str, detail: str, index: int | None = None):
        assert reason in RENDER_REASONS, f"RenderError reason {reason!r} is not in RENDER_REASONS"
        where = f"messages[{index}]: " if index is not None else ""
        super().__init__(f"{where}{detail}")
        self.reason, self.detail, self.index = reason, detail, index

    def __reduce__(self):  # picklable across worker processes
        return (RenderError, (self.reason, self.detail, self.index))


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


def check_renderable(messages: list) -> None:
    """Raise RenderError exactly where ENC (`build_chat_segments`) raises, and nowhere else:
    the renderer must equal the reference on every input the reference accepts. Whether such data make a good
    training row is `row_problems`' (and the render stage's row checks') business, not the renderer's.

    ENC raises for: messages that are not a list; a dict message without a `role` key; a tool call that is not a
    dict or has no `name`; arguments that are not a dict / string (or JSON that is not an object, checked while
    rendering); content that is neither a string, null nor a list; a content part that is not a dict, has no
    `type`, or is not an image and has no `text`. (A tool message without a resolvable name is raised while
    rendering.) ENC accepts and renders: unknown roles and non-dict messages (skipped), roles in any order, tool
    results without (matching) calls, non-string reasoning (`str()`), any part type that has a `text`."""
    if not isinstance(messages, list):
        raise RenderError("bad_message", f"messages is a {type(messages).__name__}; give a list of message dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        if "role" not in m:
            raise RenderError("bad_message", "message has no 'role' key", i)
        if m["role"] not in KNOWN_ROLES:
            continue
        content = m.get("content")
        if m["role"] == "system" and m.get("tools"):
            content = None  # ENC renders a tool declaration instead of the content
        if content is not None and not isinstance(content, (str, list)):
            raise RenderError("bad_message", f"content is a {type(content).__name__}; give a string, null or a "
                                             "list of content parts", i)
        for j, part in enumerate(content if isinstance(content, list) else []):
            ptype = part.get("type") if isinstance(part, dict) else None
            if not isinstance(part, dict) or "type" not in part or (
                    ptype not in ("image", "image_url") and "text" not in part):
                raise RenderError("unknown_content_part", f"content[{j}] is {type(part).__name__} {ptype!r}; Kimi-K3 "
                                  "renders dict parts with a 'type' and a 'text' (or an image type) only", i)
        if m["role"] == "assistant":
            for j, call in enumerate(m.get("tool_calls") or []):
                fn = call.get("function", call) if isinstance(call, dict) else None
                if not isinstance(fn, dict) or "name" not in fn:
                    raise RenderError("bad_arguments", f"tool_calls[{j}] has no function.name", i)


def row_problems(messages: list) -> list[RenderError]:
    """What ENC renders but a training row must not contain, one RenderError per problem (empty: none). Codes:
    role_order, tool_result_without_call, bad_message, unknown_role, unknown_content_part. `regen show-render`
    reports them; the render stage rejects such rows in `regen.render.rows.check_messages`."""
    if not isinstance(messages, list):
        return [RenderError("bad_message", f"messages is a {type(messages).__name__}")]
    out: list[RenderError] = []
    if not messages:
        out.append(RenderError("bad_message", "messages is empty; give at least one message"))
    prev, pending_calls, calls, ids, results = None, False, [], set(), 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            out.append(RenderError("bad_message", "each message must be a dict with a string 'role' (ENC skips it)", i))
            continue
        role = m["role"]
        if role not in KNOWN_ROLES:
            out.append(RenderError("unknown_role", f"role {role!r} is not one of {list(KNOWN_ROLES)}; ENC drops it: "
                                   "map it (e.g. developer -> system)", i))
            continue
        content = m.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") not in ("text", "image", "image_url"):
                out.append(RenderError("unknown_content_part", f"content[{j}] has type {part.get('type')!r}; "
                                       "a training row has 'text' and image parts only", i))
            elif isinstance(part, dict) and part.get("type") == "text" and not isinstance(part.get("text"), str):
                out.append(RenderError("unknown_content_part", f"content[{j}] has a non-string 'text'", i))
        if role == "assistant":
            rc = m.get("reasoning_content", m.get("reasoning"))
            if rc is not None and not isinstance(rc, str):
                out.append(RenderError("bad_message", f"reasoning_content is a {type(rc).__name__}; give a string "
                                       "or null", i))
            if prev == "assistant":
                out.append(RenderError("role_order", "two assistant messages in a row; merge them or insert the "
                                       "user/tool message between them", i))
            if pending_calls:
                out.append(RenderError("role_order", "assistant message follows tool_calls that have no tool "
                                       "results; add the tool messages or drop the calls", i))
            calls = m.get("tool_calls") or []
            ids = {str(c.get("id")) for c in calls if isinstance(c, dict) and c.get("id") is not None}
            pending_calls, results = bool(calls), 0
        elif role == "tool":
            results += 1
            cid = m.get("tool_call_id", m.get("id"))
            if not calls:
                out.append(RenderError("tool_result_without_call", "tool result with no tool_calls awaiting results "
                                       "(none in the last assistant message, or a user turn came between); drop it "
                                       "or add the assistant's call", i))
            elif cid is not None and ids and str(cid) not in ids:
                out.append(RenderError("tool_result_without_call", f"tool_call_id {cid!r} matches none of the last "
                                       f"assistant's call ids {sorted(ids)}; fix the id", i))
            elif results > len(calls):
                out.append(RenderError("tool_result_without_call", f"tool result #{results} after an assistant "
                                       f"message with {len(calls)} tool call(s); drop the extra result", i))
            pending_calls = False
        elif role == "user":
            if pending_calls:
                out.append(RenderError("role_order", "user message right after tool_calls without tool results; "
                                       "add the tool messages first", i))
            calls, ids, pending_calls = [], set(), False
        prev = role
    return out
