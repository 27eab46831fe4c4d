"""Row shapes of prompt pools -> OpenAI-style `messages` + `tools` (the prompt record's content).

Recognized shapes (detected from a file's first row, or forced by `SourceConfig.fields`):

  string        a bare JSON string per row (OASST prompt lottery)
  conversations `conversations: [{from, value}]` (ShareGPT, LLaMA-Factory glaive, kimi-mtp-dataset) or
                `[{role, content}]`; ShareGPT `function_call`/`observation` turns become assistant
                `tool_calls` / `tool` messages; Kimi tool markers in assistant text are parsed into
                `tool_calls`; a turn whose value is a JSON list of OpenAI content parts becomes content parts
  messages      OpenAI `messages` (content a string or a list of parts, incl. LLaMA-Factory's
                `{type: text|reasoning|tool_call, value}` parts)
  turns         MT-Bench `turns`: a list of user turns (strings or `{content}` objects)
  bfcl          BFCL `question: [[{role, content}], ...]` + `function` (BFCL tool dialect) or
                `involved_classes` (tools from `multi_turn_func_doc/<class>.json` beside the file)
  instruction   Alpaca/GPTeacher `instruction` (+ `input`); the `response`/`output` is not kept
  prompt        one text field (`prompt`, `question`, `problem`, `problem_statement`, `text`, `input`, ...)
  tool_doc      BFCL tool-definition rows (`name`, `description`, `parameters`): not prompts; each row is
                accounted for as a reject with filter `not_a_prompt`

Conversation contract (what the generate stage receives): `messages` never ends with an assistant
message: trailing assistant turns are the answers to regenerate and are dropped; earlier assistant turns
are kept as context. The generate stage writes one assistant turn after every user or tool message that
is not followed by an assistant message, in order, each from the history so far (so an MT-Bench record of
two user messages and no assistant message means "answer the first, then the second").

A malformed row in a known shape raises `RowError(field, reason)`; the caller turns it into a reject with
filter `parse`. Tool schemas follow the OpenAI chat-completions `tools` format
(`[{type: "function", function: {name, description, parameters}}]`).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

PROMPT_FIELDS = ("prompt", "question", "problem", "problem_statement", "instruction", "query", "text", "input",
                 "content")
ROLE_ALIASES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
    "function_call": "tool_call", "tool_call": "tool_call", "observation": "tool", "tool": "tool",
    "function": "tool", "tool_response": "tool", "ipython": "tool",
}
# BFCL tool-schema dialect -> JSON Schema types (BFCL `model_handler/utils.py` convert_to_tool / GORILLA_TO_OPENAPI).
BFCL_TYPES = {
    "dict": "object", "float": "number", "double": "number", "tuple": "array", "Array": "array",
    "ArrayList": "array", "list": "array", "HashMap": "object", "String": "string", "str": "string",
    "char": "string", "long": "integer", "int": "integer", "short": "integer", "byte": "integer",
    "Boolean": "boolean", "bool": "boolean", "any": None,
}
# BFCL `involved_classes` -> multi_turn_func_doc file stem (BFCL `constants/category_mapping.py`).
BFCL_CLASS_FILES = {
    "GorillaFileSystem": "gorilla_file_system", "MathAPI": "math_api", "MessageAPI": "message_api",
    "TwitterAPI": "posting_api", "TicketAPI": "ticket_api", "TradingBot": "trading_bot",
    "TravelAPI": "travel_booking", "VehicleControlAPI": "vehicle_control", "WebSearchAPI": "web_search",
    "MemoryAPI_kv": "memory_kv", "MemoryAPI_vector": "memory_vector", "MemoryAPI_rec_sum": "memory_rec_sum",
}
KIMI_SECTION = re.compile(r"<\|tool_calls_section_begin\|>(.*?)<\|tool_calls_section_end\|>", re.S)
KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?P<id>[^<]+?)\s*<\|tool_call_argument_begin\|>(?P<args>.*?)<\|tool_call_end\|>", re.S
)
KIMI_ID = re.compile(r"^(?:functions\.)?(?P<name>[A-Za-z0-9_.\-]+):(?P<idx>\d+)$")


class RowError(ValueError):
    """A malformed row in a known shape: `field` names the offending field, `reason` says what is wrong."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def detect_shape(row, fields: dict[str, str]) -> tuple[str | None, dict[str, str]]:
    """The shape of a file from its first row: `(shape, field map)`; shape None when unrecognized."""
    f = dict(fields)
    if isinstance(row, str):
        return "string", f
    if not isinstance(row, dict):
        return None, f
    keys = set(row)
    for shape in ("conversations", "messages", "turns"):
        if shape in f:
            return shape, f
    if "instruction" in f and "prompt" not in f:
        return "instruction", f
    if "prompt" in f:
        return "prompt", f
    if "conversations" in keys:
        return "conversations", {"conversations": "conversations", **f}
    if "messages" in keys and isinstance(row["messages"], list):
        return "messages", {"messages": "messages", **f}
    if "question" in keys and isinstance(row["question"], list):
        return "bfcl", {"question": "question", **f}
    if "turns" in keys and isinstance(row["turns"], list):
        return "turns", {"turns": "turns", **f}
    if "instruction" in keys:
        return "instruction", {"instruction": "instruction", **f}
    if {"name", "parameters"} <= keys and not keys & set(PROMPT_FIELDS):
        return "tool_doc", f
    for name in PROMPT_FIELDS:
        if name in keys and isinstance(row[name], str):
            return "prompt", {"prompt": name, **f}
    return None, f


# ---------------------------------------------------------------------------------------------- tools


def _bfcl_schema(node):
    """Rewrite one BFCL parameter schema node (recursively) into JSON Schema types."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    t = out.get("type")
    if isinstance(t, str) and t in BFCL_TYPES:
        mapped = BFCL_TYPES[t]
        if mapped is None:
            out.pop("type")
        else:
            out["type"] = mapped
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: _bfcl_schema(v) for k, v in out["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = _bfcl_schema(out[key])
    return out


def openai_tools(raw, field: str, bfcl: bool = False) -> list[dict] | None:
    """Tools in any accepted form -> OpenAI `[{type: function, function: {...}}]`; None when empty.

    Accepts a JSON string (glaive), a list of bare function objects (glaive, BFCL) or of OpenAI tools.
    With `bfcl`, parameter types are rewritten (dict->object, float->number, ...) and dots in function
    names become underscores (as BFCL's OpenAI handler does). Raises RowError on bad JSON or a non-object tool.
    """
    if raw is None:
        return None
    if isinstance(raw, str):
        if not raw.strip():
            return None
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise RowError(field, f"tools is not valid JSON ({exc.msg} at char {exc.pos})") from None
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list):
        raise RowError(field, f"tools must be a list of function objects, got {type(raw).__name__}")
    tools = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict):
            raise RowError(field, f"tool {i} is a {type(t).__name__}, expected an object")
        fn = t["function"] if t.get("type") == "function" and isinstance(t.get("function"), dict) else t
        fn = {k: v for k, v in fn.items() if k in ("name", "description", "parameters", "strict")}
        if bfcl:
            if isinstance(fn.get("name"), str):
                fn["name"] = fn["name"].replace(".", "_")
            if isinstance(fn.get("parameters"), dict):
                fn["parameters"] = _bfcl_schema(fn["parameters"])
        tools.append({"type": "function", "function": fn})
    return tools or None


def bfcl_class_tools(classes, excluded, base_dir: Path, cache: dict) -> list[dict]:
    """Tools of BFCL `involved_classes` from `base_dir/multi_turn_func_doc/<stem>.json` (minus `excluded`)."""
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise RowError("involved_classes", "must be a list of class names")
    excluded = set(excluded or [])
    tools: list[dict] = []
    for cls in classes:
        stem = BFCL_CLASS_FILES.get(cls)
        if stem is None:
            raise RowError("involved_classes", f"unknown BFCL class {cls!r} (known: {sorted(BFCL_CLASS_FILES)})")
        path = base_dir / "multi_turn_func_doc" / f"{stem}.json"
        if path not in cache:
            if not path.exists():
                raise RowError("involved_classes", f"tool docs for {cls} not found at {path}")
            with open(path, encoding="utf-8") as fh:
                cache[path] = [json.loads(line) for line in fh if line.strip()]
        docs = [d for d in cache[path] if d.get("name") not in excluded]
        tools.extend(openai_tools(docs, "involved_classes", bfcl=True) or [])
    return tools


# ------------------------------------------------------------------------------------------- messages


def _content_parts(parts, field: str) -> list[dict]:
    """Validate OpenAI content parts (text / image_url); raises RowError naming the part."""
    out = []
    for j, p in enumerate(parts):
        if not isinstance(p, dict) or not isinstance(p.get("type"), str):
            raise RowError(field, f"content part {j} must be an object with a string 'type'")
        kind = p["type"]
        if kind == "text":
            if not isinstance(p.get("text"), str):
                raise RowError(field, f"content part {j} of type text has no string 'text'")
            out.append({"type": "text", "text": p["text"]})
        elif kind == "image_url":
            img = p.get("image_url")
            url = img.get("url") if isinstance(img, dict) else img
            if not isinstance(url, str) or not url:
                raise RowError(field, f"content part {j} of type image_url has no url")
            out.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise RowError(field, f"content part {j} has unsupported type {kind!r} (text, image_url)")
    return out


def _maybe_parts(text: str, field: str):
    """A turn value holding a JSON list of OpenAI content parts -> parts; other strings unchanged."""
    s = text.lstrip()
    if not (s.startswith("[{") and '"type"' in s[:200]):
        return text
    try:
        parts = json.loads(s)
    except json.JSONDecodeError as exc:
        raise RowError(field, f"content looks like JSON content parts but does not parse ({exc.msg})") from None
    if not isinstance(parts, list):
        return text
    return _content_parts(parts, field)


def _kimi_calls(text: str, field: str) -> tuple[str, list[dict]]:
    """Kimi tool markers in assistant text -> (text before the section, OpenAI tool_calls)."""
    if "<|tool_calls_section_begin|>" not in text and "<|tool_call_begin|>" not in text:
        return text, []
    m = KIMI_SECTION.search(text)
    if m is None:
        raise RowError(field, "Kimi tool-call section is not closed (<|tool_calls_section_end|> missing)")
    calls = []
    for c in KIMI_CALL.finditer(m.group(1)):
        call_id = c.group("id").strip()
        idm = KIMI_ID.match(call_id)
        if idm is None:
            raise RowError(field, f"Kimi tool call id {call_id!r} is not functions.NAME:INDEX")
        args = c.group("args").strip()
        try:
            json.loads(args)
        except json.JSONDecodeError:
            raise RowError(field, f"Kimi tool call {call_id!r} arguments are not valid JSON") from None
        calls.append({"id": call_id, "type": "function", "function": {"name": idm.group("name"), "arguments": args}})
    if not calls:
        raise RowError(field, "Kimi tool-call section holds no well-formed <|tool_call_begin|> ... <|tool_call_end|>")
    return text[: m.start()].rstrip(), calls


def _sharegpt_call(value, field: str, k: int) -> dict:
    """A ShareGPT `function_call` value (JSON {name, arguments}) -> one OpenAI tool call."""
    obj = value
    if isinstance(value, str):
        try:
            obj = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(field, f"function_call value is not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise RowError(field, "function_call value must be an object with a string 'name'")
    args = obj.get("arguments", {})
    args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": f"call_{k}", "type": "function", "function": {"name": obj["name"], "arguments": args}}


def conversation_messages(turns, field: str, role_key: str | None = None, content_key: str | None = None) -> list[dict]:
    """ShareGPT/Kimi/OpenAI turns -> validated OpenAI messages (trailing assistant turns dropped).

    Raises RowError for: a non-list or empty conversation, a non-object turn, a missing or unknown role,
    a non-string value, bad JSON in a tool call or content parts, a tool result without a pending call,
    an assistant-first conversation, or no user message.
    """
    if not isinstance(turns, list):
        raise RowError(field, f"must be a list of turns, got {type(turns).__name__}")
    if not turns:
        raise RowError(field, "empty conversation")
    messages: list[dict] = []
    pending: list[dict] = []
    k = 0
    for i, t in enumerate(turns):
        where = f"{field}[{i}]"
        if not isinstance(t, dict):
            raise RowError(where, f"turn is a {type(t).__name__}, expected an object")
        rk = role_key or ("from" if "from" in t else "role")
        ck = content_key or ("value" if "value" in t else "content")
        if rk not in t:
            keys = f"{role_key!r}" if role_key else "'from' or 'role'"
            raise RowError(where, f"turn has no role field ({keys})")
        raw_role = t[rk]
        role = ROLE_ALIASES.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            raise RowError(where, f"unknown role {raw_role!r} (known: {sorted(ROLE_ALIASES)})")
        value = t.get(ck)
        if role == "tool_call":
            call = _sharegpt_call(value, where, k)
            k += 1
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            pending.append(call)
            continue
        if isinstance(value, list):
            value = _content_parts(value, where)
        elif not isinstance(value, str):
            if value is None and role == "assistant" and t.get("tool_calls"):
                value = None
            else:
                raise RowError(where, f"{ck!r} must be a string, got {type(value).__name__}")
        if role == "tool":
            if not pending:
                raise RowError(where, "tool result without a preceding tool call")
            call = pending.pop(0)
            msg = {"role": "tool", "content": value if isinstance(value, str) else json.dumps(value),
                   "tool_call_id": t.get("tool_call_id") or call["id"], "name": call["function"]["name"]}
            messages.append(msg)
            continue
        msg: dict = {"role": role}
        if role == "assistant":
            calls = []
            if isinstance(value, str):
                value, calls = _kimi_calls(value, where)
            if t.get("tool_calls"):
                calls = calls + _openai_calls(t["tool_calls"], where)
            if isinstance(t.get("reasoning_content"), str):
                msg["reasoning_content"] = t["reasoning_content"]
            msg["content"] = value if (value or not calls) else None
            if calls:
                msg["tool_calls"] = calls
                pending.extend(calls)
        else:
            msg["content"] = _maybe_parts(value, where) if isinstance(value, str) else value
        messages.append(msg)
    return finish_conversation(messages, field)


def _openai_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise RowError(where, "tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RowError(where, f"tool_calls[{j}] has no function.name")
        args = fn.get("arguments", "{}")
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        out.append({"id": c.get("id") or f"call_{j}", "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def openai_messages(raw, field: str) -> list[dict]:
    """OpenAI `messages` (with LLaMA-Factory typed parts) -> validated messages; see conversation_messages."""
    if isinstance(raw, list):
        fixed = []
        for i, m in enumerate(raw):
            if isinstance(m, dict) and isinstance(m.get("content"), list) and m["content"] and all(
                isinstance(p, dict) and "value" in p for p in m["content"]
            ):
                m = _lf_message(m, f"{field}[{i}]")
            fixed.append(m)
        raw = fixed
    return conversation_messages(raw, field, role_key="role", content_key="content")


def _lf_message(m: dict, where: str) -> dict:
    """LLaMA-Factory typed parts `[{type: text|reasoning|tool_call, value}]` -> one OpenAI message dict."""
    text, reasoning, calls = [], [], []
    for j, p in enumerate(m["content"]):
        kind, value = p.get("type"), p.get("value")
        if kind == "text":
            text.append(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
        elif kind == "reasoning":
            reasoning.append(str(value))
        elif kind == "tool_call":
            calls.append(_sharegpt_call(value, where, j))
        else:
            raise RowError(where, f"content part {j} has unknown type {kind!r} (text, reasoning, tool_call)")
    out = {"role": m.get("role"), "content": "\n".join(text)}
    if reasoning:
        out["reasoning_content"] = "\n".join(reasoning)
    if calls:
        out["tool_calls"] = [{"id": f"call_{j}", **{k: v for k, v in c.items() if k != "id"}} for j, c in enumerate(calls)]
    return out


def finish_conversation(messages: list[dict], field: str) -> list[dict]:
    """Check conversation order and drop trailing assistant turns (the answers to regenerate)."""
    body = [m for m in messages if m["role"] != "system"]
    if not body:
        raise RowError(field, "conversation has no user message")
    if body[0]["role"] != "user":
        raise RowError(field, f"conversation starts with {body[0]['role']!r}, expected a user turn first")
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    return messages


def user_turn_messages(turns, field: str) -> list[dict]:
    """MT-Bench `turns` (strings or `{content}` objects) -> user messages only."""
    if not isinstance(turns, list):
        raise RowError(field, f"must be a list of user turns, got {type(turns).__name__}")
    if not turns:
        raise RowError(field, "empty list of turns")
    out = []
    for i, t in enumerate(turns):
        if isinstance(t, dict):
            t = t.get("content")
        if not isinstance(t, str):
            raise RowError(f"{field}[{i}]", f"turn must be a string or {{content: string}}, got {type(t).__name__}")
        out.append({"role": "user", "content": t})
    return out


def bfcl_messages(question, field: str) -> list[dict]:
    """BFCL `question`: a list of turns, each a list of messages (user turns only) -> flat messages."""
    if not isinstance(question, list) or not question:
        raise RowError(field, "must be a non-empty list of turns (each a list of messages)")
    flat = []
    for i, turn in enumerate(question):
        if not isinstance(turn, list):
            raise RowError(f"{field}[{i}]", f"turn must be a list of messages, got {type(turn).__name__}")
        for j, m in enumerate(turn):
            if not isinstance(m, dict):
                raise RowError(f"{field}[{i}][{j}]", "message must be an object")
            flat.append(m)
    return conversation_messages(flat, field, role_key="role", content_key="content")


# ----------------------------------------------------------------------------------------------- rows


def _text_field(row: dict, name: str, required: bool = True) -> str | None:
    if name not in row or row[name] is None:
        if required:
            raise RowError(name, "missing field")
        return None
    v = row[name]
    if not isinstance(v, str):
        raise RowError(name, f"must be a string, got {type(v).__name__}")
    return v


def normalize_row(row, shape: str, fmap: dict[str, str], base_dir: Path | None = None, cache: dict | None = None):
    """One raw row of a known shape -> `(messages, tools, labels)`.

    `labels` holds the row's own `category`/`language` labels (strings) where the source has them.
    Raises RowError for a malformed row (the field and the reason).
    """
    cache = {} if cache is None else cache
    if shape == "string":
        if not isinstance(row, str):
            raise RowError("row", f"expected a string like the other rows, got {type(row).__name__}")
        return [{"role": "user", "content": row}], None, {}
    if not isinstance(row, dict):
        raise RowError("row", f"row is a {type(row).__name__}, expected an object")
    labels = {}
    for key, default in (("category", "category"), ("language", "lang")):
        col = fmap.get(key, default)
        if isinstance(row.get(col), str):
            labels[key] = row[col]
    if "source" in row and isinstance(row["source"], str):
        labels["source_label"] = row["source"]
    if isinstance(row.get("class"), str) and "category" not in labels:
        labels["category"] = row["class"]
    if isinstance(row.get("type"), str) and "category" not in labels:
        labels["category"] = row["type"]
    tools_col = fmap.get("tools", "tools")
    tools = None
    if shape == "conversations":
        col = fmap.get("conversations", "conversations")
        if col not in row:
            raise RowError(col, "missing field")
        messages = conversation_messages(row[col], col, fmap.get("role"), fmap.get("content"))
        tools = openai_tools(row.get(tools_col), tools_col)
    elif shape == "messages":
        col = fmap.get("messages", "messages")
        if col not in row:
            raise RowError(col, "missing field")
        messages = openai_messages(row[col], col)
        tools = openai_tools(row.get(tools_col), tools_col)
    elif shape == "turns":
        col = fmap.get("turns", "turns")
        if col not in row:
            raise RowError(col, "missing field")
        messages = user_turn_messages(row[col], col)
    elif shape == "bfcl":
        col = fmap.get("question", "question")
        if col not in row:
            raise RowError(col, "missing field")
        messages = bfcl_messages(row[col], col)
        if row.get("function") is not None:
            tools = openai_tools(row["function"], "function", bfcl=True)
        elif row.get("involved_classes") is not None:
            tools = bfcl_class_tools(row["involved_classes"], row.get("excluded_function"), base_dir or Path("."), cache)
    elif shape == "instruction":
        ins = _text_field(row, fmap.get("instruction", "instruction"))
        extra = _text_field(row, fmap.get("input", "input"), required=False)
        text = ins if not (extra and extra.strip()) else f"{ins}\n\n{extra}"
        messages = [{"role": "user", "content": text}]
    elif shape == "prompt":
        messages = [{"role": "user", "content": _text_field(row, fmap["prompt"])}]
    else:
        raise RowError("row", f"shape {shape!r} holds no prompt")
    if "system" in fmap:
        sys_text = _text_field(row, fmap["system"], required=False)
        if sys_text:
            messages = [{"role": "system", "content": sys_text}] + messages
    elif isinstance(row.get("system"), str) and row["system"].strip() and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": row["system"]}] + messages
    _check_tool_calls(messages, tools)
    return messages, tools, labels


def _check_tool_calls(messages: list[dict], tools: list[dict] | None) -> None:
    """Tool calls need declared tools: raises RowError for a call when the row declares no tools."""
    calls = [c for m in messages for c in m.get("tool_calls") or []]
    if calls and not tools:
        raise RowError("tools", f"conversation has {len(calls)} tool call(s) (first: "
                                f"{calls[0]['function']['name']!r}) but declares no tools")
