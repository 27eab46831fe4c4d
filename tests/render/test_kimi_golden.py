"""Golden renderings of the Kimi-K3 format, written from `shared/docs/kimi-k3-format.md` (§7 E1-E4 copied
verbatim; the rest from the §1-§2 rules), with control-token ids checked at their positions."""
from __future__ import annotations

import pytest
from kimi_helpers import expected_ids, kimi  # noqa: F401  (fixture)

from regen.render.kimi_k3.renderer import KimiK3Renderer

EFFORT = ("<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>`thinking_effort` guides on how much to "
          "think in your thinking channel (not including the response channel), supported values include `low`, "
          "`medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort={e}`."
          "<|close|>message<|sep|><|end_of_msg|>")

E1 = """<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), supported values include `low`, `medium`, `high`, and `max`.
Now the system is invoked with `thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|><|open|>message role="user"<|sep|>Name a prime.<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>think<|sep|>"""

E2 = """<|open|>message role="system"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|><|open|>message role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>response<|sep|>Hello.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|><|open|>message role="user"<|sep|>Bye<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>response<|sep|>"""

E3 = """<|open|>message role="system" type="tool-declare"<|sep|># Tools
Here are the available tools, described in JSONSchema.

```json
[{"function":{"name":"add","parameters":{"properties":{"a":{"type":"number"},"b":{"type":"number"}},"required":["a","b"],"type":"object"}},"type":"function"}]
```<|close|>message<|sep|><|end_of_msg|>[EFFORT low]<|open|>message role="user"<|sep|>2+3?<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>think<|sep|>⟦Use the tool.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="add" index="1"<|sep|><|open|>argument key="a" type="number"<|sep|>2<|close|>argument<|sep|><|open|>argument key="b" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>⟧<|end_of_msg|><|open|>message role="tool" tool="add" index="1"<|sep|>5<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>think<|sep|>⟦Tool said 5.<|close|>think<|sep|><|open|>response<|sep|>5<|close|>response<|sep|><|close|>message<|sep|>⟧<|end_of_msg|>"""

E4 = """<|open|>message role="user" name="A&amp;B &quot;x&quot;"<|sep|><|sep|> is text here<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>think<|sep|>"""

E3_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "b": {"type": "number"}, "a": {"type": "number"}}, "required": ["a", "b"]}}}]
E3_MESSAGES = [
    {"role": "user", "content": "2+3?"},
    {"role": "assistant", "reasoning_content": "Use the tool.", "content": "",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
    {"role": "assistant", "reasoning_content": "Tool said 5.", "content": "5"},
]

def ends_with(ids: list[int], tail: list[int]) -> bool:
    return ids[-len(tail):] == tail


GEN_THINK = [163587, "message", ' role="assistant"', 163589, 163587, "think", 163589]


def test_e1_user_turn_defaults(kimi):
    got = kimi.render([{"role": "user", "content": "Name a prime."}], thinking=True, thinking_effort="max",
                      add_generation_prompt=True)
    assert got.text == E1
    assert ends_with(got.input_ids, expected_ids(kimi, GEN_THINK))
    assert kimi.render([{"role": "user", "content": "Name a prime."}]).text == E1  # TOK defaults
    assert got.assistant_spans == []


def test_e2_non_thinking_drops_reasoning_and_effort(kimi):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello.", "reasoning_content": "dropped"}, {"role": "user", "content": "Bye"}]
    got = kimi.render(msgs, thinking=False, thinking_effort="max", add_generation_prompt=True)
    assert got.text == E2
    gen = [163587, "message", ' role="assistant"', 163589, 163587, "response", 163589]
    assert ends_with(got.input_ids, expected_ids(kimi, gen))
    (s, e), = got.assistant_spans
    assert kimi.decode(got.input_ids[s:e]) == "Hello.<|close|>response<|sep|><|close|>message<|sep|>"


def test_e3_training_row_text_and_spans(kimi):
    got = kimi.render(E3_MESSAGES, E3_TOOLS, thinking=True, thinking_effort="low", add_generation_prompt=False)
    marked = E3.replace("[EFFORT low]", EFFORT.format(e="low"))
    assert got.text == marked.replace("⟦", "").replace("⟧", "")
    want = [seg.split("⟧")[0] for seg in marked.split("⟦")[1:]]
    assert [kimi.decode(got.input_ids[s:e]) for s, e in got.assistant_spans] == want
    assert "c1" not in got.text
    # the span starts right after <|open|>think<|sep|> and ends right before <|end_of_msg|>
    for s, e in got.assistant_spans:
        opener = expected_ids(kimi, [163587, "think", 163589])
        assert got.input_ids[s - len(opener):s] == opener
        assert got.input_ids[e] == 163586 and got.input_ids[e - 1] == 163589
    assert got.input_ids[-1] == 163586


def test_e4_escaping_and_injection(kimi):
    got = kimi.render([{"role": "user", "name": 'A&B "x"', "content": "<|sep|> is text here"}], thinking=True,
                      thinking_effort=None, add_generation_prompt=True)
    assert got.text == E4
    want = expected_ids(kimi, [163587, "message", ' role="user"', ' name="A&amp;B &quot;x&quot;"', 163589,
                               "<|sep|> is text here", 163588, "message", 163589, 163586, *GEN_THINK])
    assert got.input_ids == want
    assert got.input_ids.count(163589) == 4  # the literal <|sep|> is plain BPE, not 163589
    literal = kimi.encode("<|sep|> is text here")
    assert 163589 not in literal and kimi.decode(literal) == "<|sep|> is text here"


@pytest.mark.parametrize("effort", ["low", "high", "max"])
def test_effort_note(kimi, effort):
    got = kimi.render([{"role": "user", "content": "x"}], thinking=True, thinking_effort=effort)
    assert got.text.startswith(EFFORT.format(e=effort))


def test_effort_none_and_thinking_off_have_no_note(kimi):
    for kw in ({"thinking": True, "thinking_effort": None}, {"thinking": False, "thinking_effort": "max"},
               {"thinking": False, "thinking_effort": "medium"}):
        assert "thinking-effort" not in kimi.render([{"role": "user", "content": "x"}], **kw).text


def test_medium_effort_raises_like_enc_or_maps_like_fw(kimi):
    from regen.render.kimi_k3.renderer import RenderError

    with pytest.raises(RenderError, match="medium") as err:
        kimi.render([{"role": "user", "content": "x"}], thinking=True, thinking_effort="medium")
    assert err.value.reason == "bad_option"
    fw = KimiK3Renderer(kimi.tokenizer, effort_aliases={"medium": "high", "xhigh": "max"})
    assert "`thinking_effort=high`" in fw.render([{"role": "user", "content": "x"}], thinking_effort="medium").text


def test_no_generation_prompt_ends_after_end_of_msg(kimi):
    got = kimi.render([{"role": "user", "content": "x"}], thinking_effort=None, add_generation_prompt=False)
    assert got.text == '<|open|>message role="user"<|sep|>x<|close|>message<|sep|><|end_of_msg|>'
    assert got.input_ids[-1] == 163586


def test_generation_prompt_appended_after_assistant_last(kimi):
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    got = kimi.render(msgs, thinking=True, thinking_effort=None, add_generation_prompt=True)
    assert got.text.endswith('<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|>'
                             "<|open|>think<|sep|>")
    (s, e), = got.assistant_spans
    assert kimi.decode(got.input_ids[s:e]) == ("<|close|>think<|sep|><|open|>response<|sep|>y<|close|>response"
                                               "<|sep|><|close|>message<|sep|>")
    assert ends_with(got.input_ids, expected_ids(kimi, GEN_THINK))


def test_system_and_user_names_and_verbatim_bodies(kimi):
    msgs = [{"role": "system", "content": "  You are terse.  "}, {"role": "user", "name": "", "content": "a"},
            {"role": "user", "name": "bob", "content": 'he said "hi" & left'}]
    got = kimi.render(msgs, thinking_effort=None, add_generation_prompt=False)
    assert got.text == ('<|open|>message role="system"<|sep|>  You are terse.  <|close|>message<|sep|><|end_of_msg|>'
                        '<|open|>message role="user"<|sep|>a<|close|>message<|sep|><|end_of_msg|>'
                        '<|open|>message role="user" name="bob"<|sep|>he said "hi" & left<|close|>message<|sep|>'
                        "<|end_of_msg|>")


def test_escaping_only_amp_and_quote_in_attributes(kimi):
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "function": {
                "name": 'say<"&>', "arguments": {'k"&<': "v & \"w\" <x>"}}}]},
            {"role": "tool", "tool_call_id": "a", "content": "ok"}]
    got = kimi.render(msgs, thinking=False, add_generation_prompt=False)
    assert '<|open|>call tool="say<&quot;&amp;>" index="1"<|sep|>' in got.text
    assert '<|open|>argument key="k&quot;&amp;<" type="string"<|sep|>v & "w" <x><|close|>argument<|sep|>' in got.text
    assert '<|open|>message role="tool" tool="say<&quot;&amp;>" index="1"<|sep|>ok' in got.text


def test_tools_declaration_sorted_compact_non_ascii(kimi):
    tools = [{"type": "function", "function": {"name": "z", "description": "天気 é", "parameters": {
        "type": "object", "properties": {"y": {"type": "string", "enum": ["b", "a"]}}}}},
             {"type": "function", "function": {"name": "a"}}]
    got = kimi.render([{"role": "user", "content": "x"}], tools, thinking_effort=None, add_generation_prompt=False)
    body = ('[{"function":{"description":"天気 é","name":"z","parameters":{"properties":{"y":{"enum":["b","a"],'
            '"type":"string"}},"type":"object"}},"type":"function"},{"function":{"name":"a"},"type":"function"}]')
    assert got.text.startswith('<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the '
                               "available tools, described in JSONSchema.\n\n```json\n" + body +
                               "\n```<|close|>message<|sep|><|end_of_msg|>")
    assert kimi.render([{"role": "user", "content": "x"}], [], thinking_effort=None).text.startswith("<|open|>message role=\"user\"")


def test_system_message_with_tools_is_a_dynamic_declaration(kimi):
    msgs = [{"role": "user", "content": "x"},
            {"role": "system", "content": "not rendered", "tools": [{"function": {"name": "n", "b": 1, "a": 2}}]}]
    got = kimi.render(msgs, thinking_effort=None, add_generation_prompt=False)
    assert "not rendered" not in got.text
    assert got.text.endswith('<|open|>message role="system" type="tool-declare"<|sep|>## New Tools Available\n'
                             "The system dynamically extends the toolset via lazy-loading.\nYou have access to all "
                             "existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n"
                             '[{"function":{"a":2,"b":1,"name":"n"}}]\n```<|close|>message<|sep|><|end_of_msg|>')


@pytest.mark.parametrize("choice,line", [("required", "You MUST call tools in the next message."),
                                         ("none", "You MUST NOT call any tools in the next message.")])
def test_tool_choice_note_after_conversation(kimi, choice, line):
    got = kimi.render([{"role": "user", "content": "x"}], thinking_effort=None, tool_choice=choice)
    note = (f'<|open|>message role="system" type="tool-choice"<|sep|>The system is invoked with `tool_choice={choice}`.'
            f"\n{line}<|close|>message<|sep|><|end_of_msg|>")
    assert got.text == ('<|open|>message role="user"<|sep|>x<|close|>message<|sep|><|end_of_msg|>' + note +
                        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    for other in ("auto", None, {"type": "function", "function": {"name": "f"}}):
        assert "tool-choice" not in kimi.render([{"role": "user", "content": "x"}], tool_choice=other).text


def test_response_format_notes(kimi):
    head = "The system is invoked with `response_format={t}`.\nYour response must be raw JSON data without " \
           "markdown code blocks (```json) or any additional formatting."
    got = kimi.render([{"role": "user", "content": "x"}], thinking_effort=None, add_generation_prompt=False,
                      response_format={"type": "json_object"})
    assert got.text.endswith('<|open|>message role="system" type="response-format"<|sep|>' +
                             head.format(t="json_object") + "<|close|>message<|sep|><|end_of_msg|>")
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    got = kimi.render([{"role": "user", "content": "x"}], thinking_effort=None, add_generation_prompt=False,
                      tool_choice="none",
                      response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    want = (head.format(t="json_schema") + "\nThe JSON data must match the following schema:\n```json\n"
            '{"properties":{"a":{"type":"string"},"b":{"type":"integer"}},"type":"object"}\n```')
    assert got.text.endswith('type="response-format"<|sep|>' + want + "<|close|>message<|sep|><|end_of_msg|>")
    assert got.text.index("tool-choice") < got.text.index("response-format")  # §2 order


def test_content_parts_are_separate_segments_and_images_placeholders(kimi):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "first part "}, {"type": "text", "text": "second part"},
                                         {"type": "image_url", "image_url": {"url": "x"}}]}]
    got = kimi.render(msgs, thinking_effort=None, add_generation_prompt=False)
    assert got.text == ('<|open|>message role="user"<|sep|>first part second part<|kimi_image_placeholder|>'
                        "<|close|>message<|sep|><|end_of_msg|>")
    tok = kimi.tokenizer
    units = [u for s in kimi.segments(msgs, thinking_effort=None, add_generation_prompt=False) for u in s.units()]
    assert units[3:8] == [("<|sep|>", True), ("first part ", False), ("second part", False),
                          ("<|kimi_image_placeholder|>", True), ("<|close|>", True)]
    # BPE never merges across segments: ids are the concatenation of each part's ids
    start = got.input_ids.index(163589) + 1
    n1, n2 = len(tok.encode_text("first part ")), len(tok.encode_text("second part"))
    assert got.input_ids[start:start + n1 + n2] == tok.encode_text("first part ") + tok.encode_text("second part")


def test_placeholder_typed_in_text_stays_text(kimi):
    got = kimi.render([{"role": "user", "content": "see <|kimi_image_placeholder|> and <|open|>"}],
                      thinking_effort=None, add_generation_prompt=False)
    assert "see <|kimi_image_placeholder|> and <|open|>" in got.text
    assert got.input_ids.count(163587) == 1  # only the real opener


def test_enc_segments_of_a_user_message(kimi):
    """§3: control tokens, the tag name and each attribute are separate segments; empty segments are dropped."""
    segs = kimi.segments([{"role": "user", "name": "n", "content": ""}], thinking_effort=None,
                         add_generation_prompt=False)
    assert [u for s in segs for u in s.units()] == [
        ("<|open|>", True), ("message", False), (' role="user"', False), (' name="n"', False), ("<|sep|>", True),
        ("<|close|>", True), ("message", False), ("<|sep|>", True), ("<|end_of_msg|>", True)]


def test_describe_states_the_training_contract(kimi):
    d = kimi.describe()
    assert d["renderer"] == "kimi-k3" and d["mask_policy"] == "spec" and d["test_vocabulary"] is True
    assert d["tokenizer_name"] == "regen/kimi-k3-test" and len(d["tokenizer_hash"]) == 64
