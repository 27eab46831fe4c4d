"""Tool calls and results in source rows: parallel calls linked in order, ids unique per conversation (issue 11,
point 2), and Kimi-K2 markers written as text parsed into tool_calls / tool messages (point 3)."""
from __future__ import annotations

import json

import pytest

from regen.select.shapes import RowError, normalize_row

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
         for n in ("get_weather", "get_time", "convert")]


def _fc(*calls):
    body = [{"name": n, "arguments": a} for n, a in calls]
    return {"from": "function_call", "value": json.dumps(body if len(body) > 1 else body[0])}


def _obs(value):
    return {"from": "observation", "value": value if isinstance(value, str) else json.dumps(value)}


def _sharegpt(turns, tools=TOOLS):
    return normalize_row({"conversations": turns, "tools": json.dumps(tools)}, "conversations",
                         {"conversations": "conversations"})[0]


def _links(messages):
    """[(call name, result content)] for every tool message, through its tool_call_id."""
    calls = {c["id"]: c for m in messages for c in m.get("tool_calls") or []}
    return [(calls[m["tool_call_id"]]["function"]["name"], m["content"]) for m in messages if m["role"] == "tool"]


def _ids(messages):
    return [c["id"] for m in messages for c in m.get("tool_calls") or []]


def test_parallel_calls_and_a_json_list_of_results_are_linked_in_order():
    msgs = _sharegpt([{"from": "human", "value": "Weather and time in Oslo?"},
                      _fc(("get_weather", {"city": "Oslo"}), ("get_time", {"city": "Oslo"})),
                      _obs([{"temp": 3}, {"time": "10:00"}]), {"from": "gpt", "value": "3 degrees at 10:00."}])
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool"]
    assert _links(msgs) == [("get_weather", '{"temp": 3}'), ("get_time", '{"time": "10:00"}')]
    assert [m["name"] for m in msgs if m["role"] == "tool"] == ["get_weather", "get_time"]
    assert len(set(_ids(msgs))) == 2


def test_parallel_calls_with_one_result_turn_each_and_three_calls():
    msgs = _sharegpt([{"from": "human", "value": "q"},
                      _fc(("get_weather", {"city": "A"}), ("get_time", {}), ("convert", {"x": 1})),
                      _obs("w"), _obs("t"), _obs("c")])
    assert _links(msgs) == [("get_weather", "w"), ("get_time", "t"), ("convert", "c")]


def test_multi_turn_results_land_on_their_own_turn_and_ids_never_repeat():
    msgs = _sharegpt([{"from": "human", "value": "q1"}, _fc(("get_weather", {"city": "A"})), _obs("sunny"),
                      {"from": "gpt", "value": "Sunny."}, {"from": "human", "value": "q2"},
                      _fc(("get_time", {}), ("convert", {"x": 2})), _obs(["ten", "two"]),
                      {"from": "gpt", "value": "Ten, two."}, {"from": "human", "value": "q3"}])
    assert _links(msgs) == [("get_weather", "sunny"), ("get_time", "ten"), ("convert", "two")]
    ids = _ids(msgs)
    assert len(ids) == 3 == len(set(ids))
    # each tool message follows its own assistant turn
    a2 = [i for i, m in enumerate(msgs) if m.get("tool_calls")][1]
    assert {msgs[a2 + 1]["tool_call_id"], msgs[a2 + 2]["tool_call_id"]} == {c["id"] for c in msgs[a2]["tool_calls"]}


def test_openai_ids_that_restart_per_turn_are_made_unique_and_results_follow_them():
    call = lambda name: {"id": "call_0", "type": "function", "function": {"name": name, "arguments": "{}"}}  # noqa: E731
    row = {"messages": [
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "", "tool_calls": [call("get_weather")]},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}, {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "", "tool_calls": [call("get_time")]},
        {"role": "tool", "tool_call_id": "call_0", "content": "ten"}, {"role": "user", "content": "thanks"}],
        "tools": TOOLS}
    msgs = normalize_row(row, "messages", {"messages": "messages"})[0]
    assert len(set(_ids(msgs))) == 2 and _links(msgs) == [("get_weather", "sunny"), ("get_time", "ten")]


def test_explicit_result_ids_out_of_order_are_linked_by_id():
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": "{}"}}
             for i, n in enumerate(("get_weather", "get_time"))]
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": calls},
                        {"role": "tool", "tool_call_id": "c1", "content": "ten"},
                        {"role": "tool", "tool_call_id": "c0", "content": "sunny"}], "tools": TOOLS}
    msgs = normalize_row(row, "messages", {"messages": "messages"})[0]
    assert _links(msgs) == [("get_time", "ten"), ("get_weather", "sunny")]


def test_llamafactory_typed_parts_ids_unique_across_turns():
    part = lambda n: {"type": "tool_call", "value": json.dumps({"name": n, "arguments": {}})}  # noqa: E731
    row = {"messages": [
        {"role": "user", "content": [{"type": "text", "value": "q1"}]},
        {"role": "assistant", "content": [part("get_weather"), part("get_time")]},
        {"role": "tool", "content": [{"type": "text", "value": json.dumps(["w", "t"])}]},
        {"role": "user", "content": [{"type": "text", "value": "q2"}]},
        {"role": "assistant", "content": [part("convert")]},
        {"role": "tool", "content": [{"type": "text", "value": "c"}]},
        {"role": "user", "content": [{"type": "text", "value": "q3"}]}], "tools": TOOLS}
    msgs = normalize_row(row, "messages", {"messages": "messages"})[0]
    assert len(set(_ids(msgs))) == 3 and _links(msgs) == [("get_weather", "w"), ("get_time", "t"), ("convert", "c")]


@pytest.mark.parametrize("turns,reason", [
    ([_fc(("get_weather", {}), ("get_time", {})), _obs("not a list")], "not a JSON list of 2 results"),
    ([_fc(("get_weather", {}), ("get_time", {})), _obs(["only one"])], "not a JSON list of 2 results"),
    ([_fc(("get_weather", {}), ("get_time", {})), _obs("a"), _obs("b"), _obs("c")], "2 tool call(s) at"),
    ([_fc(("get_weather", {}), ("get_time", {})), _obs("a"), _obs("b"), _obs("c"), {"from": "gpt", "value": "x"}],
     "but 3 tool result(s)"),
    ([_fc(("get_weather", {})), {"from": "gpt", "value": "no result"}, {"from": "human", "value": "q"}],
     "have no result before this turn"),
    ([_fc(("get_weather", {})), {"from": "human", "value": "go on"}], "have no result before this turn"),
    ([{"from": "function_call", "value": "[]"}], "empty list of calls"),
    ([{"from": "function_call", "value": json.dumps([{"name": "f"}, {"arguments": {}}])}], "call 1 of the function_call list"),
])
def test_mismatched_calls_and_results_are_rejected_with_a_reason(turns, reason):
    with pytest.raises(RowError) as err:
        _sharegpt([{"from": "human", "value": "q"}] + turns)
    assert reason in str(err.value)


def test_an_unknown_result_id_is_rejected():
    row = {"messages": [{"role": "user", "content": "q"},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"id": "a", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "zzz", "content": "x"}], "tools": TOOLS}
    with pytest.raises(RowError, match="'zzz' matches none of the pending calls"):
        normalize_row(row, "messages", {"messages": "messages"})
