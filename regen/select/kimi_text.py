"""Tool calls, tool results and tool declarations written as *text* in source rows -> structured form.

Grammar: `../shared/docs/kimi-k3-format.md` section 9, "Kimi-K2 markers inside source text" (the public K2
chat templates and vLLM's K2 tool parser):

  calls     `<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>{id}<|tool_call_argument_begin|>{json}
            <|tool_call_end|>`, then `<|tool_calls_section_end|>`; `{id}` is `functions.{name}:{index}` (the name
            is the part between `functions.` and the last `:`). Whitespace around markers is insignificant.
  results   a tool turn `## Return of {id}\n{content}` (several such blocks in one turn are several results)
  thinking  `<think>...</think>` before an assistant turn's content -> `reasoning_content`
  declared  a JSON list of OpenAI tool schemas (or one schema, or `{"tools": [...]}`) somewhere in the system
            text (e.g. a rendered `tool_declare` message); prose declarations hold no schema

When a row's calls have no declaration, `inferred_tools` builds a minimal schema from the calls' arguments
(JSON types of the values seen, nothing required); the caller flags such a prompt (`tools_inferred`).
A turn whose markers do not balance, an id not of the form above, or arguments that are not a JSON object
raise `RowError` (a `parse` reject with the reason).
"""
from __future__ import annotations

import json
import re

from regen.select import strict_json
from regen.select.errors import RowError

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END)
SECTION = re.compile(re.escape(SECTION_BEGIN) + r"(.*?)" + re.escape(SECTION_END), re.S)
CALL = re.compile(re.escape(CALL_BEGIN) + r"(?P<id>.*?)" + re.escape(ARG_BEGIN) + r"(?P<args>.*?)" + re.escape(CALL_END),
                  re.S)
RETURN = re.compile(r"^[ \t]*## Return of (?P<id>\S+)[ \t]*\r?\n?", re.M)
JSON_START = re.compile(r"[\[{]\s*[\"{]")
THINK = re.compile(r"^\s*<think>(?P<think>.*?)</think>\s*", re.S)
JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
              (dict, "object"))


def has_markers(text: str) -> bool:
    return any(m in text for m in MARKERS)


def call_name(call_id: str, field: str) -> str:
    """`functions.get_weather:0` -> `get_weather` (the part between `functions.` and the last `:`)."""
    head, sep, idx = call_id.rpartition(":")
    if not sep or not idx.strip().isdigit():
        raise RowError(field, f"Kimi tool call id {call_id!r} is not functions.NAME:INDEX")
    name = head[len("functions."):] if head.startswith("functions.") else head
    if not name or any(c.isspace() for c in name):
        raise RowError(field, f"Kimi tool call id {call_id!r} is not functions.NAME:INDEX")
    return name


def kimi_calls(text: str, field: str) -> tuple[str, list[dict]]:
    """An assistant turn's text with K2 call markers -> (text before the section, calls `{id, type, function}`).

    Text without markers comes back unchanged with no calls. Raises RowError when the markers do not balance
    (one section; as many call begins as argument begins and call ends), for a bad id or non-object arguments.
    """
    if not has_markers(text):
        return text, []
    counts = {m: text.count(m) for m in MARKERS}
    if counts[SECTION_BEGIN] != 1 or counts[SECTION_END] != 1:
        if counts[SECTION_END] == 0 and counts[SECTION_BEGIN]:
            raise RowError(field, "Kimi tool-call section is not closed (<|tool_calls_section_end|> missing)")
        raise RowError(field, f"Kimi tool-call markers do not balance: {counts[SECTION_BEGIN]} section begin(s), "
                              f"{counts[SECTION_END]} section end(s) (expected one of each)")
    if not counts[CALL_BEGIN] == counts[ARG_BEGIN] == counts[CALL_END]:
        raise RowError(field, f"Kimi tool-call markers do not balance: {counts[CALL_BEGIN]} call begin(s), "
                              f"{counts[ARG_BEGIN]} argument begin(s), {counts[CALL_END]} call end(s)")
    m = SECTION.search(text)
    if m is None:
        raise RowError(field, "Kimi tool-call section end comes before its begin")
    if m.group(0) != text[m.start():].rstrip():
        raise RowError(field, "text follows the Kimi tool-call section (the calls must end the turn)")
    calls = []
    for c in CALL.finditer(m.group(1)):
        call_id = c.group("id").strip()
        name = call_name(call_id, field)
        args = c.group("args").strip()
        try:
            obj = strict_json.loads(args)
        except strict_json.DuplicateKey as exc:
            raise RowError(field, f"Kimi tool call {call_id!r} arguments: {exc}") from None
        except json.JSONDecodeError:
            raise RowError(field, f"Kimi tool call {call_id!r} arguments are not valid JSON") from None
        if not isinstance(obj, dict):
            raise RowError(field, f"Kimi tool call {call_id!r} arguments are a JSON {type(obj).__name__}, not an object")
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
    if len(calls) != counts[CALL_BEGIN]:
        raise RowError(field, "Kimi tool-call section holds a malformed <|tool_call_begin|> ... <|tool_call_end|>")
    if not calls:
        raise RowError(field, "Kimi tool-call section holds no well-formed <|tool_call_begin|> ... <|tool_call_end|>")
    return text[: m.start()].rstrip(), calls


def split_think(text: str) -> tuple[str | None, str]:
    """`<think>r</think>content` -> ("r", "content"); text without a leading think block -> (None, text)."""
    m = THINK.match(text)
    if m is None:
        return None, text
    return m.group("think").strip(), text[m.end():]


def kimi_returns(text: str) -> list[tuple[str | None, str]]:
    """A tool turn's text -> `[(call id or None, content)]`: one entry per `## Return of {id}` block, or the
    whole text with no id when it has no such header."""
    heads = list(RETURN.finditer(text))
    if not heads or text[: heads[0].start()].strip():
        return [(None, text)]
    out = []
    for h, nxt in zip(heads, heads[1:] + [None]):
        body = text[h.end(): nxt.start() if nxt else len(text)]
        out.append((h.group("id"), body.rstrip("\n") if nxt else body))
    return out


def _schemas(obj) -> list[dict] | None:
    """A decoded JSON value -> tool schemas when it is one (`{name, parameters}`, `{type: function, function}`,
    a list of them, or `{"tools": [...]}`); else None."""
    if isinstance(obj, dict) and isinstance(obj.get("tools"), list):
        obj = obj["tools"]
    items = obj if isinstance(obj, list) else [obj]
    if not items:
        return None
    out = []
    for t in items:
        fn = t.get("function") if isinstance(t, dict) and isinstance(t.get("function"), dict) else t
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("parameters", fn.get("input_schema")), dict)):
            return None
        params = fn.get("parameters", fn.get("input_schema"))
        out.append({"type": "function", "function": {"name": fn["name"], "description": fn.get("description", ""),
                                                     "parameters": params}})
    return out


def declared_tools(text: str) -> list[dict] | None:
    """OpenAI tool schemas written as JSON inside free text (a system prompt); None when there are none.

    Every `[` or `{` that starts a JSON value holding tool schemas counts; schemas are kept in text order,
    a name declared twice once (first wins).
    """
    dec = json.JSONDecoder()
    found: list[dict] = []
    i = 0
    while True:
        m = JSON_START.search(text, i)
        if m is None:
            break
        try:
            obj, end = dec.raw_decode(text, m.start())
        except (json.JSONDecodeError, RecursionError):
            i = m.start() + 1
            continue
        tools = _schemas(obj)
        if tools:
            found.extend(tools)
            i = end
        else:
            i = m.start() + 1
    names: set = set()
    out = [t for t in found if not (t["function"]["name"] in names or names.add(t["function"]["name"]))]
    return out or None


def _json_type(v) -> str:
    return next(t for cls, t in JSON_TYPES if isinstance(v, cls))


def inferred_tools(calls: list[dict]) -> list[dict]:
    """A minimal schema per called function, from the arguments seen: `{type: object, properties: {arg:
    {type: JSON type}}}` (an argument seen with several types is left untyped), nothing required."""
    props: dict[str, dict[str, set]] = {}
    for c in calls:
        fn = c["function"]
        seen = props.setdefault(fn["name"], {})
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except json.JSONDecodeError:
            args = {}
        for k, v in (args.items() if isinstance(args, dict) else []):
            if v is not None:
                seen.setdefault(k, set()).add(_json_type(v))
    return [{"type": "function", "function": {
        "name": name, "description": "Schema inferred from the calls in the source row (no declaration found).",
        "parameters": {"type": "object",
                       "properties": {k: ({"type": next(iter(t))} if len(t) == 1 else {}) for k, t in seen.items()}},
    }} for name, seen in props.items()]
