"""Malformed rows in a known shape are rejects with filter `parse` and a reason naming the field."""
from __future__ import annotations

import json

import pytest

from regen.config.select import SelectConfig, SourceConfig
from regen.errors import InputError
from regen.report.query import query
from regen.rundir import RunDir
from regen.select.stage import run_select


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) and r.startswith("{") else json.dumps(r, ensure_ascii=False)) + "\n")
    return path

OK = {"conversations": [{"from": "human", "value": "What is the capital of France?"},
                        {"from": "gpt", "value": "Paris."}]}
KIMI_OPEN = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
TOOLS = json.dumps([{"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}])

# (row or raw line, substring expected in the reason)
CONVERSATION_CASES = [
    (["not", "an", "object"], "row is a list"),
    ("{this is not json", "bad JSON"),
    ({"id": 1}, "conversations: missing field"),
    ({"conversations": "hello"}, "must be a list of turns"),
    ({"conversations": []}, "empty conversation"),
    ({"conversations": ["hello"]}, "turn is a str"),
    ({"conversations": [{"value": "hi"}]}, "has no role field"),
    ({"conversations": [{"from": "narrator", "value": "hi"}]}, "unknown role 'narrator'"),
    ({"conversations": [{"from": "human", "value": 42}]},
     "conversations[0].value: must be a string or a list of content parts, got a number (42)"),
    ({"conversations": [{"from": "gpt", "value": "Hello!"}, {"from": "human", "value": "hi"}]}, "starts with 'assistant'"),
    ({"conversations": [{"from": "system", "value": "be nice"}]}, "no user message"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "observation", "value": "{}"}]},
     "tool result without a preceding tool call"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "function_call", "value": "{name: f}"}]},
     "function_call value is not valid JSON"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "function_call", "value": "{\"arguments\": {}}"}]},
     "must be an object with a string 'name'"),
    ({"conversations": [{"from": "human", "value": "hi"},
                        {"from": "function_call", "value": "[{\"name\": \"f\"}, {\"name\": \"f\"}]"},
                        {"from": "observation", "value": "{}"}], "tools": TOOLS}, "not a JSON list of 2 results"),
    ({"conversations": [{"from": "human", "value": "[{\"type\": \"text\"}]"}]}, "has no string 'text'"),
    ({"conversations": [{"from": "human", "value": "[{\"type\": \"text\", \"text\": \"a\"},"}]}, "does not parse"),
    ({"conversations": [{"from": "human", "value": "[{\"type\": \"image_url\", \"image_url\": {}}]"}]}, "has no url"),
    ({"conversations": [{"from": "human", "value": "[{\"type\": \"audio\", \"audio\": \"x\"}]"}]}, "unsupported type 'audio'"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": KIMI_OPEN}], "tools": TOOLS},
     "section is not closed"),
    ({"conversations": [{"from": "human", "value": "hi"},
                        {"from": "gpt", "value": KIMI_OPEN.replace("{}", "{oops") + "<|tool_calls_section_end|>"}],
      "tools": TOOLS}, "arguments are not valid JSON"),
    ({"conversations": [{"from": "human", "value": "hi"},
                        {"from": "gpt", "value": KIMI_OPEN.replace("functions.f:0", "f") + "<|tool_calls_section_end|>"}],
      "tools": TOOLS}, "is not functions.NAME:INDEX"),
    ({"conversations": OK["conversations"], "tools": "[{bad json"}, "tools is not valid JSON"),
    ({"conversations": OK["conversations"], "tools": [1, 2]}, "tool 0 is a int"),
    ({"conversations": OK["conversations"], "tools": 7}, "tools must be a list"),
]
TURNS_CASES = [
    ({"question_id": 1, "turns": ["fine"]}, None),
    ({"question_id": 2, "turns": "not a list"}, "must be a list of user turns"),
    ({"question_id": 3, "turns": []}, "empty list of turns"),
    ({"question_id": 4, "turns": [{"content": 5}]},
     "turns[0].content: must be a string (the user turn's text), got a number (5)"),
    ({"question_id": 5}, "turns: missing field"),
]
PROMPT_CASES = [
    ({"prompt": "fine"}, None),
    ({"prompt": ["a", "b"]}, 'prompt: must be a string (the prompt text), got a list (["a", "b"])'),
    ({"other": "x"}, "prompt: missing field"),
    ("a bare string row among objects", "row is a str"),
]
BFCL_CASES = [
    ({"id": "ok", "question": [[{"role": "user", "content": "weather in Paris?"}]],
      "function": [{"name": "w.get", "parameters": {"type": "dict", "properties": {"c": {"type": "String"}}}}]}, None),
    ({"id": "a", "question": [{"role": "user", "content": "x"}]},
     "question[0]: must be a list of messages (one BFCL turn), got an object"),
    ({"id": "b", "question": [[{"role": "user", "content": "x"}]], "involved_classes": ["NoSuchAPI"]},
     "unknown BFCL class"),
    ({"id": "c", "question": []}, "non-empty list of turns"),
]


def _run(tmp_path, name, rows):
    path = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    cfg = SelectConfig(sources=[SourceConfig(name=name, path=str(path))], total=10)
    run = RunDir.at(tmp_path / f"run-{name}")
    manifest = run_select(cfg, run, seed=0, progress=False)
    rows = query(run.root, "SELECT source_row, filter, reason FROM rejected ORDER BY source_row")[1]
    return manifest, {r[0]: (r[1], r[2]) for r in rows}


@pytest.mark.parametrize("name,cases", [("conv", CONVERSATION_CASES), ("turns", TURNS_CASES),
                                        ("prompt", PROMPT_CASES), ("bfcl", BFCL_CASES)])
def test_malformed_rows_are_rejected_with_reasons(tmp_path, name, cases):
    rows = ([OK] if name == "conv" else []) + [c[0] for c in cases]
    expected = ([None] if name == "conv" else []) + [c[1] for c in cases]
    manifest, rejected = _run(tmp_path, name, rows)
    for i, want in enumerate(expected):
        if want is None:
            assert i not in rejected, (i, rejected.get(i))
        else:
            assert i in rejected, (i, want)
            filt, reason = rejected[i]
            assert filt == "parse" and want in reason, (i, want, reason)
    (acct,) = manifest["accounting"]["files"].values()
    assert acct["input_rows"] == len(rows) == acct["rejected"] + acct["selected"] + acct["not_selected"]


def test_at_least_fifteen_kinds(tmp_path):
    kinds = {c[1] for cases in (CONVERSATION_CASES, TURNS_CASES, PROMPT_CASES, BFCL_CASES) for c in cases if c[1]}
    assert len(kinds) >= 15


def test_unrecognized_shape_names_file_fields_and_mapping(tmp_path):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"dialog_text": "hi", "speaker_id": 3}])
    cfg = SelectConfig(sources=[SourceConfig(name="odd", path=str(path))], total=1)
    with pytest.raises(InputError) as err:
        run_select(cfg, RunDir.at(tmp_path / "run"), seed=0, progress=False)
    msg = str(err.value)
    assert str(path) in msg and "dialog_text" in msg and "speaker_id" in msg and "fields:" in msg
    # the mapping the message suggests works without code
    cfg = SelectConfig(sources=[SourceConfig(name="odd", path=str(path), fields={"prompt": "dialog_text"})], total=1)
    m = run_select(cfg, RunDir.at(tmp_path / "run2"), seed=0, progress=False)
    assert m["num_prompts"] == 1


def test_missing_source_path_is_an_input_error(tmp_path):
    cfg = SelectConfig(sources=[SourceConfig(name="gone", path=str(tmp_path / "nope.jsonl"))], total=1)
    with pytest.raises(InputError, match="does not exist"):
        run_select(cfg, RunDir.at(tmp_path / "run"), seed=0, progress=False)
