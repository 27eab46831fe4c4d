"""Supervised spans of the Kimi-K3 renderer (`shared/docs/kimi-k3-format.md` §6): the mask policies on a literal
row, and a property test over random conversations: the tokens under each assistant span decode to exactly the
text the target generated for that turn (plus the policy's markers) and nothing else."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kimi_helpers import kimi  # noqa: F401  (fixture)

from regen.render.kimi_k3.renderer import MASK_POLICIES, KimiK3Renderer
from regen.render.kimi_k3.tokenizer import CLOSE, END_OF_MSG, OPEN, SEP

ROW = [{"role": "user", "content": "2+3?"},
       {"role": "assistant", "reasoning_content": "Add.", "content": "5"}]
GEN = "<|close|>think<|sep|><|open|>response<|sep|>5<|close|>response<|sep|><|close|>message<|sep|>"


@pytest.mark.parametrize("policy,thinking,want", [
    ("spec", True, "Add." + GEN),
    ("generated", True, "Add." + GEN),
    ("include_channel_opener", True, "<|open|>think<|sep|>Add." + GEN),
    ("include_end_of_msg", True, "Add." + GEN + "<|end_of_msg|>"),
    ("include_channel_opener_and_end_of_msg", True, "<|open|>think<|sep|>Add." + GEN + "<|end_of_msg|>"),
    ("spec", False, "5<|close|>response<|sep|><|close|>message<|sep|>"),
    ("include_channel_opener", False, "<|open|>response<|sep|>5<|close|>response<|sep|><|close|>message<|sep|>"),
])
def test_mask_policies(kimi, policy, thinking, want):
    r = KimiK3Renderer(kimi.tokenizer, mask_policy=policy)
    got = r.render(ROW, thinking=thinking, thinking_effort="low", add_generation_prompt=False)
    (s, e), = got.assistant_spans
    assert r.decode(got.input_ids[s:e]) == want
    mask = got.loss_mask()
    assert sum(mask) == e - s and mask[s:e] == [1] * (e - s)


def test_prompt_plus_generated_ids_equal_the_training_row(kimi):
    """What the server saw (generation prompt) + what it generated (the span) = the rendered row's ids."""
    for thinking in (True, False):
        prompt = kimi.render(ROW[:1], thinking=thinking, add_generation_prompt=True)
        row = kimi.render(ROW, thinking=thinking, add_generation_prompt=False)
        (s, e), = row.assistant_spans
        assert row.input_ids[:s] == prompt.input_ids
        assert row.input_ids[e:] == [163586]


# ---- property test ---------------------------------------------------------------------------------------------
TRICKY = ["<|sep|>", "<|open|>", "<|close|>", "<|end_of_msg|>", "<|kimi_image_placeholder|>", " ", "\n", "\r\n",
          "  ", "漢字", "テスト", "é", "🙂", "HelloWorld", "12345", '"', "&", "'s", "x", "message", "think"]
texts = st.lists(st.one_of(st.sampled_from(TRICKY), st.text(max_size=12)), max_size=6).map("".join)
reasonings = st.one_of(st.none(), st.just(""), st.just("   "), texts)
names = st.one_of(st.sampled_from(["f", 'q"&x', "get_weather"]), st.text(min_size=1, max_size=6))


@st.composite
def conversations(draw):
    msgs: list[dict] = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(texts)})
    for turn in range(draw(st.integers(1, 3))):
        user = draw(texts)
        parts = draw(st.booleans())
        msgs.append({"role": "user", "content": [{"type": "text", "text": user}, {"type": "text", "text": user}]
                     if parts else user})
        ncalls = draw(st.integers(0, 2))
        if ncalls:
            calls = [{"id": f"c{turn}{k}", "type": "function", "function": {
                "name": draw(names), "arguments": draw(st.dictionaries(names, texts, max_size=2))}} for k in range(ncalls)]
            msgs.append({"role": "assistant", "content": draw(texts), "reasoning_content": draw(reasonings),
                         "tool_calls": calls})
            order = draw(st.permutations(range(ncalls)))
            msgs += [{"role": "tool", "tool_call_id": f"c{turn}{k}", "content": draw(texts)} for k in order]
        msgs.append({"role": "assistant", "content": draw(texts), "reasoning_content": draw(reasonings)})
    return msgs


def esc(v: str) -> str:
    return v.replace("&", "&amp;").replace('"', "&quot;")


def expected_generated(m: dict, thinking: bool, policy: str) -> str:
    """The text the target generated for assistant message `m`, written independently from the spec (§2, §6)."""
    s = ""
    if "channel_opener" in policy:
        s += f"{OPEN}think{SEP}" if thinking else f"{OPEN}response{SEP}"
    if thinking:
        r = m.get("reasoning_content")
        s += (r if r and r.strip() else "") + f"{CLOSE}think{SEP}{OPEN}response{SEP}"
    s += (m.get("content") or "") + f"{CLOSE}response{SEP}"
    if m.get("tool_calls"):
        s += f"{OPEN}tools{SEP}"
        for i, c in enumerate(m["tool_calls"], 1):
            s += f'{OPEN}call tool="{esc(c["function"]["name"])}" index="{i}"{SEP}'
            for k, v in c["function"]["arguments"].items():
                s += f'{OPEN}argument key="{esc(k)}" type="string"{SEP}{v}{CLOSE}argument{SEP}'
            s += f"{CLOSE}call{SEP}"
        s += f"{CLOSE}tools{SEP}"
    s += f"{CLOSE}message{SEP}"
    return s + (END_OF_MSG if "end_of_msg" in policy else "")


RENDERERS: dict[str, KimiK3Renderer] = {}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=conversations(), thinking=st.booleans(), policy=st.sampled_from(sorted(MASK_POLICIES)),
       gen_prompt=st.booleans())
def test_span_tokens_decode_to_exactly_the_generated_text(msgs, thinking, policy, gen_prompt):
    r = RENDERERS.setdefault(policy, KimiK3Renderer(mask_policy=policy))
    got = r.render(msgs, thinking=thinking, thinking_effort="high", add_generation_prompt=gen_prompt)
    assistants = [m for m in msgs if m["role"] == "assistant"]
    assert len(got.assistant_spans) == len(assistants)
    prev_end = 0
    for (s, e), m in zip(got.assistant_spans, assistants):
        assert prev_end <= s < e <= len(got.input_ids)  # one contiguous span per turn, in order, disjoint
        assert r.tokenizer.decode_bytes(got.input_ids[s:e]).decode("utf-8") == expected_generated(m, thinking, policy)
        prev_end = e
    # nothing else is supervised, and each span is bounded by structure, not text
    mask = got.loss_mask()
    assert sum(mask) == sum(e - s for s, e in got.assistant_spans)
    for s, e in got.assistant_spans:
        before = 163589  # the <|sep|> closing the channel opener (or the message opener's, with the channel opener)
        assert got.input_ids[s - 1] == before
        assert got.input_ids[e - 1] == (163586 if "end_of_msg" in policy else 163589)
    # every token decodes back to the text, control ids only where the structure puts them
    assert r.tokenizer.decode_bytes(got.input_ids).decode("utf-8") == got.text
    segs = r.segments(msgs, thinking=thinking, thinking_effort="high", add_generation_prompt=gen_prompt)
    for tok_id, literal in ((163589, SEP), (163587, OPEN), (163588, CLOSE), (163586, END_OF_MSG)):
        assert got.input_ids.count(tok_id) == sum(1 for s in segs for t, sp in s.units() if sp and t == literal)
    # BPE never merges across (ENC) segments: the ids are the concatenation of each segment's own ids
    pos = 0
    for text, special in (unit for seg in segs for unit in seg.units()):
        ids = r.tokenizer.encoding.encode(text, allowed_special="all") if special else r.tokenizer.encode_text(text)
        assert tuple(got.input_ids[pos:pos + len(ids)]) == tuple(ids)
        pos += len(ids)
    assert pos == len(got.input_ids)
