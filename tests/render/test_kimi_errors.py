"""The Kimi-K3 renderer raises exactly where the reference (ENC) raises (RenderError with a reason code, the message
index and the fix) and renders as ENC everything else (issue #11 point 5); `row_problems` (validation) names what
makes a rendered conversation unfit as a training row."""
from __future__ import annotations

import pytest
from kimi_helpers import kimi  # noqa: F401  (fixture)

from regen.render.kimi_k3.messages import row_problems
from regen.render.kimi_k3.renderer import KimiK3Renderer, RenderError

U = {"role": "user", "content": "q"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
A_CALL = {"role": "assistant", "content": "", "tool_calls": [CALL]}

U2 = {"role": "user", "content": "and then?"}
TOOL_C1 = {"role": "tool", "tool_call_id": "c1", "content": "5"}

# What the reference (ENC) itself refuses: the renderer raises there, with a reason code and the index.
REFUSED = [
    ("bad_arguments", 1, [U, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "[1]"}}]}]),
    ("bad_arguments", 1, [U, {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}]),
    ("bad_arguments", 1, [U, {"role": "assistant", "content": "", "tool_calls": ["f(1)"]}]),
    ("bad_arguments", 1, [U, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": 7}}]}]),
    ("unknown_content_part", 0, [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]),
    ("unknown_content_part", 0, [{"role": "user", "content": [{"type": "text"}]}]),
    ("unknown_content_part", 0, [{"role": "user", "content": [{"text": "no type"}]}]),
    ("unknown_content_part", 0, [{"role": "user", "content": ["bare string part"]}]),
    ("unknown_content_part", 2, [U, A_CALL, {"role": "tool", "tool_call_id": "c1", "content": [{"type": "x"}]}]),
    ("bad_message", 0, [{"role": "user", "content": 42}]),
    ("bad_message", 1, [U, {"role": "assistant", "content": {"text": "a dict"}}]),
    ("bad_message", 0, [{"content": "no role"}]),
    ("bad_message", None, {"role": "user", "content": "not a list"}),
    ("tool_result_without_call", 1, [U, {"role": "tool", "content": "5"}]),
    ("tool_result_without_call", 3, [U, A_CALL, TOOL_C1, {"role": "tool", "content": "6"}]),
]

# What ENC renders although a training row must not contain it (issue #11 point 5): the renderer renders it as
# ENC does; `row_problems` (validation) names the problem.
UNFIT = [
    ("role_order", 2, [U, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]),
    ("role_order", 2, [U, A_CALL, {"role": "user", "content": "no results?"}]),
    ("role_order", 2, [U, A_CALL, {"role": "assistant", "content": "b"}]),
    ("tool_result_without_call", 1, [U, {"role": "tool", "name": "t", "content": "5"}]),
    ("tool_result_without_call", 2, [U, {"role": "assistant", "content": "a"}, {"role": "tool", "tool": "t",
                                                                               "content": "5"}]),
    ("tool_result_without_call", 2, [U, A_CALL, {"role": "tool", "tool_call_id": "zz", "content": "5"}]),
    ("tool_result_without_call", 3, [U, A_CALL, TOOL_C1, {"role": "tool", "name": "t", "content": "6"}]),
    ("tool_result_without_call", 4, [U, A_CALL, TOOL_C1, U2, {"role": "tool", "tool_call_id": "zz", "name": "g",
                                                              "content": "6"}]),
    ("unknown_content_part", 0, [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]),
    ("bad_message", 1, [U, {"role": "assistant", "content": "a", "reasoning_content": ["not", "a", "string"]}]),
    ("bad_message", 0, ["not a dict", U]),
    ("bad_message", None, []),
    ("unknown_role", 1, [U, {"role": "developer", "content": "be nice"}]),
]


@pytest.mark.parametrize("reason,index,messages", REFUSED)
def test_what_the_reference_refuses_raises_render_error(kimi, reason, index, messages):
    with pytest.raises(RenderError) as err:
        kimi.render(messages)
    assert isinstance(err.value, ValueError)
    assert (err.value.reason, err.value.index) == (reason, index)
    if index is not None:
        assert str(err.value).startswith(f"messages[{index}]: ")


@pytest.mark.parametrize("reason,index,messages", UNFIT)
def test_what_the_reference_renders_renders_and_validation_names_the_problem(kimi, reason, index, messages):
    kimi.render(messages, thinking_effort=None, add_generation_prompt=False)
    problems = row_problems(messages)
    assert problems, messages
    assert (problems[0].reason, problems[0].index) == (reason, index)


def test_tool_result_after_a_user_turn_renders_as_the_reference(kimi):
    """The issue's input: a tool message whose tool_call_id matches none of the last assistant's calls, after a
    user turn: ENC names it after the message's own `name` and gives it the next index (user turns do not reset
    the count, §2 "Tool result")."""
    msgs = [U, A_CALL, TOOL_C1, U2, {"role": "tool", "tool_call_id": "zz", "name": "g", "content": "6"}]
    got = kimi.render(msgs, thinking_effort=None, add_generation_prompt=False)
    assert got.text.endswith('<|open|>message role="user"<|sep|>and then?<|close|>message<|sep|><|end_of_msg|>'
                             '<|open|>message role="tool" tool="g" index="2"<|sep|>6<|close|>message<|sep|>'
                             "<|end_of_msg|>")
    assert '<|open|>message role="tool" tool="f" index="1"<|sep|>5<|close|>' in got.text
    # `tool` wins over `name`; with neither, the call at the same position names it
    got = kimi.render([U, A_CALL, TOOL_C1, {"role": "tool", "tool": "h", "name": "g", "content": "7"}],
                      thinking_effort=None, add_generation_prompt=False)
    assert got.text.endswith('<|open|>message role="tool" tool="h" index="2"<|sep|>7<|close|>message<|sep|>'
                             "<|end_of_msg|>")
    two = {"role": "assistant", "content": "", "tool_calls": [CALL, {"id": "c2", "function": {"name": "g"}}]}
    got = kimi.render([U, two, {"role": "tool", "tool_call_id": "x1", "content": "a"},
                       {"role": "tool", "tool_call_id": "x2", "content": "b"}], thinking_effort=None,
                      add_generation_prompt=False)
    assert 'tool="f" index="1"<|sep|>a<|close|>' in got.text and 'tool="g" index="2"<|sep|>b<|close|>' in got.text


def test_none_and_empty_reasoning_are_valid_and_keep_the_think_tags(kimi):
    for rc in (None, "", "  \n "):
        got = kimi.render([U, {"role": "assistant", "content": "a", "reasoning_content": rc}],
                          thinking_effort=None, add_generation_prompt=False)
        assert ('<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|><|open|>response'
                "<|sep|>a<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>") in got.text
    got = kimi.render([U, {"role": "assistant", "content": "a", "reasoning": "via reasoning key"}])
    assert "<|open|>think<|sep|>via reasoning key<|close|>think<|sep|>" in got.text
    assert row_problems([U, {"role": "assistant", "content": "a", "reasoning_content": None}]) == []


def test_unknown_roles_and_non_dicts_are_skipped_like_enc(kimi):
    got = kimi.render([{"role": "developer", "content": "hidden"}, "junk", {"role": 5, "content": "x"}, U],
                      thinking_effort=None, add_generation_prompt=False)
    assert got.text == '<|open|>message role="user"<|sep|>q<|close|>message<|sep|><|end_of_msg|>'


def test_what_enc_renders_of_odd_parts_and_values(kimi):
    got = kimi.render([U, {"role": "assistant", "content": "a", "reasoning_content": ["x", 1]},
                       {"role": "assistant", "content": "b"},
                       {"role": "tool", "name": "t", "content": [{"type": "input_text", "text": "r"},
                                                                 {"type": "text", "text": 3}]}],
                      thinking=True, thinking_effort=None, add_generation_prompt=False)
    assert "<|open|>think<|sep|>['x', 1]<|close|>think<|sep|>" in got.text
    assert got.text.endswith('<|open|>message role="tool" tool="t" index="1"<|sep|>r3<|close|>message<|sep|>'
                             "<|end_of_msg|>")
    assert len(got.assistant_spans) == 2
    assert kimi.render([], thinking_effort=None).text == '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'


@pytest.mark.parametrize("kwargs,match", [({"enable_thinking": True}, "unknown Kimi-K3 template kwargs"),
                                          ({"thinking_effort": "xhigh"}, "thinking_effort"),
                                          ({"thinking_effort": ""}, "thinking_effort")])
def test_bad_options(kimi, kwargs, match):
    with pytest.raises(RenderError, match=match) as err:
        kimi.render([U], **kwargs)
    assert err.value.reason == "bad_option" and err.value.index is None


def test_bad_constructor_options(kimi):
    with pytest.raises(RenderError, match="mask_policy"):
        KimiK3Renderer(kimi.tokenizer, mask_policy="everything")
    with pytest.raises(RenderError, match="unknown Kimi-K3 template kwargs"):
        KimiK3Renderer(kimi.tokenizer, template_defaults={"preserve_thinking": True})


def test_render_error_pickles_with_its_reason():
    import pickle

    err = pickle.loads(pickle.dumps(RenderError("role_order", "two assistant messages in a row", 3)))
    assert (err.reason, err.index, str(err)) == ("role_order", 3, "messages[3]: two assistant messages in a row")
