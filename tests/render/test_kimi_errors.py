"""Conversations the Kimi-K3 renderer must refuse (RenderError with a reason code, the message index and the
fix), and the ones it must accept although they look odd (`None` reasoning)."""
from __future__ import annotations

import pytest

from kimi_helpers import kimi  # noqa: F401  (fixture)
from regen.render.kimi_k3.renderer import KimiK3Renderer, RenderError

U = {"role": "user", "content": "q"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
A_CALL = {"role": "assistant", "content": "", "tool_calls": [CALL]}

BAD = [
    ("role_order", 2, [U, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]),
    ("role_order", 2, [U, A_CALL, {"role": "user", "content": "no results?"}]),
    ("role_order", 2, [U, A_CALL, {"role": "assistant", "content": "b"}]),
    ("tool_result_without_call", 1, [U, {"role": "tool", "content": "5"}]),
    ("tool_result_without_call", 2, [U, {"role": "assistant", "content": "a"}, {"role": "tool", "content": "5"}]),
    ("tool_result_without_call", 2, [U, A_CALL, {"role": "tool", "tool_call_id": "zz", "content": "5"}]),
    ("tool_result_without_call", 3, [U, A_CALL, {"role": "tool", "tool_call_id": "c1", "content": "5"},
                                     {"role": "tool", "content": "6"}]),
    ("bad_arguments", 1, [U, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "[1]"}}]}]),
    ("bad_arguments", 1, [U, {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}]),
    ("unknown_content_part", 0, [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]),
    ("unknown_content_part", 0, [{"role": "user", "content": [{"type": "text"}]}]),
    ("unknown_content_part", 0, [{"role": "user", "content": ["bare string part"]}]),
    ("bad_message", 0, [{"role": "user", "content": 42}]),
    ("bad_message", 1, [U, {"role": "assistant", "content": "a", "reasoning_content": ["not", "a", "string"]}]),
    ("bad_message", 0, ["not a dict"]),
    ("bad_message", None, []),
    ("unknown_role", 1, [U, {"role": "developer", "content": "be nice"}]),
]


@pytest.mark.parametrize("reason,index,messages", BAD)
def test_bad_conversations_raise_render_error(kimi, reason, index, messages):
    with pytest.raises(RenderError) as err:
        kimi.render(messages)
    assert isinstance(err.value, ValueError)
    assert (err.value.reason, err.value.index) == (reason, index)
    if index is not None:
        assert str(err.value).startswith(f"messages[{index}]: ")


def test_none_and_empty_reasoning_are_valid_and_keep_the_think_tags(kimi):
    for rc in (None, "", "  \n "):
        got = kimi.render([U, {"role": "assistant", "content": "a", "reasoning_content": rc}],
                          thinking_effort=None, add_generation_prompt=False)
        assert ('<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|><|open|>response'
                "<|sep|>a<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>") in got.text
    got = kimi.render([U, {"role": "assistant", "content": "a", "reasoning": "via reasoning key"}])
    assert "<|open|>think<|sep|>via reasoning key<|close|>think<|sep|>" in got.text


def test_unknown_roles_skip_like_enc_when_asked(kimi):
    enc = KimiK3Renderer(kimi.tokenizer, unknown_roles="skip")
    got = enc.render([{"role": "developer", "content": "hidden"}, U], thinking_effort=None, add_generation_prompt=False)
    assert got.text == '<|open|>message role="user"<|sep|>q<|close|>message<|sep|><|end_of_msg|>'


def test_non_strict_renders_what_enc_renders(kimi):
    loose = KimiK3Renderer(kimi.tokenizer, strict=False)
    got = loose.render([U, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"role": "tool", "name": "t", "content": [{"type": "input_text", "text": "r"}]}],
                       thinking=False, add_generation_prompt=False)
    assert got.text.endswith('<|open|>message role="tool" tool="t" index="1"<|sep|>r<|close|>message<|sep|>'
                             "<|end_of_msg|>")
    assert len(got.assistant_spans) == 2
    with pytest.raises(RenderError, match="no resolvable tool name"):
        loose.render([U, {"role": "tool", "content": "r"}])


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
    with pytest.raises(RenderError, match="unknown_roles"):
        KimiK3Renderer(kimi.tokenizer, unknown_roles="maybe").render([U])
    with pytest.raises(RenderError, match="unknown Kimi-K3 template kwargs"):
        KimiK3Renderer(kimi.tokenizer, template_defaults={"preserve_thinking": True})


def test_render_error_pickles_with_its_reason():
    import pickle

    err = pickle.loads(pickle.dumps(RenderError("role_order", "two assistant messages in a row", 3)))
    assert (err.reason, err.index, str(err)) == ("role_order", 3, "messages[3]: two assistant messages in a row")
