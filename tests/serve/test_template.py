"""The project's chat template for the embedded target: prefix-stable, generation markers, roles, tools."""
from __future__ import annotations

import pytest

from regen.serve.prepare_model import CHAT_TEMPLATE, END_OF_TURN_ID, MARKER, template_sha256

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Add 2 and 3."},
    {"role": "assistant", "content": "Calling.",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
    {"role": "assistant", "content": [{"type": "text", "text": "It is 5."}]},
    {"role": "user", "content": "Thanks"},
]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_saved_template_is_the_project_template(tokenizer, model_dir):
    import json

    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert json.loads((model_dir / MARKER).read_text())["template_sha256"] == template_sha256()
    assert tokenizer.convert_ids_to_tokens(END_OF_TURN_ID) == "<end_of_turn>"


def test_prefix_stable(tokenizer):
    prev = ""
    for k in range(1, len(CONV) + 1):
        text = tokenizer.apply_chat_template(CONV[:k], tools=TOOLS, tokenize=False)
        assert text.startswith(prev), f"rendering of {k} messages does not extend the rendering of {k - 1}"
        prev = text
    assert prev.startswith("<bos><start_of_turn>system\n# Tools\n")
    assert "<start_of_turn>tool\n5<end_of_turn>\n" in prev
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><end_of_turn>' in prev


def test_generation_prompt_and_roles(tokenizer):
    text = tokenizer.apply_chat_template(CONV[:2], tokenize=False, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>system\nBe brief.<end_of_turn>\n<start_of_turn>user\nAdd 2 and 3.<end_of_turn>\n"
                    "<start_of_turn>model\n")


def test_generation_markers_cover_exactly_the_assistant_text(tokenizer):
    out = tokenizer.apply_chat_template(CONV, tools=TOOLS, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    supervised = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert supervised == ('Calling.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><end_of_turn>'
                          "It is 5.<end_of_turn>")
