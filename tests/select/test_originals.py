"""Selection keeps each source row's own answer beside the prompt (`original_answers`).

Golden values are the bundled files' own fields; every kind of source that ships answers is covered, and the
rows that have none say why.
"""
from __future__ import annotations

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from select_helpers import drafts_of

from regen.select.originals import original_answers, source_answer
from regen.select.shapes import normalize_row
from schemas.prompt import PROMPT_SCHEMA, PromptRecord, inserted_positions, original_answers_of, turn_positions


def _rows(path):
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def _first(drafts, row=0):
    return next(d for d in drafts if d.source_row == row)


@pytest.mark.parametrize("rel, field", [
    ("gsm8k/train.sample3000.jsonl", "answer"),
    ("math/test.sample2000.jsonl", "solution"),
    ("mbpp/mbpp.jsonl", "code"),
    ("gpteacher/codegen-instruct.sample1000.json", "response"),
    ("gpteacher/roleplay-simple-deduped-roleplay-instruct.json", "response"),
    ("belle_eval/eval_set.jsonl", "std_answer"),
])
def test_answer_fields_of_benchmark_and_instruction_rows(repo_root, rel, field):
    path = repo_root / "data/prompts" / rel
    raw = _rows(path)
    drafts = drafts_of(path)
    checked = 0
    for row in (0, 1, 7):
        d, r = _first(drafts, row), raw[row]
        if not r[field].strip():
            continue
        assert d.original_answers == [{"role": "assistant", "content": r[field]}], (rel, row)
        assert d.original_missing is None
        assert d.messages[-1]["role"] == "user" and r[field] not in d.messages[-1]["content"]
        checked += 1
    assert checked >= 2


def test_humaneval_answer_is_the_prompt_completed_by_its_canonical_solution(repo_root):
    path = repo_root / "data/prompts/humaneval/HumanEval.jsonl"
    raw = _rows(path)
    for row in (0, 5):
        d = _first(drafts_of(path), row)
        (answer,) = d.original_answers
        assert answer["content"] == raw[row]["prompt"] + raw[row]["canonical_solution"]
        assert d.messages == [{"role": "user", "content": raw[row]["prompt"]}]
    assert _first(drafts_of(path)).original_answers[0]["content"].startswith("from typing import List\n")


def test_conversations_keep_their_trailing_gpt_turn(repo_root):
    for rel in ("fastchat_dummy_conversation/dummy_conversation.json", "llamafactory_toolcall/glaive_toolcall_en_demo.json",
                "llamafactory_toolcall/glaive_toolcall_zh_demo.json"):
        path = repo_root / "data/prompts" / rel
        raw = _rows(path)
        drafts = drafts_of(path)
        for row in (0, 3):
            d = _first(drafts, row)
            last = raw[row]["conversations"][-1]
            assert last["from"] == "gpt"
            assert d.original_answers == [{"role": "assistant", "content": last["value"]}], (rel, row)
            # the recorded assistant turns before it stay in messages (originals already)
            gpt_turns = sum(t["from"] in ("gpt", "function_call") for t in raw[row]["conversations"][:-1])
            assert sum(m["role"] == "assistant" for m in d.messages) == gpt_turns
            assert inserted_positions(d.messages) == [len(d.messages)]
    assert _first(drafts_of(repo_root / "data/prompts/fastchat_dummy_conversation")).original_answers[0]["content"] \
        == _rows(repo_root / "data/prompts/fastchat_dummy_conversation/dummy_conversation.json")[0]["conversations"][-1]["value"]


def test_kimi_mtp_rows_keep_their_gpt_answer(repo_root):
    ds = datasets.load_from_disk(str(repo_root / "data/prompts/kimi_mtp_sample"))
    drafts = [d for d in drafts_of(repo_root / "data/prompts/kimi_mtp_sample") if not d.error]
    assert len(drafts) > 200
    with_tools = 0
    for d in drafts:
        last = ds[d.source_row]["conversations"][-1]
        assert last["from"] == "gpt"
        if not last["value"].strip():
            assert d.original_answers is None and d.original_missing == "empty_answer"
            continue
        assert d.original_answers[0]["content"] == last["value"], d.source_row
        with_tools += bool(d.tools)
    assert with_tools > 0
    assert drafts[0].original_answers[0]["content"].startswith("Natalia sold 48/2 = <<48/2=24>>24 clips in May.")


@pytest.mark.parametrize("rel, reason", [
    ("fastchat_mt_bench/question.jsonl", "no_answer_field"),  # MT-Bench `turns`: no answers
    ("bfcl_v4/BFCL_v4_simple_python.json", "no_answer_field"),
    ("m_ifeval/en_input_data.jsonl", "no_answer_field"),
    ("gaokao_bench/Objective_Questions/2010-2022_Math_I_MCQs.json", "answer_not_text"),  # answer: ["D"]
])
def test_sources_without_an_answer_say_why(repo_root, rel, reason):
    drafts = [d for d in drafts_of(repo_root / "data/prompts" / rel) if not d.error]
    assert drafts and all(d.original_answers is None for d in drafts)
    assert {d.original_missing for d in drafts} == {reason}


def test_belle_rows_with_an_empty_std_answer_have_none(repo_root):
    path = repo_root / "data/prompts/belle_eval/eval_set.jsonl"
    raw = _rows(path)
    empty = [i for i, r in enumerate(raw) if not r["std_answer"].strip()]
    drafts = {d.source_row: d for d in drafts_of(path)}
    assert empty
    for i in empty[:5]:
        assert drafts[i].original_answers is None and drafts[i].original_missing == "empty_answer"


# -------------------------------------------------------------------------- shapes and positions, own variants


def _norm(row, shape, fmap):
    messages, _, labels = normalize_row(row, shape, fmap)
    return messages, labels["original_answers"], labels["original_missing"]


def test_conversation_ending_with_a_user_turn_has_no_answer():
    row = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
                             {"from": "human", "value": "c"}]}
    messages, answers, why = _norm(row, "conversations", {"conversations": "conversations"})
    assert answers is None and why == "no_answer" and len(messages) == 3


def test_two_user_turns_in_a_row_leave_a_turn_unanswered():
    row = {"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"},
                             {"from": "gpt", "value": "c"}]}
    messages, answers, why = _norm(row, "conversations", {"conversations": "conversations"})
    assert turn_positions(messages) == [1, 2]
    assert answers is None and why == "unanswered_turns"


def test_openai_messages_with_a_final_tool_call_and_reasoning():
    row = {"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "need a tool",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]}],
        "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]}
    messages, answers, why = _norm(row, "messages", {"messages": "messages"})
    assert messages == [{"role": "user", "content": "weather?"}] and why is None
    (a,) = answers
    assert a["reasoning_content"] == "need a tool" and a["tool_calls"][0]["function"]["name"] == "w"


def test_think_markers_of_a_gpt_answer_become_reasoning():
    row = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "<think>r</think>ans"}]}
    _, answers, _ = _norm(row, "conversations", {"conversations": "conversations"})
    assert answers == [{"role": "assistant", "content": "ans", "reasoning_content": "r"}]


def test_answer_column_from_the_profile_and_alpaca_output():
    row = {"q": "2+2?", "gold": "4", "answer": "not this one"}
    _, answers, _ = _norm(row, "prompt", {"prompt": "q", "answer": "gold"})
    assert answers == [{"role": "assistant", "content": "4"}]
    _, answers, _ = _norm({"instruction": "say hi", "input": "", "output": "hi"}, "instruction", {})
    assert answers == [{"role": "assistant", "content": "hi"}]
    # the prompt field is never its own answer: an `input` prompt with an `output` answer
    assert source_answer({"input": "x", "output": "y"}, "prompt", {"prompt": "input"}) == (
        [{"role": "assistant", "content": "y"}], None)


def test_several_trailing_answers_and_blank_answers_are_refused():
    msgs = [{"role": "user", "content": "q"}]
    two = [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert original_answers(msgs, two) == (None, "several_answers")
    assert original_answers(msgs, [{"role": "assistant", "content": "  \n"}]) == (None, "empty_answer")
    assert original_answers(msgs, ([], "no_answer_field")) == (None, "no_answer_field")


def test_prompt_schema_v2_round_trip_and_v1_files_still_read(tmp_path):
    rec = PromptRecord(prompt_id="p", messages=[{"role": "user", "content": "q"}], tools=None, category="general",
                       language="en", source="s", source_file="f", source_row=0,
                       original_answers=[{"role": "assistant", "content": "a", "reasoning_content": "r"}])
    none = PromptRecord(prompt_id="n", messages=[{"role": "user", "content": "q"}], tools=None, category="general",
                        language="en", source="s", source_file="f", source_row=1)
    table = pa.Table.from_pylist([rec.to_arrow_row(), none.to_arrow_row()], schema=PROMPT_SCHEMA)
    pq.write_table(table, tmp_path / "v2.parquet")
    rows = pq.read_table(tmp_path / "v2.parquet").to_pylist()
    assert original_answers_of(rows[0]) == [{"role": "assistant", "content": "a", "reasoning_content": "r"}]
    assert original_answers_of(rows[1]) is None
    pq.write_table(table.drop(["original_answers"]), tmp_path / "v1.parquet")
    assert all(original_answers_of(r) is None for r in pq.read_table(tmp_path / "v1.parquet").to_pylist())
    assert PROMPT_SCHEMA.metadata[b"schema_version"] == b"3"  # v3: length_band, mode


def test_turn_positions_has_one_definition():
    from regen.generate.conversation import turn_positions as generate_positions

    assert generate_positions is turn_positions


def test_selection_counts_prompts_with_and_without_originals(repo_root, tmp_path):
    from regen.config import load_profile
    from regen.rundir import RunDir
    from regen.select.stage import run_select

    profile = load_profile("local", {"select.total": 120})
    run = RunDir.at(tmp_path / "run")
    m = run_select(profile.select, run, seed=0, progress=False)
    o = m["originals"]
    assert o["num_with"] + o["num_without"] == m["num_prompts"] == 120
    assert o["num_with"] > 0 and o["num_without"] > 0
    assert sum(v["with"] + v["without"] for v in o["by_source"].values()) == 120
    table = pq.read_table(run.prompts / m["parts"][0]["path"]).to_pylist()
    with_col = [r for r in table if r["original_answers"] is not None]
    assert sum(1 for r in table if r["original_answers"] is not None) == o["num_with"] or len(m["parts"]) > 1
    for source in ("mt_bench", "arena_hard", "bfcl"):
        assert o["by_source"].get(source, {"with": 0})["with"] == 0
    for r in with_col:
        assert inserted_positions([{"role": x["role"]} for x in r["messages"]]) == [len(r["messages"])]
