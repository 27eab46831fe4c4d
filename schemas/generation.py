"""The generation record: one row per (prompt_id, turn) of a regeneration run.

`turn` is the 0-based index of the assistant turn being generated within the conversation. `messages` is the
exact request history sent for that turn (earlier turns already replaced by their regenerations), so a row is
self-contained for rendering. Written by `regen generate` to `runs/<name>/generations/part-*.parquet`.

Schema versions: 1 the first; 2 adds `length_band` and `mode`, copied from the prompt (PROMPT_SCHEMA v3), null
in rows of older runs and of prompts without them.
"""
from __future__ import annotations

import pyarrow as pa

from schemas.messages import MESSAGE_TYPE, TOOL_CALL_TYPE

SCHEMA_VERSION = 2

STATUSES = ("ok", "error", "skipped")

GENERATION_SCHEMA = pa.schema(
    [
        ("request_key", pa.string()),  # sha256 of everything that changes the answer (see regen.generate.stage)
        ("prompt_id", pa.string()),
        ("turn", pa.int32()),
        ("status", pa.string()),  # ok | error | skipped
        ("error_class", pa.string()),  # null when ok; e.g. transient, permanent, truncated, empty, invalid_tool_args
        ("error_detail", pa.string()),
        ("flags", pa.list_(pa.string())),  # quality classes kept under a "keep flagged" policy
        ("stop_reason", pa.string()),  # why a conversation stopped early, e.g. tool_result_mismatch
        ("category", pa.string()),
        ("language", pa.string()),
        ("model", pa.string()),
        ("endpoint", pa.string()),  # base URL only, never credentials
        ("messages", pa.list_(MESSAGE_TYPE)),  # request history for this turn
        ("tools", pa.string()),  # JSON, as sent
        ("request_params", pa.string()),  # JSON: sampling + extra body as sent (no secrets)
        ("reasoning_content", pa.string()),
        ("content", pa.string()),
        ("tool_calls", pa.list_(TOOL_CALL_TYPE)),
        ("finish_reason", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),  # server's exact ids when returned
        ("completion_token_ids", pa.list_(pa.int32())),
        ("num_prompt_tokens", pa.int32()),  # usage.prompt_tokens
        ("num_completion_tokens", pa.int32()),  # usage.completion_tokens
        ("num_reasoning_tokens", pa.int32()),  # usage.completion_tokens_details.reasoning_tokens when given
        ("latency_s", pa.float64()),  # whole request, seconds, last attempt
        ("ttft_s", pa.float64()),  # time to first byte/chunk, seconds, last attempt
        ("attempts", pa.int32()),
        ("finished_at", pa.timestamp("ms", tz="UTC")),
        ("length_band", pa.string()),  # v2: the prompt's input-length band (select.length_bands)
        ("mode", pa.string()),  # v2: the prompt's generation mode (generate.modes.<mode>), null: the section's
    ],
    metadata={"schema": "regen.generation", "schema_version": str(SCHEMA_VERSION)},
)
