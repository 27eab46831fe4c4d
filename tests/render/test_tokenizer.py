"""The Kimi-K3 tiktoken tokenizer (`shared/docs/kimi-k3-format.md` §3-§4): regex pins, control block, segment
encoding (special vs text), 25,000-char runs and 400,000-char chunks, loading checkpoint-layout directories."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from regen.errors import InputError
from regen.render.kimi_k3.test_vocab import build_test_vocab
from regen.render.kimi_k3.tokenizer import (
    NAMED_CONTROL_TOKENS,
    TEST_VOCAB_DIR,
    KimiTokenizer,
    load_tokenizer,
    pretokenize,
    split_runs,
)

PINS = [  # FX pretokenize_pins.json cases quoted in §4
    ("HelloWorld", ["Hello", "World"]),
    ("漢字テスト", ["漢字", "テスト"]),
    ("12345", ["123", "45"]),
    ("\r\n", ["\r\n"]),
    ("a" + " " * 40 + "b", ["a", " " * 39, " b"]),
]
SAMPLES = ["Hello, World! It's 2026; we'll see.", "漢字テストとカタカナ、中文。", "x = f(1e2) + 12345\r\n\tif y:",
           "ÉCOLE élève DON'T", "   leading and trailing   ", "emoji 🙂🙂 ok", "<|sep|> is text", "a\n\n\nb  \n c"]


@pytest.fixture(scope="module")
def tok() -> KimiTokenizer:
    return load_tokenizer(None)


@pytest.mark.parametrize("text,pieces", PINS)
def test_pretokenize_pins(text, pieces):
    assert pretokenize(text) == pieces


@pytest.mark.parametrize("text", [t for t, _ in PINS] + SAMPLES)
def test_tiktoken_splits_like_the_regex(tok, text):
    """tiktoken's Rust regex and `regex` V1 agree on the pieces: encoding piece by piece gives the same ids."""
    by_piece = [i for piece in pretokenize(text) for i in tok.encode_text(piece)]
    assert tok.encode_text(text) == by_piece
    assert tok.decode(by_piece) == text


def test_control_block_has_the_real_ids(tok):
    assert tok.encoding.n_vocab == 163_840
    for i, name in NAMED_CONTROL_TOKENS.items():
        assert tok.control_id(name) == i
    assert tok.control_id("<|reserved_token_163592|>") == 163592
    assert tok.control_id("<|reserved_token_163824|>") == 163824  # SF's DSpark mask id
    assert len(tok.special_ids) == 256 and min(tok.special_ids.values()) == 163584
    assert tok.is_test_vocab and tok.num_ranks <= 65_536


def test_special_segments_use_control_ids_text_segments_never(tok):
    assert tok.encode_special("<|open|>") == (163587,)
    assert tok.encode_special("<|close|>message<|sep|>") == (163588, *tok.encode_text("message"), 163589)
    for literal in ("<|open|>", "<|sep|>", "<|end_of_msg|>", "[BOS]", "<|reserved_token_163700|>"):
        ids = tok.encode_text(f"x {literal} y")
        assert all(i < 163584 for i in ids) and tok.decode(ids) == f"x {literal} y"


def _tok_reference_split(s: str, n: int) -> list[str]:
    """TOK `_split_whitespaces_or_nonwhitespaces`, transcribed (the spec's §3 source) as the oracle."""
    out, cur_len, cur_space, start = [], 0, s[0].isspace() if s else False, 0
    for i in range(len(s)):
        now = s[i].isspace()
        if cur_space ^ now:
            cur_len, cur_space = 1, now
        else:
            cur_len += 1
            if cur_len > n:
                out.append(s[start:i])
                start, cur_len = i, 1
    out.append(s[start:])
    return out


@settings(max_examples=200, deadline=None)
@given(s=st.text(alphabet="ab \n", max_size=40), n=st.integers(1, 6))
def test_split_runs_matches_tok(s, n):
    got = split_runs(s, n) if len(s) > n else [s]
    assert got == _tok_reference_split(s, n)
    assert "".join(got) == s


def test_long_runs_are_cut_at_25000_chars(tok):
    run = "abc" * 20_000  # 60,000 non-space chars; cuts at 25,000 and 50,000 fall inside "abc"
    text = run + " " + "b" * 10
    want = (tok.encode_text(run[:25_000]) + tok.encode_text(run[25_000:50_000]) + tok.encode_text(run[50_000:])
            + tok.encode_text(" " + "b" * 10))
    assert tok.encode_text(text) == want
    assert tok.encoding.encode_ordinary(text) != want  # one run: BPE would merge across the 25,000 cut


def test_texts_over_400000_chars_are_chunked(tok):
    word = "lorem ipsum "  # 12 chars: 400,000 falls inside a word, so the chunk cut is visible
    text = word * 34_000  # 408,000 chars
    want = tok.encode_text(text[:400_000]) + tok.encode_text(text[400_000:])
    assert tok.encode_text(text) == want
    assert tok.decode(want) == text


def test_build_and_load_a_vocab_directory(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text("the quick brown fox jumps over the lazy dog. 天気 " * 50, encoding="utf-8")
    info = build_test_vocab([src], tmp_path / "v", vocab_size=300)
    assert info["num_ranks"] <= 300 and info["vocab_size"] == 163_840
    t = KimiTokenizer(tmp_path / "v")
    assert t.control_id("<|sep|>") == 163589 and t.is_test_vocab
    assert len(t.encode_text("the quick")) < len("the quick".encode())  # merges were learned
    assert t.decode(t.encode_text("unseen ✓ text")) == "unseen ✓ text"  # all 256 bytes have a rank
    before = t.hash
    cfg = tmp_path / "v" / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace('"model_max_length": 1048576', '"model_max_length": 1'))
    assert KimiTokenizer(tmp_path / "v").hash != before


def test_checkpoint_layout_control_ids_follow_the_ranks(tmp_path):
    """Real layout: control block at len(ranks) with added_tokens_decoder naming some of its ids."""
    import base64

    ranks = [bytes([b]) for b in range(256)] + [b"ab"]
    (tmp_path / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    named = {"257": {"content": "[BOS]"}, "259": {"content": "<|end_of_msg|>"}, "260": {"content": "<|open|>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": named}))
    t = KimiTokenizer(tmp_path)
    assert t.control_id("<|open|>") == 260 and t.control_id("<|reserved_token_258|>") == 258
    assert t.encode_text("ab") == [256] and not t.is_test_vocab


def test_bad_directories_raise_input_errors(tmp_path):
    with pytest.raises(InputError, match="missing tiktoken.model"):
        KimiTokenizer(tmp_path)
    (tmp_path / "tiktoken.model").write_text("not-a-rank-line\n")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(InputError, match="line 1"):
        KimiTokenizer(tmp_path)
    (tmp_path / "tiktoken.model").write_text("YQ== 0\nYg== 1\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"1": {"content": "<|open|>"}}}))
    with pytest.raises(InputError, match="collides"):
        KimiTokenizer(tmp_path)


def test_bundled_test_vocabulary_is_small_and_labelled():
    files = {p.name: p.stat().st_size for p in TEST_VOCAB_DIR.iterdir()}
    assert set(files) >= {"tiktoken.model", "tokenizer_config.json", "README.md"}
    assert sum(files.values()) < 1_000_000
    assert "not Kimi's" in (TEST_VOCAB_DIR / "README.md").read_text()
    config = json.loads((TEST_VOCAB_DIR / "tokenizer_config.json").read_text())
    assert config["regen_test_vocabulary"] is True and config["vocab_size"] == 163_840
