"""Fixtures for the render stage: an offline byte-level BPE tokenizer directory with a chosen chat template."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from render_fixtures import GEMMA_TEMPLATE, train_tokenizer_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    train_tokenizer_json(path)
    return path


@pytest.fixture(scope="session")
def make_hf_dir(tokenizer_json, tmp_path_factory):
    """make_hf_dir(chat_template, name) -> a tokenizer directory loadable by AutoTokenizer (offline)."""

    def make(chat_template: str, name: str = "tiny-hf") -> Path:
        d = tmp_path_factory.mktemp(name) / name
        d.mkdir()
        shutil.copy(tokenizer_json, d / "tokenizer.json")
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
            "pad_token": "<pad>", "chat_template": chat_template,
            "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>"],
        }
        (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
        return d

    return make


@pytest.fixture(scope="session")
def gemma_dir(make_hf_dir) -> Path:
    return make_hf_dir(GEMMA_TEMPLATE, "gemma-like")
