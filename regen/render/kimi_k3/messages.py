"""Message-level rules of the Kimi-K3 format (`shared/docs/kimi-k3-format.md` §2): validation with RenderError,
tool-call arguments (source number spelling kept), and the tool-result ordering of ENC."""
from __future__ import annotations

import json

KNOWN_ROLES = ("system", "user", "assistant", "tool")


class RenderError(ValueError):
    """A conversation that cannot be rendered as a training row. `reason` is a short code for `rejected/`
    (role_order, tool_result_without_call, bad_arguments, unknown_content_part, unknown_role, bad_message,
    bad_option); `index` is the offending position in `messages` (None for an option). The message names both
    and the fix."""

    def __init__(self, reason: str, detail: str, index: int | None = None):
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


def validate_messages(messages: list, strict: bool, unknown_roles: str) -> None:
    """Raise RenderError for a conversation that is not a valid training row (see `kimi_k3_format` docstring);
    with strict=False only for what ENC itself cannot render."""
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
