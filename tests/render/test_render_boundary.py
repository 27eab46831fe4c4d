"""Issue #11 point 4: no token straddles the prompt/answer boundary. A sample's ids are the prompt ids exactly as the
target saw them (the generation prompt rendered alone) followed by the answer's ids (tokenized alone), turn by turn,
for both renderers; answers begin with whitespace, punctuation or characters that merge with the template's tail.

The HF side uses a tokenizer trained WITHOUT a word split (merges cross whitespace and punctuation, as Gemma's
SentencePiece-style BPE does), so a one-pass tokenization really merges "...model\\n" with "\\nHello"."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kimi_helpers import expected_ids
from render_fixtures import (
    CHATML_MARKERS_TEMPLATE,
    CORPUS,
    GEMMA_TEMPLATE,
    generation_row,
    train_tokenizer_json,
    write_generations,
)

from regen.config.render import RenderConfig
from regen.render.hf_template import HFTemplateRenderer
from regen.render.kimi_k3.renderer import KimiK3Renderer
from regen.render.stage import run_render
from regen.rundir import RunDir
from regen.target.prepare_model import CHAT_TEMPLATE

MERGING_CORPUS = CORPUS + [
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n\nHello\n\n\n.\n:\n!\n  x\n\t\n", "model\n\n",
    "assistant\n\n", "assistant\n.", "model\n:", "\n\n\n\n", "...!!  ..", "user\n\n", "\n\nHello", " \n \n",
]
# answer heads that merge with a template's tail ("model\n", "assistant\n", ">") or are whitespace/punctuation
HEADS = ["\n", "\n\n", " ", "  ", "\t", ".", ":", "!", "...", "\r\n", "l", "el", ">", "é", "🙂", "漢字", ""]
BODIES = ["Hello", " world", "\n", ".", "x", "model", "assistant", "  ", "12345", "'s", "{}", ""]
answer = st.tuples(st.sampled_from(HEADS), st.lists(st.sampled_from(BODIES), max_size=6)).map(
    lambda t: t[0] + "".join(t[1]))
SHOWN = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\nHello"}]


@pytest.fixture(scope="module")
def merging_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tokenizer dirs on the merge-happy BPE: gemma-like (prefix path), embedded (markers), chatml (markers)."""
    base = tmp_path_factory.mktemp("merging")
    tok_json = base / "tokenizer.json"
    train_tokenizer_json(tok_json, MERGING_CORPUS, split_words=False)
    out = {}
    for name, template in (("gemma", GEMMA_TEMPLATE), ("embedded", CHAT_TEMPLATE), ("chatml", CHATML_MARKERS_TEMPLATE)):
        d = base / name
        d.mkdir()
        shutil.copy(tok_json, d / "tokenizer.json")
        (d / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
            "pad_token": "<pad>", "chat_template": template,
            "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>"]}))
        out[name] = d
    return out


def hf_generated(name: str, m: dict) -> str:
    """What each template renders for an assistant message's generated part (written from the templates)."""
    if name == "chatml":
        return (f"<think>{m['reasoning_content']}</think>" if m.get("reasoning_content") else "") + m["content"] + "<|im_end|>"
    return m["content"] + "<end_of_turn>"


def one_pass_prompt(r: HFTemplateRenderer, messages: list[dict]) -> list[int]:
    """The generation prompt rendered alone and tokenized in one pass, as an OpenAI-compatible server does."""
    return r.encode(r.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_the_shown_input_had_a_straddling_token_and_now_has_none(merging_dirs):
    for name in ("gemma", "embedded"):
        r = HFTemplateRenderer(merging_dirs[name])
        full_text = r.tokenizer.apply_chat_template(SHOWN, tokenize=False)
        got = r.render(SHOWN)
        (s, e), = got.assistant_spans
        assert got.input_ids != r.encode(full_text), "the tokenizer must merge across the boundary for this test"
        assert got.input_ids[:s] == one_pass_prompt(r, SHOWN[:1])
        assert got.input_ids[s:e] == r.encode("\nHello<end_of_turn>")
        assert r.decode(got.input_ids[s:e]) == "\nHello<end_of_turn>" and r.decode(got.input_ids[e:]) == "\n"


@pytest.mark.parametrize("name", ["gemma", "embedded", "chatml"])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hf_every_supervised_span_follows_exactly_the_prompt_ids(merging_dirs, name, data):
    r = HFTemplateRenderer(merging_dirs[name])
    msgs: list[dict] = []
    for _ in range(data.draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": data.draw(answer) or "q"})
        a = {"role": "assistant", "content": data.draw(answer)}
        if name == "chatml" and data.draw(st.booleans()):
            a["reasoning_content"] = data.draw(answer) or "r"
        msgs.append(a)
    got = r.render(msgs)
    turns = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
    assert len(got.assistant_spans) == len(turns)
    for k, (s, e) in zip(turns, got.assistant_spans):
        # turn by turn: the ids before answer k are messages[:k] rendered alone with the generation prompt
        assert got.input_ids[:s] == r.render(msgs[:k], add_generation_prompt=True).input_ids
        assert got.input_ids[s:e] == r.encode(hf_generated(name, msgs[k]))
        # the training sample of turn k (last_only, as the render stage builds it): one-pass prompt + answer
        one = r.render(msgs[:k + 1], last_only=True)
        (s1, e1), = one.assistant_spans
        assert one.input_ids[:s1] == one_pass_prompt(r, msgs[:k])
        assert one.input_ids[s1:e1] == r.encode(hf_generated(name, msgs[k]))
    assert got.input_ids[:got.assistant_spans[0][0]] == one_pass_prompt(r, msgs[:1])


def k3_generated_ids(r: KimiK3Renderer, m: dict, thinking: bool) -> list[int]:
    """The generated part of an assistant message as §3 segments, each encoded alone (spec §2, §6)."""
    c = r.tokenizer.control_id
    OPEN, CLOSE, SEP = c("<|open|>"), c("<|close|>"), c("<|sep|>")
    parts = []
    if thinking:
        rc = m.get("reasoning_content") or ""
        parts += ([rc] if rc.strip() else []) + [CLOSE, "think", SEP, OPEN, "response", SEP]
    parts += [m["content"], CLOSE, "response", SEP, CLOSE, "message", SEP]
    return expected_ids(r, [p for p in parts if p != ""])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_kimi_every_supervised_span_follows_exactly_the_prompt_ids(data):
    """Kimi-K3 encodes every segment on its own (§3) and the generation prompt ends in the control token `<|sep|>`:
    no merge is possible at the boundary, and the spans say so for answers that would merge in one pass."""
    r = KimiK3Renderer()
    thinking = data.draw(st.booleans())
    kw = {"thinking": thinking, "thinking_effort": data.draw(st.sampled_from([None, "low", "max"]))}
    notes = {"tool_choice": data.draw(st.sampled_from([None, "required", "none"])),
             "response_format": data.draw(st.sampled_from([None, {"type": "json_object"}]))}
    k3_text = answer | st.sampled_from(["<|sep|>x", "|>", "<|close|>message<|sep|>", " <|end_of_msg|>"])
    msgs: list[dict] = []
    for _ in range(data.draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": data.draw(k3_text) or "q"})
        msgs.append({"role": "assistant", "content": data.draw(k3_text), "reasoning_content": data.draw(k3_text)})
    got = r.render(msgs, add_generation_prompt=False, **kw)
    turns = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
    for k, (s, e) in zip(turns, got.assistant_spans):
        assert got.input_ids[:s] == r.render(msgs[:k], add_generation_prompt=True, **kw).input_ids
        assert got.input_ids[s:e] == k3_generated_ids(r, msgs[k], thinking)
        # the training sample of turn k: the prompt the target read (notes included) + the answer
        one = r.render(msgs[:k + 1], last_only=True, add_generation_prompt=False, **kw, **notes)
        (s1, e1), = one.assistant_spans
        assert one.input_ids[:s1] == r.render(msgs[:k], add_generation_prompt=True, **kw, **notes).input_ids
        assert one.input_ids[s1:e1] == k3_generated_ids(r, msgs[k], thinking)
        assert one.input_ids[e1:] == [r.tokenizer.control_id("<|end_of_msg|>")]


def test_kimi_row_with_tool_choice_has_the_note_in_its_prompt_not_after_the_answer(tmp_path):
    """The reference renders the tool-choice note after the whole conversation; a sample must hold it where the
    target read it: before the answer."""
    r = KimiK3Renderer()
    u = {"role": "user", "content": "Weather in Oslo?"}
    row = generation_row("tc", 0, [u], content=" Calling the tool now, as required.", reasoning_content="\nNeed it.",
                         request_params=json.dumps({"tool_choice": "required"}))
    write_generations(tmp_path, [row])
    run = RunDir.at(tmp_path)
    cfg = RenderConfig(template_kwargs={"thinking": True, "thinking_effort": "low"}, min_loss_tokens=1)
    m = run_render(cfg, run, progress=False)
    (s,) = pq.read_table(run.shards / m["shards"][0]["path"]).to_pylist()
    (span,) = s["loss_spans"]
    want = r.render([u], add_generation_prompt=True, thinking=True, thinking_effort="low", tool_choice="required")
    assert s["input_ids"][:span["start"]] == want.input_ids and 'type="tool-choice"' in want.text
    assert s["input_ids"][span["end"]:] == [r.tokenizer.control_id("<|end_of_msg|>")]


def gemma_dir(repo_root: Path) -> Path:
    d = repo_root / "data" / "models" / "gemma3-270m"
    if not (d / "tokenizer.json").is_file():
        pytest.skip(f"{d} not prepared: run `bash scripts/setup.sh`")
    return d


@pytest.mark.integration
def test_local_profile_shown_input_through_the_stage_and_show_render(tmp_path, repo_root):
    """The issue's input on the local profile's real tokenizer (Gemma 3): the first supervised token is the "\\n"
    the target produced after "<start_of_turn>model\\n", not a merged "\\n\\n" (id 108)."""
    import subprocess
    import sys

    from regen.config import load_profile

    d = gemma_dir(repo_root)
    r = HFTemplateRenderer(d)
    prompt = r.tokenizer.apply_chat_template(SHOWN[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
    cfg = load_profile("local").render.model_copy(update={"min_loss_tokens": 1, "filters": []})
    cfg = cfg.model_copy(update={"tokenizer": str(d)})
    for i, head in enumerate(["\nHello", "\n\nHello", " Hello", ".\nHello", "Hello"]):
        write_generations(tmp_path / str(i), [generation_row("g", 0, SHOWN[:1], content=head)])
        run = RunDir.at(tmp_path / str(i))
        m = run_render(cfg, run, progress=False)
        (s,) = pq.read_table(run.shards / m["shards"][0]["path"]).to_pylist()
        (span,) = s["loss_spans"]
        assert s["input_ids"][:span["start"]] == list(prompt)
        assert s["input_ids"][span["start"]:span["end"]] == r.encode(head + "<end_of_turn>")
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    out = subprocess.run([sys.executable, "-m", "regen.cli", "show-render", "--profile", "local", "--tokenizer", str(d)],
                         input=json.dumps({"messages": SHOWN}), capture_output=True, text=True, env=env, cwd=repo_root)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    first = got["loss_mask"].index(1)
    assert got["ids"][:first] == list(prompt) and got["ids"][first] == 107 and 108 not in got["ids"]
