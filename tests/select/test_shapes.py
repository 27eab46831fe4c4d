"""Row shapes -> OpenAI messages + tools, on literal rows and the bundled files (incl. the kimi-mtp fixture)."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
from select_helpers import drafts_of

from regen.config.select import SourceConfig
from regen.select.shapes import detect_shape, normalize_row, openai_tools
from regen.select.sources import source_files


def test_sharegpt_function_call_and_observation(repo_root):
    drafts = drafts_of(repo_root / "data/prompts/llamafactory_toolcall/glaive_toolcall_en_demo.json")
    d = next(d for d in drafts if any(m.get("tool_calls") for m in d.messages or []))
    call_msg = next(m for m in d.messages if m.get("tool_calls"))
    call = call_msg["tool_calls"][0]
    tool_msg = d.messages[d.messages.index(call_msg) + 1]
    assert tool_msg["role"] == "tool" and tool_msg["tool_call_id"] == call["id"]
    assert json.loads(call["function"]["arguments"]) is not None
    assert d.tools and d.tools[0]["type"] == "function" and "name" in d.tools[0]["function"]
    assert d.messages[-1]["role"] != "assistant"
    assert d.category == "tool_use"


def test_kimi_mtp_fixture_markers_parts_and_labels(repo_root):
    drafts = drafts_of(repo_root / "data/prompts/kimi_mtp_sample",
                     category_map={"math": "reasoning", "tool_agent": "tool_use", "zh_chat": "chinese"})
    assert len(drafts) == 228 and not [d.error for d in drafts if d.error]
    tool = [d for d in drafts if d.tools]
    assert tool
    calls = [c for d in tool for m in d.messages for c in m.get("tool_calls") or []]
    assert calls and all(c["id"].startswith("functions.") and ":" in c["id"] for c in calls)
    assert all("<|tool_call" not in (m.get("content") or "") for d in tool for m in d.messages)
    tool_msgs = [m for d in tool for m in d.messages if m["role"] == "tool"]
    assert tool_msgs and all(m["tool_call_id"].startswith("functions.") for m in tool_msgs)
    images = [d for d in drafts if any(isinstance(m.get("content"), list) for m in d.messages)]
    assert len(images) == 15
    assert {d.category for d in drafts if d.extra == {} and d.raw["source"] == "math"} == {"reasoning"}
    assert {d.category for d in drafts if d.raw["source"] == "zh_chat"} == {"chinese"}


def test_turns_bfcl_dialect_and_class_tools(repo_root):
    mt = drafts_of(repo_root / "data/prompts/fastchat_mt_bench/question.jsonl")
    assert all([m["role"] for m in d.messages] == ["user", "user"] for d in mt)
    simple = drafts_of(repo_root / "data/prompts/bfcl_v4/BFCL_v4_simple_python.json")
    params = simple[0].tools[0]["function"]["parameters"]
    assert params["type"] == "object"
    props = [p for d in simple for t in d.tools for p in t["function"]["parameters"]["properties"].values()]
    assert all(p.get("type") != "dict" for p in props)
    assert all("." not in t["function"]["name"] for d in simple for t in d.tools)
    multi = [d for d in drafts_of(repo_root / "data/prompts/bfcl_v4") if d.source_file.endswith("multi_turn_base.json")]
    assert multi and all(d.tools and len([m for m in d.messages if m["role"] == "user"]) >= 2 for d in multi)
    excluded = json.loads(open(repo_root / "data/prompts/bfcl_v4/BFCL_v4_multi_turn_base.json").readline())["excluded_function"]
    assert not {t["function"]["name"] for t in multi[0].tools} & set(excluded)


def test_bfcl_types_rewritten_recursively():
    tools = openai_tools([{"name": "a.b", "parameters": {"type": "dict", "properties": {
        "x": {"type": "tuple", "items": {"type": "float"}}, "type": {"type": "any"}}}}], "function", bfcl=True)
    fn = tools[0]["function"]
    assert fn["name"] == "a_b"
    assert fn["parameters"]["properties"]["x"] == {"type": "array", "items": {"type": "number"}}
    assert fn["parameters"]["properties"]["type"] == {}


def test_formats_tsv_json_wrapper_parquet_and_hub_snapshot(repo_root, tmp_path):
    mgsm = drafts_of(repo_root / "data/prompts/mgsm/mgsm_ja.tsv")
    assert len(mgsm) == 80 and {d.language for d in mgsm} == {"ja"} and {d.category for d in mgsm} == {"multilingual"}
    gaokao = drafts_of(repo_root / "data/prompts/gaokao_bench")
    assert len(gaokao) == 40 and {d.language for d in gaokao} == {"zh"}
    # a Hub snapshot: nested parquet + json lines + README and dotfolders to skip
    snap = tmp_path / "snap"
    (snap / "data").mkdir(parents=True)
    (snap / ".cache").mkdir()
    (snap / "README.md").write_text("# card")
    (snap / ".cache" / "x.json").write_text("[]")
    pq.write_table(pa.table({"instruction": ["Sort a list in Python", "Say hi"], "input": ["[3,1]", ""],
                             "output": ["x", "y"]}), snap / "data" / "train-00000.parquet")
    row = {"messages": [{"role": "user", "content": "Hallo, wie geht es dir heute?"}]}
    (snap / "data" / "extra.jsonl").write_text(json.dumps(row) + "\n")
    files = source_files(SourceConfig(name="s", path=str(snap)))
    assert [k for _, k in files] == ["jsonl", "parquet"]
    drafts = drafts_of(snap)
    assert drafts[0].language == "de" and drafts[0].category == "multilingual"
    assert drafts[1].messages[0]["content"] == "Sort a list in Python\n\n[3,1]" and drafts[1].category == "coding"
    assert drafts[2].messages[0]["content"] == "Say hi"


def test_detect_shapes_and_field_mapping():
    assert detect_shape("text", {})[0] == "string"
    assert detect_shape({"conversations": []}, {})[0] == "conversations"
    assert detect_shape({"question": [[]], "function": []}, {})[0] == "bfcl"
    assert detect_shape({"question": "q", "answer": "a"}, {}) == ("prompt", {"prompt": "question"})
    assert detect_shape({"problem_statement": "p", "patch": "x"}, {})[1]["prompt"] == "problem_statement"
    assert detect_shape({"name": "f", "description": "d", "parameters": {}}, {})[0] == "tool_doc"
    assert detect_shape({"dialog": [], "x": 1}, {})[0] is None
    shape, fmap = detect_shape({"dialog": []}, {"conversations": "dialog", "role": "speaker", "content": "text"})
    msgs, _, _ = normalize_row({"dialog": [{"speaker": "user", "text": "hi"}, {"speaker": "assistant", "text": "yo"}],
                                "sys": "be brief"}, shape, {**fmap, "system": "sys"})
    assert msgs == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_openai_messages_with_typed_parts():
    row = {"messages": [
        {"role": "system", "content": [{"type": "text", "value": "sys"}]},
        {"role": "user", "content": [{"type": "text", "value": "weather?"}]},
        {"role": "assistant", "content": [{"type": "reasoning", "value": "think"},
                                          {"type": "tool_call", "value": json.dumps({"name": "w", "arguments": {"c": 1}})}]},
        {"role": "tool", "content": [{"type": "text", "value": "sunny"}]},
        {"role": "assistant", "content": [{"type": "text", "value": "It is sunny."}]}],
        "tools": json.dumps([{"type": "function",
                              "function": {"name": "w", "parameters": {"type": "object", "properties": {}}}}])}
    msgs, tools, _ = normalize_row(row, "messages", {"messages": "messages"})
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assert msgs[2]["reasoning_content"] == "think" and msgs[2]["tool_calls"][0]["function"]["name"] == "w"
    assert msgs[3]["tool_call_id"] == msgs[2]["tool_calls"][0]["id"]
    assert tools[0]["function"]["name"] == "w"


def test_dataset_dict_splits_are_source_files(tmp_path):
    import datasets

    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"conversations": [{"from": "human", "value": f"Tell me a fact about {x}."}],
                                              "source": "chat"} for x in ("owls", "rivers", "tea")]),
        "test": datasets.Dataset.from_list([{"conversations": [{"from": "human", "value": "Name three prime numbers."}],
                                             "source": "math"}]),
    })
    dd.save_to_disk(str(tmp_path / "dd"))
    drafts = drafts_of(tmp_path / "dd", category_map={"chat": "general", "math": "reasoning"})
    files = sorted({d.source_file for d in drafts})
    assert files == [f"{tmp_path / 'dd'}#test", f"{tmp_path / 'dd'}#train"]
    assert [d.category for d in drafts if d.source_file.endswith("#test")] == ["reasoning"]


def test_every_user_turn_of_the_bundled_prompts_gets_its_own_answer(repo_root):
    """Multi-turn rows of every bundled shape (MT-Bench `turns` in three languages, BFCL multi-turn, ShareGPT with
    several human turns, kimi-mtp): the generate stage answers each user turn."""
    from regen.generate.conversation import turn_positions

    num_multi = 0
    for name in ("fastchat_mt_bench", "mt_bench_zh", "mt_bench_multilingual", "bfcl_v4", "fastchat_dummy_conversation",
                 "llamafactory_toolcall", "kimi_mtp_sample"):
        for d in drafts_of(repo_root / "data/prompts" / name):
            if d.error:
                continue
            users = [i for i, m in enumerate(d.messages) if m["role"] == "user"]
            pos = turn_positions(d.messages)
            num_multi += len(users) > 1
            # one generated turn after each user message: at the next recorded assistant or inserted right after it
            for i in users:
                nxt = next((j for j in range(i + 1, len(d.messages)) if d.messages[j]["role"] != "tool"), len(d.messages))
                assert (i + 1) in pos or nxt in pos, (name, d.source_row, [m["role"] for m in d.messages], pos)
            assert len(pos) >= len(users)
    assert num_multi > 50
