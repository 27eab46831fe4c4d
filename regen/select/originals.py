"""The source's own answers beside a prompt: the `original_answers` of a prompt record (PROMPT_SCHEMA v2).

A prompt's turn positions (`schemas.prompt.turn_positions`) are its recorded assistant messages (originals
already, kept in `messages`) and the positions where an answer is inserted (after a user or tool message that
a user message follows or that ends the conversation). `original_answers` holds one assistant message for
each inserted position, or is null. Where the answers come from:

  conversations / messages   the trailing assistant turn the shape drops from `messages` (ShareGPT and
                             kimi-mtp `gpt` turns, LLaMA-Factory/glaive, OpenAI messages), with its
                             `reasoning_content` (`<think>` split) and `tool_calls` as normalized
  prompt / instruction       the first string field of `ANSWER_FIELDS` in the row (or the profile's
                             `fields: {answer: COL}`): GPTeacher/Alpaca `response`/`output`, BELLE
                             `std_answer`/`output`, MATH `solution`, MBPP `code`, gsm8k/MGSM `answer`;
                             HumanEval's `canonical_solution` completes its `prompt`, so the answer is
                             `prompt + canonical_solution` (the whole function)
  turns, bfcl, string        none (MT-Bench, BFCL and prompt lotteries ship no answers)

Reason codes when null (`original_missing`): `no_answer_field` (the shape or row has none), `answer_not_text`
(e.g. GAOKAO's `answer: ["D"]`), `empty_answer`, `no_answer` (a conversation that ends with a user or tool
turn), `unanswered_turns` (an inserted position before the end, e.g. two user turns in a row),
`several_answers` (more than one trailing assistant turn).
"""
from __future__ import annotations

from schemas.prompt import inserted_positions

# In order of preference: a full answer before a bare final value (MATH rows may carry both `solution` and
# `answer`).
ANSWER_FIELDS = ("response", "output", "std_answer", "solution", "canonical_solution", "code", "completion",
                 "answer")


def source_answer(row, shape: str, fmap: dict[str, str]) -> tuple[list[dict], str | None]:
    """The answer field of a `prompt`/`instruction` row: `([assistant message], None)`, or `([], reason)`."""
    if shape not in ("prompt", "instruction") or not isinstance(row, dict):
        return [], "no_answer_field"
    used = {fmap.get(k) for k in ("prompt", "instruction", "input")} | {"instruction", "input"}
    name = fmap.get("answer") or next((f for f in ANSWER_FIELDS if f in row and f not in used), None)
    if name is None or row.get(name) is None:
        return [], "no_answer_field"
    value = row[name]
    if not isinstance(value, str):
        return [], "answer_not_text"
    if name == "canonical_solution" and isinstance(row.get(fmap.get("prompt", "prompt")), str):
        value = row[fmap.get("prompt", "prompt")] + value
    return [{"role": "assistant", "content": value}], None


def original_answers(messages: list[dict], answers: list[dict] | tuple[list[dict], str | None]) \
        -> tuple[list[dict] | None, str | None]:
    """`(original_answers, None)` when `answers` answer every inserted position of `messages`, else
    `(None, reason)` (module doc). `answers`: the dropped trailing assistant turns, or `source_answer`'s pair."""
    if isinstance(answers, tuple):
        answers, reason = answers
        if reason:
            return None, reason
    inserted = inserted_positions(messages)
    if inserted != [len(messages)]:
        return None, "unanswered_turns"
    if not answers:
        return None, "no_answer"
    if len(answers) > 1:
        return None, "several_answers"
    answer = answers[0]
    content = answer.get("content")
    if not answer.get("tool_calls") and not (content.strip() if isinstance(content, str) else content):
        return None, "empty_answer"
    return [answer], None
