"""HFTemplateRenderer: the prefix-stability mask without markers, agreement with {% generation %} markers, and a
loud failure on templates that rewrite history."""
from __future__ import annotations

import json

import pytest
from render_fixtures import CHATML_MARKERS_TEMPLATE, CHATML_TEMPLATE, UNSTABLE_TEMPLATE

from regen.errors import InputError
from regen.render.hf_template import HFTemplateRenderer, TemplateNotPrefixStable

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "The answer is 5.", "reasoning_content": "2 plus 3 is 5."},
    {"role": "user", "content": "And 漢字 <end_of_turn> here?"},
    {"role": "assistant", "content": " Bonjour\n\n", "reasoning_content": "think step by step"},
]


def masked_texts(r, rendered):
    return [r.decode(rendered.input_ids[s:e]) for s, e in rendered.assistant_spans]


def test_prefix_mask_covers_exactly_the_answers(gemma_dir):
    r = HFTemplateRenderer(gemma_dir)
    assert r.mask == "prefix" and not r.has_markers
    out = r.render(CONV)
    assert masked_texts(r, out) == ["The answer is 5.<end_of_turn>", " Bonjour\n\n<end_of_turn>"]
    assert r.decode(out.input_ids) == out.text
    # the "\n" after <end_of_turn> is template decoration, not generated: the token after each span is "\n"
    for _, e in out.assistant_spans[:-1]:
        assert r.decode(out.input_ids[e:e + 1]) == "\n"
    # the prompt before the last span is exactly the generation-prompt rendering of the history
    s, _ = out.assistant_spans[-1]
    prompt = r.tokenizer.apply_chat_template(CONV[:-1], tokenize=False, add_generation_prompt=True)
    assert r.decode(out.input_ids[:s]) == prompt


def test_markers_and_prefix_paths_agree(make_hf_dir):
    with_markers = HFTemplateRenderer(make_hf_dir(CHATML_MARKERS_TEMPLATE, "chatml-markers"))
    assert with_markers.mask == "markers"
    forced_prefix = HFTemplateRenderer(make_hf_dir(CHATML_MARKERS_TEMPLATE, "chatml-markers2"), mask="prefix")
    no_markers = HFTemplateRenderer(make_hf_dir(CHATML_TEMPLATE, "chatml"))
    assert no_markers.mask == "prefix"
    a = with_markers.render(CONV)
    b = forced_prefix.render(CONV)
    c = no_markers.render(CONV)
    assert a.input_ids == b.input_ids == c.input_ids
    assert a.assistant_spans == b.assistant_spans == c.assistant_spans
    assert masked_texts(with_markers, a) == [
        "<think>2 plus 3 is 5.</think>The answer is 5.<|im_end|>",
        "<think>think step by step</think> Bonjour\n\n<|im_end|>",
    ]


def test_markers_mode_requires_markers(make_hf_dir):
    with pytest.raises(InputError, match="generation"):
        HFTemplateRenderer(make_hf_dir(CHATML_TEMPLATE, "chatml-nomark"), mask="markers")


def test_template_that_rewrites_history_fails_loudly(make_hf_dir):
    r = HFTemplateRenderer(make_hf_dir(UNSTABLE_TEMPLATE, "unstable"))
    # one assistant turn: nothing is rewritten, it renders
    one = r.render(CONV[:3])
    assert masked_texts(r, one) == ["<think>2 plus 3 is 5.</think>The answer is 5.<|im_end|>"]
    with pytest.raises(TemplateNotPrefixStable, match="message 2"):
        r.render(CONV)


def test_generation_prompt_and_tools(gemma_dir):
    r = HFTemplateRenderer(gemma_dir)
    out = r.render(CONV[:2], tools=[{"type": "function", "function": {"name": "f"}}], add_generation_prompt=True)
    assert out.assistant_spans == []
    assert out.text.endswith("<start_of_turn>model\n")


def test_directory_without_template_is_an_input_error(tmp_path, tokenizer_json):
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(InputError, match="no chat template"):
        HFTemplateRenderer(d)
    with pytest.raises(InputError, match="does not exist"):
        HFTemplateRenderer(tmp_path / "missing")


def test_last_only_renders_history_as_the_template_does(make_hf_dir):
    r = HFTemplateRenderer(make_hf_dir(UNSTABLE_TEMPLATE, "unstable-last"))
    out = r.render(CONV, last_only=True)
    assert len(out.assistant_spans) == 1
    assert masked_texts(r, out) == ["<think>think step by step</think> Bonjour\n\n<|im_end|>"]
    assert "2 plus 3 is 5." not in out.text  # the template dropped the earlier reasoning; so does the row
    s, _ = out.assistant_spans[0]
    assert r.decode(out.input_ids[:s]) == r.tokenizer.apply_chat_template(CONV[:-1], tokenize=False,
                                                                          add_generation_prompt=True)
