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
  instruction   Alpaca/GPTeacher `instruction` (+ `input`); the `response`/`output` is the original answer
  prompt        one text field (`prompt`, `question`, `problem`, `problem_statement`, `text`, `input`, ...)
  tool_doc      BFCL tool-definition rows (`name`, `description`, `parameters`): not prompts; each row is
                accounted for as a reject with filter `not_a_prompt`

Conversation contract (what the generate stage receives): `messages` never ends with an assistant
message: trailing assistant turns are the answers to regenerate and are dropped from `messages` (kept as the
prompt's `original_answers`, `regen.select.originals`); earlier assistant turns are kept as context. The generate stage
writes one assistant turn after every user or tool message that is not followed by an assistant message, in order, each
from the history so far (so an MT-Bench record of two user messages and no assistant message means "answer the first,
then the second").

A malformed row in a known shape raises `RowError(field, reason)`; the caller turns it into a reject with
filter `parse`. Tool schemas follow the OpenAI chat-completions `tools` format
(`[{type: "function", function: {name, description, parameters}}]`).
"""
from __future__ import annotations

import json
from pathlib import Path

from regen.select import strict_json
from regen.select.conversation import Conversation as _Conversation
from regen.select.errors import RowError, type_found, wrong_type
from regen.select.kimi_text import declared_tools, inferred_tools, kimi_calls, kimi_returns, split_think
from regen.select.originals import original_answers, source_answer
from regen.select.tool_schemas import bfcl_class_tools, openai_tools

PROMPT_FIELDS = ("prompt", "question", "problem", "problem_statement", "instruction", "query", "text", "input",
                 "content")
TURNS_EXPECTED = "a list of turns ({role, content} or {from, value} objects)"
ROLE_ALIASES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
    "function_call": "tool_call", "tool_call": "tool_call", "observation": "tool", "tool": "tool",
    "function": "tool", "tool_response": "tool", "ipython": "tool",
}


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


def mistyped_shape(row, fields: dict[str, str]) -> tuple[str | None, dict[str, str]]:
    """The shape a row would have if its prompt-carrying field had the right type: `messages` or `turns` that is
    not a list, a prompt field (`PROMPT_FIELDS`, in that order) that is not a string (`{"prompt": 12345}`, a list,
    null, an object). `(None, fields)` when the row has no such field. Used when no row of a file's sample has a
    recognized shape (`detect_shape`), so each row is a reject naming the field and its type instead of the file
    being refused for a shape it has."""
    f = dict(fields)
    if not isinstance(row, dict):
        return None, f
    for shape in ("messages", "turns"):
        if shape in row:
            return shape, {shape: shape, **f}
    for name in PROMPT_FIELDS:
        if name in row:
            return "prompt", {"prompt": name, **f}
    return None, f


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
        parts = strict_json.loads(s)
    except strict_json.DuplicateKey as exc:
        raise RowError(field, f"content parts: {exc}") from None
    except json.JSONDecodeError as exc:
        raise RowError(field, f"content looks like JSON content parts but does not parse ({exc.msg})") from None
    if not isinstance(parts, list):
        return text
    return _content_parts(parts, field)


def _sharegpt_calls(value, field: str) -> list[dict]:
    """A ShareGPT/LLaMA-Factory `function_call` value -> calls (source ids or None): a JSON `{name, arguments}`
    object, or a JSON list of them (parallel calls, in order)."""
    obj = value
    if isinstance(value, str):
        try:
            obj = strict_json.loads(value)
        except strict_json.DuplicateKey as exc:
            raise RowError(field, f"function_call value: {exc}") from None
        except json.JSONDecodeError as exc:
            raise RowError(field, f"function_call value is not valid JSON ({exc.msg})") from None
    items = obj if isinstance(obj, list) else [obj]
    if not items:
        raise RowError(field, "function_call value is an empty list of calls")
    calls = []
    for j, o in enumerate(items):
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            which = f"call {j} of the function_call list" if isinstance(obj, list) else "function_call value"
            raise RowError(field, f"{which} must be an object with a string 'name'")
        args = o.get("arguments", {})
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append({"id": o["id"] if isinstance(o.get("id"), str) and o["id"] else None, "type": "function",
                      "function": {"name": o["name"], "arguments": args}})
    return calls


def conversation_messages(turns, field: str, role_key: str | None = None, content_key: str | None = None,
                          answers: list | None = None) -> list[dict]:
    """ShareGPT/Kimi/OpenAI turns -> validated OpenAI messages (trailing assistant turns dropped; appended to
    `answers`, in order, when given: the source's own answers to the turn being regenerated).

    Tool calls: ShareGPT `function_call` turns (one call or a JSON list of parallel calls), OpenAI
    `tool_calls`, Kimi-K2 markers in assistant text (`regen.select.kimi_text`); each call gets an id unique
    within the conversation (the source's id when it is unique, else `call_<n>` / `functions.NAME:<n>`).
    Tool results are linked to their calls as `_Conversation` says.

    Raises RowError for: a non-list or empty conversation, a non-object turn, a missing or unknown role,
    a non-string value, bad JSON in a tool call or content parts, unbalanced Kimi markers, a tool result
    without a pending call, calls and results that do not match (count or id), an assistant-first
    conversation, or no user message.
    """
    if not isinstance(turns, list):
        raise wrong_type(field, turns, TURNS_EXPECTED)
    if not turns:
        raise RowError(field, "empty conversation")
    conv = _Conversation()
    i = 0
    while i < len(turns):
        t = turns[i]
        where = f"{field}[{i}]"
        role, value, ck = _turn_role(t, where, role_key, content_key)
        if role == "tool_call":
            conv.add_calls(_sharegpt_calls(value, where), where)
            i += 1
            continue
        if role == "tool":
            results = []
            while i < len(turns) and _turn_role(turns[i], f"{field}[{i}]", role_key, content_key)[0] == "tool":
                _, value, ck = _turn_role(turns[i], f"{field}[{i}]", role_key, content_key)
                if isinstance(value, (list, dict)):
                    value = json.dumps(value, ensure_ascii=False)
                elif not isinstance(value, str):
                    raise wrong_type(f"{field}[{i}].{ck}", value, "a string")
                own = turns[i].get("tool_call_id")
                name = turns[i].get("name") if isinstance(turns[i].get("name"), str) and turns[i]["name"] else None
                results.extend([(own, name, value)] if isinstance(own, str) and own
                               else [(rid, name if rid is None else None, v) for rid, v in kimi_returns(value)])
                i += 1
            conv.add_results(results, where)
            continue
        if isinstance(value, list):
            value = _content_parts(value, where)
        elif not isinstance(value, str):
            if value is None and role == "assistant" and t.get("tool_calls"):
                value = None
            else:
                raise wrong_type(f"{where}.{ck}", value, "a string or a list of content parts")
        msg: dict = {"role": role}
        if role != "assistant":
            msg["content"] = _maybe_parts(value, where) if isinstance(value, str) else value
            conv.add(msg, where)
            i += 1
            continue
        calls = []
        if isinstance(value, str):
            reasoning, value = split_think(value)
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
            value, calls = kimi_calls(value, where)
        if t.get("tool_calls"):
            calls = calls + _openai_calls(t["tool_calls"], where)
        if isinstance(t.get("reasoning_content"), str):
            msg["reasoning_content"] = t["reasoning_content"]
        msg["content"] = value if (value or not calls) else None
        if calls:
            conv.add_calls(calls, where, msg)
        else:
            conv.add(msg, where)
        i += 1
    return finish_conversation(conv.messages, field, answers)


def _turn_role(t, where: str, role_key: str | None, content_key: str | None) -> tuple[str, object, str]:
    """(normalized role, value, content key) of one turn; raises RowError for a non-object or unknown role."""
    if not isinstance(t, dict):
        raise RowError(where, f"turn is {type_found(t)}, expected an object")
    rk = role_key or ("from" if "from" in t else "role")
    ck = content_key or ("value" if "value" in t else "content")
    if rk not in t:
        keys = f"{role_key!r}" if role_key else "'from' or 'role'"
        raise RowError(where, f"turn has no role field ({keys})")
    raw_role = t[rk]
    role = ROLE_ALIASES.get(raw_role) if isinstance(raw_role, str) else None
    if role is None:
        raise RowError(where, f"unknown role {raw_role!r} (known: {sorted(ROLE_ALIASES)})")
    return role, t.get(ck), ck


def _openai_calls(calls, where: str) -> list[dict]:
    """OpenAI `tool_calls` -> calls with the source's id (None when absent; made unique by the conversation)."""
    if not isinstance(calls, list):
        raise RowError(where, "tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RowError(where, f"tool_calls[{j}] has no function.name")
        args = fn.get("arguments", "{}")
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        _no_duplicate_keys(args, where, f"tool_calls[{j}] arguments")
        cid = c["id"] if isinstance(c.get("id"), str) and c["id"] else None
        out.append({"id": cid, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _no_duplicate_keys(text: str, field: str, what: str) -> None:
    """RowError when `text` is JSON holding a key twice (arguments a server or template would parse to the last
    value); text that is not JSON is left to the tool_schema filter."""
    try:
        strict_json.loads(text)
    except strict_json.DuplicateKey as exc:
        raise RowError(field, f"{what}: {exc}") from None
    except (json.JSONDecodeError, RecursionError):
        pass


def openai_messages(raw, field: str, answers: list | None = None) -> list[dict]:
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
    return conversation_messages(raw, field, role_key="role", content_key="content", answers=answers)


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
            calls.extend(_sharegpt_calls(value, where))
        else:
            raise RowError(where, f"content part {j} has unknown type {kind!r} (text, reasoning, tool_call)")
    out = {"role": m.get("role"), "content": "\n".join(text)}
    if reasoning:
        out["reasoning_content"] = "\n".join(reasoning)
    if calls:
        out["tool_calls"] = calls  # ids made unique by the conversation
    return out


def finish_conversation(messages: list[dict], field: str, answers: list | None = None) -> list[dict]:
    """Check conversation order and drop trailing assistant turns (the answers to regenerate; appended to
    `answers` in conversation order when given)."""
    body = [m for m in messages if m["role"] != "system"]
    if not body:
        raise RowError(field, "conversation has no user message")
    if body[0]["role"] != "user":
        raise RowError(field, f"conversation starts with {body[0]['role']!r}, expected a user turn first")
    cut = len(messages)
    while cut and messages[cut - 1]["role"] == "assistant":
        cut -= 1
    if answers is not None:
        answers.extend(messages[cut:])
    del messages[cut:]
    return messages


def user_turn_messages(turns, field: str) -> list[dict]:
    """MT-Bench `turns` (strings or `{content}` objects) -> user messages only."""
    if not isinstance(turns, list):
        raise wrong_type(field, turns, "a list of user turns (strings or {content: string} objects)")
    if not turns:
        raise RowError(field, "empty list of turns")
    out = []
    for i, t in enumerate(turns):
        where, expected = f"{field}[{i}]", "a string or {content: string}"
        if isinstance(t, dict):
            t, where, expected = t.get("content"), f"{where}.content", "a string (the user turn's text)"
        if not isinstance(t, str):
            raise wrong_type(where, t, expected)
        out.append({"role": "user", "content": t})
    return out


def bfcl_messages(question, field: str) -> list[dict]:
    """BFCL `question`: a list of turns, each a list of messages (user turns only) -> flat messages."""
    if not isinstance(question, list):
        raise wrong_type(field, question, "a string or a non-empty list of turns (each a list of messages)")
    if not question:
        raise RowError(field, "must be a non-empty list of turns (each a list of messages)")
    flat = []
    for i, turn in enumerate(question):
        if not isinstance(turn, list):
            raise wrong_type(f"{field}[{i}]", turn, "a list of messages (one BFCL turn)")
        for j, m in enumerate(turn):
            if not isinstance(m, dict):
                raise RowError(f"{field}[{i}][{j}]", "message must be an object")
            flat.append(m)
    return conversation_messages(flat, field, role_key="role", content_key="content")


# ----------------------------------------------------------------------------------------------- rows


def _text_field(row: dict, name: str, required: bool = True) -> str | None:
    """`row[name]` as text; None for an absent or null optional field. Raises RowError for a required field that
    is absent ("missing field") or null, and for a value of another type (named with its type and a preview)."""
    if name not in row or (row[name] is None and not required):
        if required:
            raise RowError(name, "missing field")
        return None
    v = row[name]
    if not isinstance(v, str):
        raise wrong_type(name, v, "a string (the prompt text)" if required else "a string")
    return v


def normalize_row(row, shape: str, fmap: dict[str, str], base_dir: Path | None = None, cache: dict | None = None,
                  infer_tools: bool = True):
    """One raw row of a known shape -> `(messages, tools, labels)`.

    `labels` holds the row's own `category`/`language` labels (strings) where the source has them,
    `tools_inferred: True` when the tools were inferred from the calls (see `resolve_tools`), and
    `original_answers` (a list of assistant messages, or None) with `original_missing` (why None: a reason
    code) from `regen.select.originals.original_answers`: the source's own answers beside the prompt.
    Raises RowError for a malformed row (the field and the reason).
    """
    cache = {} if cache is None else cache
    if shape == "string":
        if not isinstance(row, str):
            raise wrong_type("row", row, "a string like the other rows")
        return [{"role": "user", "content": row}], None, {}
    if not isinstance(row, dict):
        raise RowError("row", f"row is {type_found(row)}, expected an object")
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
    trailing: list[dict] | None = None  # conversation shapes: the dropped trailing assistant turns
    if shape == "conversations":
        col = fmap.get("conversations", "conversations")
        if col not in row:
            raise RowError(col, "missing field")
        trailing = []
        messages = conversation_messages(row[col], col, fmap.get("role"), fmap.get("content"), trailing)
        tools = openai_tools(row.get(tools_col), tools_col)
    elif shape == "messages":
        col = fmap.get("messages", "messages")
        if col not in row:
            raise RowError(col, "missing field")
        trailing = []
        messages = openai_messages(row[col], col, trailing)
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
    tools, inferred = resolve_tools(messages, tools, infer_tools)
    if inferred:
        labels["tools_inferred"] = True
    answers = source_answer(row, shape, fmap) if trailing is None else trailing
    labels["original_answers"], labels["original_missing"] = original_answers(messages, answers)
    return messages, tools, labels


def resolve_tools(messages: list[dict], tools: list[dict] | None, infer: bool) -> tuple[list[dict] | None, bool]:
    """`(tools, inferred)` for a conversation whose calls need declarations.

    Declared tools are kept. A row with calls but no `tools` field: JSON tool schemas written in its system
    text (`kimi_text.declared_tools`, e.g. a rendered `tool_declare` message); else, with `infer`, a minimal
    schema per called function (`kimi_text.inferred_tools`, `inferred=True`: the prompt's `tools_inferred`
    column). Raises RowError when there is nothing to declare the calls with and `infer` is off.
    """
    calls = [c for m in messages for c in m.get("tool_calls") or []]
    if not calls or tools:
        return tools, False
    system = "\n".join(m["content"] for m in messages if m["role"] == "system" and isinstance(m.get("content"), str))
    found = declared_tools(system) if system else None
    if found:
        return found, False
    if infer:
        return inferred_tools(calls), True
    raise RowError("tools", f"conversation has {len(calls)} tool call(s) (first: {calls[0]['function']['name']!r}) "
                            "but declares no tools (no tools field, no JSON tool schemas in the system text; "
                            "select.infer_tool_schemas is off)")
