"""Ids pinned by `shared/docs/kimi-k3-format.md` §3-§4 for the REAL Kimi-K3 vocabulary. Runs only where a Kimi-K3
checkpoint tokenizer directory is given in `KIMI_K3_TOKENIZER` (it cannot be downloaded here); the same checks on
control ids and structure run on the test vocabulary in the other tokenizer and golden tests."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from regen.render.kimi_k3.renderer import KimiK3Renderer
from regen.render.kimi_k3.tokenizer import KimiTokenizer

REAL = os.environ.get("KIMI_K3_TOKENIZER")
pytestmark = pytest.mark.skipif(not (REAL and (Path(REAL) / "tiktoken.model").is_file()),
                                reason="KIMI_K3_TOKENIZER (a Kimi-K3 checkpoint tokenizer directory) not set")

FREQUENT = {"message": 2778, " role": 6244, '="': 878, '"': 1, "user": 2482, "assistant": 69702, "system": 14062,
            " type": 1798, " name": 1530, "think": 39964, "response": 12092, "tools": 25385, "call": 10257,
            " tool": 4453, " index": 4002, "argument": 47185, " key": 2355, "json": 5534, "tool": 20960}


@pytest.fixture(scope="module")
def real() -> KimiK3Renderer:
    return KimiK3Renderer(KimiTokenizer(REAL))


def test_vocabulary_shape(real):
    assert real.tokenizer.num_ranks == 163_584 and real.tokenizer.encoding.n_vocab == 163_840
    assert not real.tokenizer.is_test_vocab


@pytest.mark.parametrize("text,id_", sorted(FREQUENT.items()))
def test_frequent_text_ids(real, text, id_):
    assert real.tokenizer.encode_text(text) == [id_]


def test_generation_prompt_ids(real):
    think = real.render([{"role": "user", "content": "x"}], thinking=True, add_generation_prompt=True).input_ids
    assert think[-10:] == [163587, 2778, 6244, 878, 69702, 1, 163589, 163587, 39964, 163589]
    plain = real.render([{"role": "user", "content": "x"}], thinking=False, add_generation_prompt=True).input_ids
    assert plain[-10:] == [163587, 2778, 6244, 878, 69702, 1, 163589, 163587, 12092, 163589]


def test_literal_control_string_in_user_text(real):
    """FX `user_text_cannot_inject_control_tokens`: `<|open|>` in text is `<|` `open` `|>` = 27 91 4454 91 29."""
    assert real.tokenizer.encode_text("<|open|>") == [27, 91, 4454, 91, 29]
