"""Tool calls and results in source rows: parallel calls linked in order, ids unique per conversation,
and Kimi-K2 markers written as text parsed into tool_calls / tool messages."""
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


# ------------------------------------------------------------------ Kimi-K2 markers as text

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
PROSE = "You are Kimi. You can call get_weather(city) to get the weather and get_time(city) for the local time."


def _k2_call(cid, args):
    return f"<|tool_call_begin|> {cid} <|tool_call_argument_begin|>{json.dumps(args)}<|tool_call_end|>"


def _kimi_row(turns, system=PROSE):
    return {"source": "continual_tool_kimi", "conversations": [{"from": "system", "value": system}] + turns}


def _norm(row, infer=True):
    return normalize_row(row, "conversations", {"conversations": "conversations"}, infer_tools=infer)


def test_kimi_text_row_of_the_issue_becomes_structured_calls_with_inferred_tools():
    row = _kimi_row([{"from": "human", "value": "Weather in Oslo?"},
                     {"from": "gpt", "value": SB + _k2_call("functions.get_weather:0", {"city": "Oslo"}) + SE},
                     {"from": "tool", "value": '## Return of functions.get_weather:0\n{"temp": 3}'},
                     {"from": "gpt", "value": "It is 3 degrees."}])
    msgs, tools, labels = _norm(row)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    call = msgs[2]["tool_calls"][0]
    assert call["id"] == "functions.get_weather:0" and call["function"] == {"name": "get_weather",
                                                                            "arguments": '{"city": "Oslo"}'}
    assert msgs[3] == {"role": "tool", "content": '{"temp": 3}', "tool_call_id": "functions.get_weather:0",
                       "name": "get_weather"}
    assert labels["tools_inferred"] is True
    assert tools == [{"type": "function", "function": {
        "name": "get_weather", "description": tools[0]["function"]["description"],
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    with pytest.raises(RowError, match="declares no tools"):
        _norm(row, infer=False)


def test_kimi_text_several_calls_multi_turn_thinking_and_several_returns_in_one_turn():
    row = _kimi_row([
        {"from": "human", "value": "Weather and time in Oslo?"},
        {"from": "gpt", "value": "<think>Two calls.</think>Checking." + SB + _k2_call("functions.get_weather:0", {"city": "Oslo"})
                                 + _k2_call("functions.get_time:1", {"city": "Oslo", "utc": True}) + SE},
        {"from": "tool", "value": "## Return of functions.get_time:1\n10:00\n## Return of functions.get_weather:0\nrain"},
        {"from": "gpt", "value": "Rain at 10:00."}, {"from": "human", "value": "And in Rome?"},
        {"from": "gpt", "value": SB + _k2_call("functions.get_weather:0", {"city": "Rome"}) + SE},  # index restarts
        {"from": "tool", "value": "## Return of functions.get_weather:0\nsun"}, {"from": "human", "value": "Thanks"}])
    msgs, tools, labels = _norm(row)
    assert msgs[2]["reasoning_content"] == "Two calls." and msgs[2]["content"] == "Checking."
    assert _links(msgs) == [("get_time", "10:00"), ("get_weather", "rain"), ("get_weather", "sun")]
    assert len(set(_ids(msgs))) == 3 and all(i.startswith("functions.") for i in _ids(msgs))
    assert {t["function"]["name"] for t in tools} == {"get_weather", "get_time"}
    time_params = next(t for t in tools if t["function"]["name"] == "get_time")["function"]["parameters"]
    assert time_params["properties"] == {"city": {"type": "string"}, "utc": {"type": "boolean"}}


def test_kimi_text_declarations_as_json_in_the_system_text_are_used():
    schemas = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                 "parameters": {"type": "object", "properties": {
                                                     "city": {"type": "string"}}, "required": ["city"]}}}]
    system = ("<|im_system|>tool_declare<|im_middle|>" + json.dumps(schemas) + "<|im_end|> You are a helpful {agent}.")
    row = _kimi_row([{"from": "human", "value": "Weather?"},
                     {"from": "gpt", "value": SB + _k2_call("functions.get_weather:0", {"city": "Oslo"}) + SE},
                     {"from": "tool", "value": "## Return of functions.get_weather:0\nsun"}], system=system)
    msgs, tools, labels = _norm(row)
    assert tools == schemas and "tools_inferred" not in labels
    # bare function objects in prose also count
    bare = "Functions: " + json.dumps({"name": "get_weather", "parameters": {"type": "object", "properties": {}}})
    _, tools2, labels2 = _norm({**row, "conversations": [{"from": "system", "value": bare}] + row["conversations"][1:]})
    assert tools2[0]["function"]["name"] == "get_weather" and "tools_inferred" not in labels2


@pytest.mark.parametrize("value,reason", [
    (SB + _k2_call("functions.f:0", {}), "section is not closed"),
    (SB + SB + _k2_call("functions.f:0", {}) + SE, "do not balance: 2 section begin"),
    (SB + "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}" + SE,
     "1 call begin(s), 1 argument begin(s), 0 call end(s)"),
    (SB + _k2_call("functions.f", {}) + SE, "is not functions.NAME:INDEX"),
    (SB + _k2_call("functions.f:x", {}) + SE, "is not functions.NAME:INDEX"),
    (SB + "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{oops<|tool_call_end|>" + SE, "not valid JSON"),
    (SB + "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>[1]<|tool_call_end|>" + SE, "not an object"),
    (SB + _k2_call("functions.f:0", {}) + SE + " trailing words", "text follows the Kimi tool-call section"),
    (SE + SB, "end comes before its begin"),
    ("just <|tool_call_end|> stray", "do not balance"),
])
def test_malformed_kimi_markers_are_rejected_with_a_reason(value, reason):
    row = _kimi_row([{"from": "human", "value": "q"}, {"from": "gpt", "value": value},
                     {"from": "tool", "value": "## Return of functions.f:0\nx"}])
    with pytest.raises(RowError) as err:
        _norm(row)
    assert reason in str(err.value)


def test_kimi_return_for_an_unknown_call_is_rejected():
    row = _kimi_row([{"from": "human", "value": "q"},
                     {"from": "gpt", "value": SB + _k2_call("functions.get_weather:0", {}) + SE},
                     {"from": "tool", "value": "## Return of functions.get_time:5\nx"}])
    with pytest.raises(RowError, match="'functions.get_time:5' matches none of the pending calls"):
        _norm(row)


def test_kimi_tool_rows_fill_the_tool_use_quota_end_to_end(tmp_path):
    """The kimi-k3 profile's share of tool_use prompts is filled from text-marker rows (was: zero, silently)."""
    from regen.config.select import SelectConfig, SourceConfig
    from regen.report.query import query
    from regen.rundir import RunDir
    from regen.select.stage import run_select

    rows = []
    for i, city in enumerate(("Oslo", "Lima", "Pune", "Kyiv", "Doha", "Riga")):
        rows.append(_kimi_row([{"from": "human", "value": f"What is the weather like in {city} today, and why?"},
                               {"from": "gpt", "value": SB + _k2_call("functions.get_weather:0", {"city": city}) + SE},
                               {"from": "tool", "value": f"## Return of functions.get_weather:0\n{{\"temp\": {i}}}"},
                               {"from": "gpt", "value": "Done."}]))
        rows.append({"source": "chat", "conversations": [{"from": "human", "value": f"Tell me a story about {city}."}]})
    (tmp_path / "kimi.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = SourceConfig(name="kimi-mtp", path=str(tmp_path / "kimi.jsonl"),
                       category_map={"continual_tool_kimi": "tool_use", "chat": "general"})
    run = RunDir.at(tmp_path / "run")
    cfg = SelectConfig(sources=[src], total=10, mix={"general": 0.5, "tool_use": 0.5},
                       filters=["empty", "control_chars", "tool_schema", "exact_dedup"])  # rows alike on purpose
    m = run_select(cfg, run, seed=0, progress=False)
    assert m["mix"]["tool_use"]["selected"] == 5 and m["warnings"] == [] and m["num_tools_inferred"] == 5
    n = query(run.root, "SELECT count(*) FROM prompts WHERE tools_inferred AND category = 'tool_use'")[1][0][0]
    assert n == 5
