"""Literal inputs for the render tests: small chat templates, an offline BPE trainer, and a writer of literal
generation rows (GENERATION_SCHEMA parquet) so render tests do not depend on the generate stage's code."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from schemas.generation import GENERATION_SCHEMA
from schemas.io import write_json_atomic, write_parquet_atomic
from schemas.messages import message_to_arrow

SPECIALS = ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>"]

# Gemma-like, no generation markers: the assistant turn is "model\n{content}<end_of_turn>\n".
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# ChatML with {% generation %} markers around what the model emits (reasoning in <think>, content, <|im_end|>).
CHATML_MARKERS_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n"
    "{%- if m['role'] == 'assistant' -%}{% generation %}"
    "{%- if m.get('reasoning_content') -%}<think>{{ m['reasoning_content'] }}</think>{%- endif -%}"
    "{{ m['content'] }}<|im_end|>{% endgeneration %}\n"
    "{%- else -%}{{ m['content'] }}<|im_end|>\n{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
# The same ChatML without markers (prefix path), to compare the two mask paths.
CHATML_TEMPLATE = CHATML_MARKERS_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# Drops the reasoning of every assistant turn but the last (like several public templates): not prefix-stable.
UNSTABLE_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n"
    "{%- if m['role'] == 'assistant' and loop.last and m.get('reasoning_content') -%}"
    "<think>{{ m['reasoning_content'] }}</think>{%- endif -%}"
    "{{ m['content'] }}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)

CORPUS = [
    "Hello world, this is a small test of the tokenizer. The quick brown fox jumps over the lazy dog.",
    "user model assistant system tool think response message content reasoning",
    "What is 2+3? The answer is 5. Let me think step by step about prime numbers.",
    "Bonjour, comment allez-vous? Très bien, merci. 漢字テスト def f(x): return x + 1",
]


def train_tokenizer_json(path: Path, corpus: list[str] | None = None, *, split_words: bool = True) -> None:
    """A tiny byte-level BPE `tokenizer.json`. `split_words=False` trains without the GPT-2 word split, so merges
    cross whitespace and punctuation (like SentencePiece: "\n\n", "l\n", ".\n") and a one-pass tokenization can
    merge a template's tail with an answer's head."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_words)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((corpus or CORPUS) * 20, trainer)
    tok.save(str(path))


def generation_row(prompt_id: str, turn: int, messages: list[dict], *, content="", reasoning_content=None,
                   tool_calls=None, finish_reason="stop", status="ok", category="chat", language="en",
                   tools=None, prompt_token_ids=None, completion_token_ids=None, **extra) -> dict:
    """A GENERATION_SCHEMA row from literals (messages as OpenAI dicts)."""
    row = {name: None for name in GENERATION_SCHEMA.names}
    row.update(
        request_key=f"{prompt_id}-{turn}", prompt_id=prompt_id, turn=turn, status=status, category=category,
        language=language, model="test", messages=[message_to_arrow(m) for m in messages],
        tools=json.dumps(tools) if tools is not None else None, reasoning_content=reasoning_content,
        content=content, finish_reason=finish_reason, prompt_token_ids=prompt_token_ids,
        completion_token_ids=completion_token_ids, flags=[], attempts=1,
        tool_calls=[message_to_arrow({"role": "assistant", "tool_calls": tool_calls})["tool_calls"]][0]
        if tool_calls else None,
    )
    row.update(extra)
    return row


def write_generations(run_root: Path, rows: list[dict], parts: int = 1, *, finished: bool = True) -> list[Path]:
    """Write `rows` as `generations/part-*.parquet` (split over `parts` files) under `run_root`; `finished`: also
    a generate manifest saying the stage finished (complete, balanced accounting), as `regen generate` writes it."""
    out = []
    for p in range(parts):
        chunk = rows[p::parts]
        path = Path(run_root) / "generations" / f"part-{p:05d}.parquet"
        write_parquet_atomic(pa.Table.from_pylist(chunk, schema=GENERATION_SCHEMA), path, GENERATION_SCHEMA)
        out.append(path)
    if finished:
        n = len(rows)
        write_json_atomic({"stage": "generate", "complete": True, "accounting": {
            "units": n, "rows": n, "missing": 0, "duplicates": 0, "stray": 0, "balanced": True}},
            Path(run_root) / "generations" / "manifest.json")
    return out


def k3_generated_text(row: dict) -> str:
    """What the target generated for a row, written from the spec (§2, §6) independently of the renderer."""
    reasoning = row["reasoning_content"] or ""
    text = (reasoning if reasoning.strip() else "") + "<|close|>think<|sep|><|open|>response<|sep|>"
    text += (row["content"] or "") + "<|close|>response<|sep|>"
    if row["tool_calls"]:
        text += "<|open|>tools<|sep|>"
        for i, call in enumerate(row["tool_calls"], 1):
            text += f'<|open|>call tool="{call["function"]["name"]}" index="{i}"<|sep|>'
            for k, v in json.loads(call["function"]["arguments"]).items():
                kind = {str: "string", int: "number", float: "number", bool: "boolean"}[type(v)]
                text += f'<|open|>argument key="{k}" type="{kind}"<|sep|>{v if kind == "string" else json.dumps(v)}'
                text += "<|close|>argument<|sep|>"
            text += "<|close|>call<|sep|>"
        text += "<|close|>tools<|sep|>"
    return text + "<|close|>message<|sep|>"
