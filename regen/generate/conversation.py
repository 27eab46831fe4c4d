"""Turns of a conversation: where assistant turns are generated, what each request is, and its key.

Units of work. A prompt's `messages` may hold several user turns, recorded assistant turns, and tool turns
with recorded tool results. A *turn* (a `(prompt_id, turn)` unit, `turn` counted from 0) is generated at every
position where the original conversation has an assistant message, and after every user or tool message that
is followed by a user message or ends the conversation (so MT-Bench `turns: [q1, q2]`, stored as two user
messages, is answered turn by turn: q1, its answer, q2, its answer; parallel tool results are not split).
`turn_positions(messages)` (defined in `schemas.prompt`, where the prompt's `original_answers` use it too)
lists those positions; `generated + error rows + skipped == sum of len(positions)`.

History. Turn k is requested with the original messages before its position, every earlier assistant
message replaced by its regeneration (a position with no recorded assistant message inserts the regeneration
there). After turn k, the original messages up to the next position follow (user turns, recorded tool
results). When the regenerated turn's tool calls no longer match the recorded assistant's (function names, in order, and
their count), the recorded tool results cannot follow: the conversation stops there (`stop_reason =
"tool_result_mismatch"`), later turns become `skipped` rows. Recorded tool results keep their content; their
`tool_call_id` is rewritten to the regenerated call's id.

Request key: sha256 of canonical JSON over prompt_id, turn, model, messages, tools, sampling
(temperature, top_p, max_tokens, seed), extra_body and return_token_ids, and `served_by` when an embedded engine
serves (its engine, version and weights): everything that changes the answer (`stream` does not), plus the unit's
identity so two prompts sharing a first turn keep distinct rows. A prompt of a generation mode (`mode` column,
`generate.modes`) is keyed and requested with that mode's settings (`GenerateConfig.for_mode`).
"""
from __future__ import annotations

import hashlib
import json

from regen.config.generate import GenerateConfig
from regen.generate.checks import tool_names
from schemas.prompt import canonical_json, turn_positions  # noqa: F401 (turn_positions: re-exported)

# `stop_reason` of a row: why its conversation stopped before its last turn (the later turns are `skipped` rows
# carrying the same reason). TOOL_RESULT_MISMATCH: the regenerated turn's tool calls differ from the recorded
# ones, so the recorded tool results cannot follow; PREVIOUS_TURN_ERROR: an earlier turn ended as an error row.
TOOL_RESULT_MISMATCH = "tool_result_mismatch"
PREVIOUS_TURN_ERROR = "previous_turn_error"
STOP_REASONS = (TOOL_RESULT_MISMATCH, PREVIOUS_TURN_ERROR)


def _recorded(original: list[dict], pos: int) -> dict:
    """The recorded assistant message at `pos`, or {} where the turn is inserted (no recorded answer)."""
    return original[pos] if pos < len(original) and original[pos].get("role") == "assistant" else {}


def sampling_params(cfg: GenerateConfig) -> dict:
    """The sampling part of a request body (seed only when configured: some servers reject the field)."""
    params = {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_tokens}
    if cfg.seed is not None:
        params["seed"] = cfg.seed
    return params


def request_config(cfg: GenerateConfig) -> dict:
    """Everything in cfg that changes answers (hashed into the run's request-config hash); no secrets."""
    out = {"model": cfg.model, "sampling": sampling_params(cfg), "extra_body": cfg.extra_body,
           "return_token_ids": cfg.return_token_ids, "reasoning_in_history": cfg.reasoning_in_history}
    if cfg.served_by:  # only when set, so the hashes of runs against remote endpoints stay what they were
        out["served_by"] = cfg.served_by
    if cfg.modes:  # likewise: a profile without modes keeps its hash
        out["modes"] = {name: m.model_dump() for name, m in sorted(cfg.modes.items())}
    return out


def request_key(prompt_id: str, turn: int, cfg: GenerateConfig, messages: list[dict], tools: list[dict] | None) -> str:
    """sha256 hex (64 chars) of everything that changes this unit's answer (see module doc)."""
    fields = {
        "prompt_id": prompt_id, "turn": turn, "model": cfg.model, "messages": messages, "tools": tools or None,
        "sampling": sampling_params(cfg), "extra_body": cfg.extra_body, "return_token_ids": cfg.return_token_ids,
    }
    if cfg.served_by:
        fields["served_by"] = cfg.served_by
    payload = canonical_json(fields)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def skipped_key(prompt_id: str, turn: int, stopped_key: str) -> str:
    """Key of a skipped unit: derived from the key of the turn that stopped the conversation."""
    return hashlib.sha256(f"skipped|{prompt_id}|{turn}|{stopped_key}".encode()).hexdigest()


def request_body(cfg: GenerateConfig, messages: list[dict], tools: list[dict] | None) -> dict:
    """The JSON body of POST /v1/chat/completions (OpenAI API reference; extra_body keys merged at top level)."""
    body = {"model": cfg.model, "messages": messages, **sampling_params(cfg)}
    if tools:
        body["tools"] = tools
    body.update(cfg.extra_body)
    if cfg.return_token_ids:
        body["return_token_ids"] = True
    body["stream"] = cfg.stream
    if cfg.stream and cfg.stream_usage:
        body["stream_options"] = {"include_usage": True}
    return body


def history_message(assistant: dict, cfg: GenerateConfig) -> dict:
    """A regenerated assistant turn as it is sent back in later requests."""
    msg = {"role": "assistant", "content": assistant.get("content") or ""}
    if cfg.reasoning_in_history and assistant.get("reasoning_content"):
        msg["reasoning_content"] = assistant["reasoning_content"]
    if assistant.get("tool_calls"):
        msg["tool_calls"] = [
            {"id": tc.get("id"), "type": tc.get("type") or "function",
             "function": {"name": (tc.get("function") or {}).get("name"),
                          "arguments": (tc.get("function") or {}).get("arguments")}}
            for tc in assistant["tool_calls"]
        ]
    return msg


def next_segment(original: list[dict], positions: list[int], turn: int, assistant: dict) -> list[dict] | None:
    """The original messages between turn `turn` and the next one, to append after the regenerated
    `assistant`; None when the regenerated tool calls no longer match the recorded ones (stop).

    Tool messages answering the recorded calls get the regenerated call ids (matched by position).
    """
    pos = positions[turn]
    end = positions[turn + 1]
    recorded = _recorded(original, pos)
    if tool_names(assistant.get("tool_calls")) != tool_names(recorded.get("tool_calls")):
        return None
    id_map = {}
    for old, new in zip(recorded.get("tool_calls") or [], assistant.get("tool_calls") or []):
        if old.get("id") and new.get("id"):
            id_map[old["id"]] = new["id"]
    segment = []
    for m in original[pos + (1 if recorded else 0):end]:
        m = dict(m)
        if m.get("role") == "tool" and m.get("tool_call_id") in id_map:
            m["tool_call_id"] = id_map[m["tool_call_id"]]
        segment.append(m)
    return segment


def fill_missing_call_ids(assistant: dict, original: list[dict], pos: int) -> None:
    """Give regenerated tool calls without an id (or with an id repeated within the turn) a unique id.

    The recorded call's id at the same index is used when it is free, else `call_<pos>_<i>` (the turn's
    position in `original` makes it unique across the conversation's turns), skipping any id that `original`
    already uses elsewhere: a strict OpenAI-compatible server rejects a history whose call ids repeat.
    """
    recorded = _recorded(original, pos).get("tool_calls") or []
    taken = {tc.get("id") for i, m in enumerate(original) if i != pos for tc in m.get("tool_calls") or []}
    seen: set = set()
    for i, tc in enumerate(assistant.get("tool_calls") or []):
        if tc.get("id") and tc["id"] not in seen:
            seen.add(tc["id"])
            continue
        rec = recorded[i].get("id") if i < len(recorded) else None
        new = rec if rec and rec not in seen else f"call_{pos}_{i}"
        while new in seen or new in taken:
            new += "_"
        tc["id"] = new
        seen.add(new)


def tools_from_json(tools: str | None) -> list[dict] | None:
    return json.loads(tools) if tools else None
