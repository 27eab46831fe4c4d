"""Kimi-K3 tool calls and tool results (`shared/docs/kimi-k3-format.md` §2 Tools section, Tool result)."""
from __future__ import annotations

import json

import pytest
from kimi_helpers import kimi  # noqa: F401  (fixture)

from regen.render.kimi_k3.renderer import RenderError

OPTS = {"thinking": False, "add_generation_prompt": False}


def call(name, arguments, cid=None):
    c = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return {**c, "id": cid} if cid else c


def tools_section(kimi, arguments) -> str:
    """The rendered tools section of one call to `f` with `arguments`."""
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [call("f", arguments)]}]
    text = kimi.render(msgs, **OPTS).text
    return text[text.index("<|open|>tools<|sep|>"):text.index("<|close|>tools<|sep|>")]


def arg(key, typ, value) -> str:
    return f'<|open|>argument key="{key}" type="{typ}"<|sep|>{value}<|close|>argument<|sep|>'


CALL_F = '<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'


def test_string_and_scalar_arguments_in_source_order(kimi):
    got = tools_section(kimi, '{"z": "Paris, \\"FR\\"", "a": 1e2, "t": true, "n": null, "f": -0.50}')
    assert got == (CALL_F + arg("z", "string", 'Paris, "FR"') + arg("a", "number", "1e2") + arg("t", "boolean", "true")
                   + arg("n", "null", "null") + arg("f", "number", "-0.50") + "<|close|>call<|sep|>")


def test_nested_values_keep_spelling_order_and_non_ascii(kimi):
    got = tools_section(kimi, '{"o": {"b": 1E+2, "a": [1.50, "é", {"y": null}]}, "l": [], "e": {}}')
    assert arg("o", "object", '{"b": 1E+2, "a": [1.50, "é", {"y": null}]}') in got
    assert arg("l", "array", "[]") in got and arg("e", "object", "{}") in got


def test_dict_arguments(kimi):
    got = tools_section(kimi, {"city": "東京", "days": 3, "opts": {"metric": True, "x": 1.0}})
    assert got == (CALL_F + arg("city", "string", "東京") + arg("days", "number", "3")
                   + arg("opts", "object", '{"metric": true, "x": 1.0}') + "<|close|>call<|sep|>")


@pytest.mark.parametrize("empty", ["", "   ", "{}", None, {}])
def test_empty_arguments_give_a_call_without_arguments(kimi, empty):
    assert tools_section(kimi, empty) == CALL_F + "<|close|>call<|sep|>"


def test_raw_non_json_arguments_become_a_json_block(kimi):
    raw = '{"a": 1, oops'
    assert tools_section(kimi, raw) == (CALL_F + '<|open|>json type="object"<|sep|>' + raw
                                        + "<|close|>json<|sep|><|close|>call<|sep|>")


@pytest.mark.parametrize("bad", ["[1, 2]", '"text"', "3", "null", 5, ["a"]])
def test_non_object_arguments_are_errors(kimi, bad):
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call("f", bad)]}]
    with pytest.raises(RenderError) as err:
        kimi.render(msgs, **OPTS)
    assert err.value.reason == "bad_arguments" and err.value.index == 1
    assert "messages[1]" in str(err.value) and "object" in str(err.value)


def test_several_calls_are_indexed_and_ids_never_rendered(kimi):
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "ok", "tool_calls": [call("f", "{}", "id-1"), call("g", '{"k": "v"}', "id-2")]}]
    text = kimi.render(msgs, **OPTS).text
    assert ('<|open|>response<|sep|>ok<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"'
            '<|sep|><|close|>call<|sep|><|open|>call tool="g" index="2"<|sep|>' + arg("k", "string", "v")
            + "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>") in text
    assert "id-1" not in text and "id-2" not in text


def tool_headers(text: str) -> list[str]:
    out, pos = [], 0
    while (i := text.find('<|open|>message role="tool"', pos)) >= 0:
        j = text.index("<|close|>message", i)
        out.append(text[i + len("<|open|>message role=\"tool\""):j].replace("<|sep|>", "|"))
        pos = j
    return out


def test_results_reordered_into_call_order_and_named_by_call(kimi):
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [call("a", "{}", "c1"), call("b", "{}", "c2"),
                                                                 call("c", "{}", "c3")]},
            {"role": "tool", "tool_call_id": "c3", "name": "wrong", "content": "R3"},
            {"role": "tool", "tool_call_id": "c1", "content": "R1"},
            {"role": "tool", "tool_call_id": "c2", "tool": "also-wrong", "content": "R2"}]
    text = kimi.render(msgs, **OPTS).text
    assert tool_headers(text) == [' tool="a" index="1"|R1', ' tool="b" index="2"|R2', ' tool="c" index="3"|R3']


def test_user_message_does_not_reset_the_index_and_splits_runs(kimi):
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [call("a", "{}", "c1"), call("b", "{}", "c2"),
                                                                 call("c", "{}", "c3")]},
            {"role": "tool", "tool_call_id": "c2", "content": "R2"},
            {"role": "tool", "tool_call_id": "c1", "content": "R1"},
            {"role": "user", "content": "more?"},
            {"role": "tool", "tool_call_id": "c3", "content": "R3"}]
    text = kimi.render(msgs, **OPTS).text
    assert tool_headers(text) == [' tool="a" index="1"|R1', ' tool="b" index="2"|R2', ' tool="c" index="3"|R3']


def test_unresolved_run_keeps_order_and_names_by_tool_then_name_then_position(kimi):
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [call("a", "{}", "c1"), call("b", "{}", "c2"),
                                                                 call("c", "{}", "c3"), call("d", "{}", "c4")]},
            {"role": "tool", "tool_call_id": "c4", "tool": "T", "name": "N", "content": "x1"},  # id matches
            {"role": "tool", "name": "N", "content": "x2"},  # no id: the run is unresolved
            {"role": "tool", "content": "x3"},  # position 3 -> call "c"
            {"role": "tool", "tool_call_id": "c1", "content": "x4"}]  # matched but run unresolved -> position 4
    text = kimi.render(msgs, **OPTS).text
    assert tool_headers(text) == [' tool="T" index="1"|x1', ' tool="N" index="2"|x2', ' tool="c" index="3"|x3',
                                  ' tool="d" index="4"|x4']


def test_tool_results_count_from_the_last_assistant(kimi):
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [call("a", "{}", "c1")]},
            {"role": "tool", "tool_call_id": "c1", "content": "1"},
            {"role": "assistant", "content": "", "tool_calls": [call("b", "{}", "c2")]},
            {"role": "tool", "tool_call_id": "c2", "content": "2"}]
    got = kimi.render(msgs, **OPTS)
    assert tool_headers(got.text) == [' tool="a" index="1"|1', ' tool="b" index="1"|2']
    assert len(got.assistant_spans) == 2


def test_tool_result_content_parts_and_json_content(kimi):
    payload = json.dumps({"temp": 21}, ensure_ascii=False)
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call("w", "{}", "c")]},
            {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": payload}]}]
    assert tool_headers(kimi.render(msgs, **OPTS).text) == [' tool="w" index="1"|{"temp": 21}']
