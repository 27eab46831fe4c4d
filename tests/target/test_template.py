"""The project's chat templates for the embedded targets (regen.target.prepare_model.MODELS): prefix-stable,
generation markers around exactly the generated text, roles, tools; for each preparable model."""
from __future__ import annotations

import json

import pytest

from regen.config import resolve_path
from regen.target.prepare_model import DEFAULT_MODEL, GEMMA, MARKER, MODELS, SMOLLM2, SMOLLM2_DEFAULT_SYSTEM

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
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'

# per model: (start of a tools render, a tool turn, the generation prompt after CONV[:2], assistant header)
EXPECTED = {
    "gemma3-270m": ("<bos><start_of_turn>system\n# Tools\n", "<start_of_turn>tool\n5<end_of_turn>\n",
                    "<bos><start_of_turn>system\nBe brief.<end_of_turn>\n<start_of_turn>user\nAdd 2 and 3.<end_of_turn>\n"
                    "<start_of_turn>model\n"),
    "smollm2-135m": ("<|im_start|>system\n# Tools\n", "<|im_start|>tool\n5<|im_end|>\n",
                     "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nAdd 2 and 3.<|im_end|>\n"
                     "<|im_start|>assistant\n"),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def prepared(request):
    """(spec, tokenizer) of each prepared model directory (scripts/setup.sh prepares both)."""
    from transformers import AutoTokenizer

    spec = MODELS[request.param]
    path = resolve_path(f"data/models/{spec.name}")
    if not (path / "model.safetensors").exists():
        pytest.fail(f"{path} is missing: run `bash scripts/setup.sh` (python -m regen.target.prepare_model --model all)")
    return spec, AutoTokenizer.from_pretrained(path), path


def test_the_default_is_the_instruct_model():
    assert DEFAULT_MODEL == SMOLLM2.name and set(MODELS) == {GEMMA.name, SMOLLM2.name}


def test_saved_template_is_the_project_template(prepared):
    spec, tokenizer, path = prepared
    assert tokenizer.chat_template == spec.chat_template
    assert json.loads((path / MARKER).read_text())["template_sha256"] == spec.template_sha256()
    assert tokenizer.convert_ids_to_tokens(spec.end_of_turn_id) == spec.end_of_turn
    eos = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    assert spec.end_of_turn_id in (eos if isinstance(eos, list) else [eos])


def test_prefix_stable(prepared):
    spec, tokenizer, _ = prepared
    for tools in (TOOLS, None):
        prev = ""
        for k in range(1, len(CONV) + 1):
            text = tokenizer.apply_chat_template(CONV[:k], tools=tools, tokenize=False)
            assert text.startswith(prev), f"rendering of {k} messages does not extend the rendering of {k - 1}"
            prev = text
    prev = tokenizer.apply_chat_template(CONV, tools=TOOLS, tokenize=False)
    start, tool_turn, _ = EXPECTED[spec.name]
    assert prev.startswith(start) and tool_turn in prev
    assert CALL_TEXT + spec.end_of_turn in prev


def test_generation_prompt_and_roles(prepared):
    spec, tokenizer, _ = prepared
    text = tokenizer.apply_chat_template(CONV[:2], tokenize=False, add_generation_prompt=True)
    assert text == EXPECTED[spec.name][2]


def test_smollm2_default_system_turn_only_without_a_system_message(prepared):
    spec, tokenizer, _ = prepared
    if spec is not SMOLLM2:
        pytest.skip("SmolLM2's own default")
    user = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(user, tokenize=False) == (
        f"<|im_start|>system\n{SMOLLM2_DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
    assert SMOLLM2_DEFAULT_SYSTEM not in tokenizer.apply_chat_template(CONV[:2], tokenize=False)
    with_tools = tokenizer.apply_chat_template(user, tools=TOOLS, tokenize=False)
    assert with_tools.index("# Tools") < with_tools.index(SMOLLM2_DEFAULT_SYSTEM)


def test_generation_markers_cover_exactly_the_assistant_text(prepared):
    spec, tokenizer, _ = prepared
    for conv, expected in ((CONV, f"Calling.{CALL_TEXT}{spec.end_of_turn}It is 5.{spec.end_of_turn}"),
                           (CONV[1:3], f"Calling.{CALL_TEXT}{spec.end_of_turn}")):
        out = tokenizer.apply_chat_template(conv, tools=TOOLS, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = out["input_ids"], out["assistant_masks"]
        assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == expected
