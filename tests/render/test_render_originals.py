"""`regen render --responses original`: the prompts' own answers rendered into `shards-original/` with the same
template, assistant-only mask and response filters as the regenerated set."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from render_fixtures import generation_row, write_generations

from regen.cli import main as cli_main
from regen.config.render import RenderConfig
from regen.errors import InputError
from regen.render.hf_template import HFTemplateRenderer
from regen.render.originals import original_rows, write_original_generations
from regen.render.stage import run_render
from regen.report.query import query
from regen.rundir import RunDir
from regen.target.prepare_model import CHAT_TEMPLATE
from schemas.io import write_json_atomic, write_parquet_atomic
from schemas.prompt import PROMPT_SCHEMA, PromptRecord

SYS = {"role": "system", "content": "Be brief."}
U1 = {"role": "user", "content": "What is the sum of two and three? Explain it briefly."}
U2 = {"role": "user", "content": "Times ten?"}
A0 = {"role": "assistant", "content": "Two plus three is five, as anyone can count on their fingers."}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
CALLER = {"role": "assistant", "content": "Let me call the tool for this one.", "tool_calls": [CALL]}
RESULT = {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "5"}


def answer(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


# prompt id -> (messages, tools, original_answers)
PROMPTS = {
    "o1": ([SYS, U1], None, answer("The sum of two and three is five, because counting on from two gives five.")),
    "o2": ([U1, A0, U2], None, answer("Five times ten is fifty, which is the answer you asked for just now.")),
    "o3": ([U1, CALLER, RESULT], TOOLS, answer("The tool says five, so the sum of two and three is five indeed.")),
    "o4": ([U1], None, None),  # the source had no answer: counted, not rendered
    "o5": ([U1], None, answer("<think>counting</think>The answer is five, two plus three, as I thought it through.")),
    "o6": ([U1], None, answer("5")),  # below min_loss_tokens
}


def write_prompts(root, prompts=PROMPTS, schema=PROMPT_SCHEMA, version=2):
    rows = [PromptRecord(prompt_id=pid, messages=m, tools=t, category="general", language="en", source=f"src-{pid}",
                         source_file="f", source_row=i, original_answers=a).to_arrow_row()
            for i, (pid, (m, t, a)) in enumerate(prompts.items())]
    table = pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA)
    if "original_answers" not in schema.names:
        table = table.drop(["original_answers"])
    info = write_parquet_atomic(table, root / "prompts" / "part-00000.parquet", schema)
    write_json_atomic({"schema_version": version, "parts": [info]}, root / "prompts" / "manifest.json")


def regenerated_rows() -> list[dict]:
    return [generation_row("o1", 0, [SYS, U1], content="Five. Two plus three is five, a small sum to count up."),
            generation_row("o2", 0, [U1], content="Five is the sum: two plus three makes five in the end."),
            generation_row("o2", 1, [U1, {"role": "assistant", "content": "Five is the sum: two plus three makes five "
                                                                           "in the end."}, U2],
                           content="Fifty: five times ten is fifty, plainly and simply computed."),
            generation_row("o4", 0, [U1], content="It is five, since two and three together make five in all.")]


def samples(run: RunDir) -> list[dict]:
    m = run.manifest(run.shards)
    return [s for e in m["shards"] for s in pq.read_table(run.shards / e["path"]).to_pylist()]


@pytest.fixture()
def setup(tmp_path, make_hf_dir):
    tok_dir = make_hf_dir(CHAT_TEMPLATE, "embedded-template")
    write_prompts(tmp_path)
    write_generations(tmp_path, regenerated_rows())
    cfg = RenderConfig(renderer="hf", tokenizer=str(tok_dir), max_tokens=2048,
                       filters=["empty_answer", "reasoning_leak", "tool_args", "repetition", "over_long"])
    return RunDir.at(tmp_path), cfg, HFTemplateRenderer(tok_dir)


def test_original_rows_follow_the_turn_positions():
    rec = PromptRecord(prompt_id="o3", messages=PROMPTS["o3"][0], tools=TOOLS, category="general", language="en",
                       source="s", source_file="f", source_row=0, original_answers=PROMPTS["o3"][2]).to_arrow_row()
    rows = original_rows(rec)
    assert [r["turn"] for r in rows] == [0, 1]
    assert rows[0]["content"] == CALLER["content"] and rows[0]["tool_calls"][0]["function"]["name"] == "add"
    assert [m["role"] for m in rows[0]["messages"]] == ["user"]
    assert [m["role"] for m in rows[1]["messages"]] == ["user", "assistant", "tool"]
    assert rows[1]["content"] == PROMPTS["o3"][2][0]["content"] and rows[1]["finish_reason"] is None
    assert len({r["request_key"] for r in rows}) == 2
    rec["original_answers"] = None
    assert original_rows(rec) == []


def test_originals_render_with_the_same_template_mask_and_filters(setup):
    run, cfg, r = setup
    made = write_original_generations(run)
    assert made["num_prompts"] == 6 and made["num_prompts_with_original"] == 5
    assert made["prompts_without_original"] == {"src-o4": 1}
    assert made["num_rows"] == 7  # o1, o2 x2, o3 x2, o5, o6
    orig = run.with_responses("original")
    m = run_render(cfg, orig, progress=False)
    regen_m = run_render(cfg, run, progress=False)
    assert m["contract_hash"] == regen_m["contract_hash"]  # same tokenizer, template, mask policy, limits
    got = {(s["prompt_id"], s["turn"]): s for s in samples(orig)}
    assert set(got) == {("o1", 0), ("o2", 0), ("o2", 1), ("o3", 0), ("o3", 1)}
    expected = {("o1", 0): PROMPTS["o1"][2][0]["content"], ("o2", 0): A0["content"],
                ("o2", 1): PROMPTS["o2"][2][0]["content"], ("o3", 1): PROMPTS["o3"][2][0]["content"],
                ("o3", 0): CALLER["content"] + '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'}
    for key, s in got.items():
        (span,) = s["loss_spans"]  # assistant-only: one span, the answer and its end-of-turn marker
        assert r.decode(s["input_ids"][span["start"]:span["end"]]) == expected[key] + "<end_of_turn>", key
        assert r.decode(s["input_ids"][:span["start"]]).endswith("<start_of_turn>model\n")
    # the prompt tokens of a first turn are the regenerated set's, byte for byte
    regen = {(s["prompt_id"], s["turn"]): s for s in samples(run)}
    for key in (("o1", 0), ("o2", 0)):
        a, b = got[key], regen[key]
        assert a["input_ids"][:a["loss_spans"][0]["start"]] == b["input_ids"][:b["loss_spans"][0]["start"]]
    # the same response filters and row limits, rejects in their own folder
    filt = pq.read_table(orig.rejected("render") / "part-filter.parquet").to_pylist()
    assert [(x["prompt_id"], x["filter"]) for x in filt] == [("o5", "reasoning_leak")]
    row_rejects = [x for p in sorted(orig.rejected("render").glob("part-render-*.parquet"))
                   for x in pq.read_table(p).to_pylist()]
    assert [(x["prompt_id"], x["filter"]) for x in row_rejects] == [("o6", "min_loss_tokens")]
    assert orig.rejected("render").name == "render-original"
    assert not list(run.rejected("render").glob("part-render-*.parquet"))
    assert m["num_rows"] == 5 and regen_m["num_rows"] == 4 and orig.shards.name == "shards-original"


def test_views_tell_the_sets_apart(setup):
    run, cfg, _ = setup
    write_original_generations(run)
    run_render(cfg, run.with_responses("original"), progress=False)
    _, rows = query(run.root, "SELECT responses, count(*) FROM samples GROUP BY 1 ORDER BY 1")
    assert rows == [("original", 5)]  # the regenerated set is not rendered yet
    run_render(cfg, run, progress=False)
    _, rows = query(run.root, "SELECT responses, count(*), sum(num_loss_tokens) > 0 FROM samples GROUP BY 1 ORDER BY 1")
    assert rows == [("original", 5, True), ("regenerated", 4, True)]
    _, rows = query(run.root, "SELECT responses, sum(rows) FROM shards GROUP BY 1 ORDER BY 1")
    assert rows == [("original", 5), ("regenerated", 4)]
    # prompts present in both sets: the experiment's intersection
    _, rows = query(run.root, "SELECT count(DISTINCT prompt_id) FROM samples WHERE responses = 'original' AND prompt_id "
                              "IN (SELECT prompt_id FROM samples WHERE responses = 'regenerated')")
    assert rows == [(2,)]


def test_rewritten_only_when_the_prompts_change(setup):
    run, cfg, _ = setup
    first = write_original_generations(run)
    part = run.with_responses("original").generations / first["parts"][0]["path"]
    mtime = part.stat().st_mtime_ns
    assert write_original_generations(run) == first and part.stat().st_mtime_ns == mtime
    m1 = run_render(cfg, run.with_responses("original"), progress=False)
    assert run_render(cfg, run.with_responses("original"), progress=False) == m1
    write_prompts(run.root, {k: v for k, v in PROMPTS.items() if k != "o2"})
    again = write_original_generations(run)
    assert again["num_rows"] == 5 and again["prompts_fingerprint"] != first["prompts_fingerprint"]


def test_prompts_of_schema_v1_ask_for_a_new_selection(tmp_path):
    v1 = pa.schema([f for f in PROMPT_SCHEMA if f.name != "original_answers"])
    write_prompts(tmp_path, schema=v1, version=1)
    with pytest.raises(InputError, match=r"regen select --run .* again"):
        write_original_generations(RunDir.at(tmp_path))
    with pytest.raises(InputError, match="regen select"):
        write_original_generations(RunDir.at(tmp_path / "empty"))


def test_regen_render_responses_original_cli(tmp_path, make_hf_dir, capsys):
    tok_dir = make_hf_dir(CHAT_TEMPLATE, "embedded-template")
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump({"name": "t", "render": {"renderer": "hf", "tokenizer": str(tok_dir),
                                                               "filters": ["empty_answer", "reasoning_leak"]}}))
    run = tmp_path / "run"
    write_prompts(run)
    assert cli_main(["render", "--profile", str(profile), "--run", str(run), "--responses", "original",
                     "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "original answers: 5 of 6 prompts (7 turns)" in out
    assert json.loads((run / "shards-original" / "manifest.json").read_text())["complete"]
    assert not (run / "shards").exists()
    # no prompt with an original answer: a clear error, exit 2
    none_run = tmp_path / "none"
    write_prompts(none_run, {"o4": PROMPTS["o4"]})
    assert cli_main(["render", "--profile", str(profile), "--run", str(none_run), "--responses", "original",
                     "--no-progress"]) == 2
    assert "has the source's own answer" in capsys.readouterr().err
