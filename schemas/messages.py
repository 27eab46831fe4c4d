"""OpenAI-style chat messages as an explicit Arrow type.

A message in Python is a plain dict in the OpenAI chat-completions shape
(`{"role": "user", "content": "..."}`; assistant turns may carry `reasoning_content` and `tool_calls`;
tool results carry `tool_call_id` and `name`). In Arrow it is `MESSAGE_TYPE`; content that is a list of
OpenAI content parts is stored in `content_parts` with `content` null.

Source of the shape: OpenAI chat-completions API reference (messages, tool_calls, content parts).
"""
from __future__ import annotations

import pyarrow as pa

TOOL_CALL_TYPE = pa.struct(
    [
        ("id", pa.string()),
        ("type", pa.string()),
        ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
    ]
)

CONTENT_PART_TYPE = pa.struct(
    [
        ("type", pa.string()),  # "text" | "image_url" | other part kinds kept by name
        ("text", pa.string()),
        ("image_url", pa.string()),
    ]
)

MESSAGE_TYPE = pa.struct(
    [
        ("role", pa.string()),  # system | user | assistant | tool
        ("content", pa.string()),
        ("content_parts", pa.list_(CONTENT_PART_TYPE)),
        ("name", pa.string()),
        ("reasoning_content", pa.string()),
        ("tool_calls", pa.list_(TOOL_CALL_TYPE)),
        ("tool_call_id", pa.string()),
    ]
)

ROLES = ("system", "user", "assistant", "tool")


def message_to_arrow(message: dict) -> dict:
    """One OpenAI-style message dict -> a dict matching `MESSAGE_TYPE` (missing fields None).

    `content` given as a list of parts goes to `content_parts`; `image_url` parts keep only the URL string.
    Raises TypeError when content is neither str, list nor None (callers turn that into a reject).
    """
    content = message.get("content")
    parts = None
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type")
            image = part.get("image_url")
            if isinstance(image, dict):
                image = image.get("url")
            parts.append({"type": kind, "text": part.get("text"), "image_url": image})
        content = None
    elif content is not None and not isinstance(content, str):
        raise TypeError(f"message content must be a string or a list of parts, got {type(content).__name__}")
    calls = message.get("tool_calls") or None
    if calls is not None:
        calls = [
            {
                "id": c.get("id"),
                "type": c.get("type", "function"),
                "function": {"name": c["function"]["name"], "arguments": c["function"].get("arguments")},
            }
            for c in calls
        ]
    return {
        "role": message["role"],
        "content": content,
        "content_parts": parts,
        "name": message.get("name"),
        "reasoning_content": message.get("reasoning_content"),
        "tool_calls": calls,
        "tool_call_id": message.get("tool_call_id"),
    }


def message_from_arrow(row: dict) -> dict:
    """Inverse of `message_to_arrow`: drop null fields, rebuild content parts in OpenAI form."""
    out: dict = {"role": row["role"]}
    if row.get("content_parts") is not None:
        parts = []
        for p in row["content_parts"]:
            if p["type"] == "image_url":
                parts.append({"type": "image_url", "image_url": {"url": p["image_url"]}})
            else:
                parts.append({k: v for k, v in p.items() if v is not None})
        out["content"] = parts
    else:
        out["content"] = row.get("content")
    for key in ("name", "reasoning_content", "tool_call_id"):
        if row.get(key) is not None:
            out[key] = row[key]
    if row.get("tool_calls"):
        out["tool_calls"] = [
            {"id": c["id"], "type": c["type"] or "function", "function": dict(c["function"])} for c in row["tool_calls"]
        ]
    return out
