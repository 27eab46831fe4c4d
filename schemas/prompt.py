"""The prompt record: one normalized conversation selected for regeneration.

Written by `regen select` to `runs/<name>/prompts/part-*.parquet` with `PROMPT_SCHEMA`.

Schema versions:
  1  the conversation only.
  2  adds `original_answers`: the source's own answers for the turn positions (`turn_positions`) that hold no
     recorded assistant message in `messages` (in practice the final answer a conversation's trailing `gpt`
     turn, or a benchmark row's `answer`/`solution`/`response`/... field, gave; `regen.select.originals`).
     Null when the source has no answer for one of those positions. Recorded assistant messages inside
     `messages` are originals already, so a prompt "has an original" exactly when the column is not null.
     Readers of version-1 files treat the missing column as all null (`original_answers_of`).
  3  adds `length_band` (the input-length band of `num_prompt_tokens`, `select.length_bands`; null without
     bands) and `mode` (the generation mode, `select.modes`; null without modes: the generate section's
     settings). Readers of older files treat both as null.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import pyarrow as pa

from schemas.messages import MESSAGE_TYPE, message_to_arrow

SCHEMA_VERSION = 3

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
        # v2: the source's answers, one assistant message per turn position without a recorded one; or null
        ("original_answers", pa.list_(MESSAGE_TYPE)),
        ("length_band", pa.string()),  # v3: input-length band of num_prompt_tokens, e.g. "2K-8K"; null: no bands
        ("mode", pa.string()),  # v3: generation mode (generate.modes.<mode>); null: the generate section's settings
    ],
    metadata={"schema": "regen.prompt", "schema_version": str(SCHEMA_VERSION)},
)


def turn_positions(messages: list[dict]) -> list[int]:
    """Indices in `messages` where an assistant turn is generated: each recorded assistant message's index, and
    the index right after a user or tool message that a user message follows or that ends the conversation
    (the generated turn is inserted there; len(messages) for a final user/tool turn). The generate stage's
    unit of work (`regen.generate.conversation`) and the positions `original_answers` answers.

    >>> turn_positions([{"role": "user"}, {"role": "assistant"}, {"role": "user"}])
    [1, 3]
    >>> turn_positions([{"role": "user"}, {"role": "user"}])
    [1, 2]
    """
    pos = []
    for i, m in enumerate(messages):
        role = m.get("role")
        nxt = messages[i + 1].get("role") if i + 1 < len(messages) else None
        if role == "assistant":
            pos.append(i)
        elif role in ("user", "tool") and nxt in (None, "user"):
            pos.append(i + 1)
    return pos


def inserted_positions(messages: list[dict]) -> list[int]:
    """The `turn_positions` with no recorded assistant message (where an answer is inserted)."""
    return [p for p in turn_positions(messages) if p >= len(messages) or messages[p].get("role") != "assistant"]


def original_answers_of(row: dict) -> list[dict] | None:
    """The original answers of a prompt row read from Parquet (message dicts), or None: the column is null or
    absent (a version-1 file)."""
    from schemas.messages import message_from_arrow

    answers = row.get("original_answers")
    return [message_from_arrow(m) for m in answers] if answers is not None else None


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
    original_answers: list[dict] | None = None
    length_band: str | None = None
    mode: str | None = None

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
            "original_answers": ([message_to_arrow(m) for m in self.original_answers]
                                 if self.original_answers is not None else None),
            "length_band": self.length_band,
            "mode": self.mode,
        }
