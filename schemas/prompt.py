"""The prompt record: one normalized conversation selected for regeneration.

Written by `regen select` to `runs/<name>/prompts/part-*.parquet` with `PROMPT_SCHEMA`.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import pyarrow as pa

from schemas.messages import MESSAGE_TYPE, message_to_arrow

SCHEMA_VERSION = 1

CATEGORIES = ("general", "reasoning", "coding", "tool_use", "chinese", "multilingual")

PROMPT_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),  # sha256 (hex, 32 chars) of the normalized messages + tools
        ("messages", pa.list_(MESSAGE_TYPE)),
        ("tools", pa.string()),  # JSON list of OpenAI function tools, or null
        ("category", pa.string()),
        ("language", pa.string()),  # ISO 639-1 code, e.g. "en", "zh"
        ("source", pa.string()),  # source name from the profile
        ("source_file", pa.string()),
        ("source_row", pa.int64()),  # 0-based row index in source_file: a pointer back, never an identity
        ("num_turns", pa.int32()),  # user turns in the conversation
        ("num_prompt_tokens", pa.int32()),  # estimated prompt length used by the token-budget filter
        ("tools_inferred", pa.bool_()),  # tools inferred from the row's calls (no declaration in the source)
    ],
    metadata={"schema": "regen.prompt", "schema_version": str(SCHEMA_VERSION)},
)


def canonical_json(value) -> str:
    """Sorted-key compact JSON with non-ASCII kept: the canonical form hashed into ids and keys."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def prompt_id_of(messages: list[dict], tools: list[dict] | None) -> str:
    """Content hash of a normalized conversation: sha256 over canonical JSON, first 32 hex chars.

    Never depends on file position, so the same prompt from two files has the same id.
    """
    payload = canonical_json({"messages": messages, "tools": tools or None})
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:32]


@dataclass(frozen=True)
class PromptRecord:
    prompt_id: str
    messages: list[dict]
    tools: list[dict] | None
    category: str
    language: str
    source: str
    source_file: str
    source_row: int
    num_turns: int = 0
    num_prompt_tokens: int = 0
    tools_inferred: bool = False

    def to_arrow_row(self) -> dict:
        return {
            "prompt_id": self.prompt_id,
            "messages": [message_to_arrow(m) for m in self.messages],
            "tools": canonical_json(self.tools) if self.tools else None,
            "category": self.category,
            "language": self.language,
            "source": self.source,
            "source_file": self.source_file,
            "source_row": self.source_row,
            "num_turns": self.num_turns,
            "num_prompt_tokens": self.num_prompt_tokens,
            "tools_inferred": self.tools_inferred,
        }
