"""The render stage with a Hugging Face chat template: the embedded target's own template (regen.target.prepare_model)
on a tiny offline tokenizer, through both mask paths, with the mask property over every written row."""
from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from render_fixtures import generation_row, write_generations

from regen.config.render import RenderConfig
from regen.render.hf_template import HFTemplateRenderer
from regen.render.stage import run_render
from regen.rundir import RunDir
from regen.target.prepare_model import CHAT_TEMPLATE, MODELS

U1 = {"role": "user", "content": "What is the sum of two and three? Explain it briefly."}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}


def rows() -> list[dict]:
    a0 = {"role": "assistant", "content": "Two plus three is five, as you can count."}
    return [
        generation_row("h1", 0, [{"role": "system", "content": "Be brief."}, U1],
                       content="The sum of two and three is five, because counting on from two gives five."),
        generation_row("h2", 0, [U1], content=a0["content"]),
        generation_row("h2", 1, [U1, a0, {"role": "user", "content": "Times ten?"}],
                       content="Five times ten is fifty, which is the answer you asked for."),
        generation_row("h3", 0, [U1], tools=TOOLS, content="Let me call the tool for this one.", tool_calls=[CALL]),
        generation_row("h3", 1, [U1, {"role": "assistant", "content": "Let me call the tool for this one.",
                                      "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "c1", "content": "5"}],
                       tools=TOOLS, content="The tool says five. Bonjour is not needed here at all."),
    ]


def generated_text(row: dict, end_of_turn: str = "<end_of_turn>") -> str:
    """What the embedded template renders for the generated turn inside {% generation %} (prepare_model)."""
    text = row["content"] or ""
    for c in row["tool_calls"] or []:
        fn = c["function"]
        text += '<tool_call>\n{"name": "' + fn["name"] + '", "arguments": ' + fn["arguments"] + "}\n</tool_call>"
    return text + end_of_turn


@pytest.mark.parametrize("mask", ["markers", "prefix"])
def test_embedded_template_every_row_masks_exactly_the_generated_text(tmp_path, make_hf_dir, mask):
    tok_dir = make_hf_dir(CHAT_TEMPLATE, "embedded-template")
    write_generations(tmp_path, rows())
    run = RunDir.at(tmp_path)
    cfg = RenderConfig(renderer="hf", tokenizer=str(tok_dir), hf_mask=mask, max_tokens=2048)
    m = run_render(cfg, run, progress=False)
    r = HFTemplateRenderer(tok_dir, mask=mask)
    by_key = {(x["prompt_id"], x["turn"]): x for x in rows()}
    samples = [s for e in m["shards"] for s in pq.read_table(run.shards / e["path"]).to_pylist()]
    assert len(samples) == len(rows()) == m["num_rows"]
    for s in samples:
        (span,) = s["loss_spans"]
        assert r.decode(s["input_ids"][span["start"]:span["end"]]) == generated_text(by_key[(s["prompt_id"], s["turn"])])
        assert r.decode(s["input_ids"][:span["start"]]).endswith("<start_of_turn>model\n")
        assert r.decode(s["input_ids"][span["end"]:]) == "\n"
    assert m["contract"]["renderer"] == "hf" and m["contract"]["mask_policy"] == f"hf-{mask}"
    assert m["contract"]["tokenizer_name"] == "embedded-template"


def test_hf_server_ids_with_eos_and_trimmed_stop(tmp_path, make_hf_dir):
    tok_dir = make_hf_dir(CHAT_TEMPLATE, "embedded-template-srv")
    r = HFTemplateRenderer(tok_dir)
    eot = r.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    out = []
    for i, (suffix, name) in enumerate([([eot, r.tokenizer.eos_token_id], "eos"), ([], "trimmed"), ([eot], "exact")]):
        row = generation_row(f"s{i}", 0, [U1], content=f"Answer {name}: the sum is five, as expected.")
        msgs = [U1, {"role": "assistant", "content": row["content"]}]
        rendered = r.render(msgs)
        s, e = rendered.assistant_spans[-1]
        row["prompt_token_ids"] = rendered.input_ids[:s]
        row["completion_token_ids"] = r.encode(row["content"]) + suffix
        out.append(row)
    write_generations(tmp_path, out)
    run = RunDir.at(tmp_path)
    m = run_render(RenderConfig(renderer="hf", tokenizer=str(tok_dir), max_tokens=2048), run, progress=False)
    assert m["num_rows"] == 3 and m["drift"]["rows_checked"] == 3 and m["drift"]["rows_drifted"] == 0
    assert m["row_counts"]["closing_appended"] == 1
    for s in pq.read_table(run.shards / m["shards"][0]["path"]).to_pylist():
        (span,) = s["loss_spans"]
        content = next(x["content"] for x in out if x["prompt_id"] == s["prompt_id"])
        assert r.decode(s["input_ids"][span["start"]:span["end"]]) == content + "<end_of_turn>"


def test_kept_truncated_rows_do_not_supervise_closing_markers(tmp_path, make_hf_dir):
    tok_dir = make_hf_dir(CHAT_TEMPLATE, "embedded-template-trunc")
    row = generation_row("t1", 0, [U1], content="Counting on from two we get three, four and then", finish_reason="length")
    write_generations(tmp_path, [row])
    run = RunDir.at(tmp_path)
    filters = [f for f in RenderConfig().filters if f != "truncated"]
    m = run_render(RenderConfig(renderer="hf", tokenizer=str(tok_dir), max_tokens=2048, filters=filters), run,
                   progress=False)
    (s,) = pq.read_table(run.shards / m["shards"][0]["path"]).to_pylist()
    (span,) = s["loss_spans"]
    r = HFTemplateRenderer(tok_dir)
    assert r.decode(s["input_ids"][span["start"]:span["end"]]) == row["content"]
    assert r.decode(s["input_ids"][span["end"]:]) == "<end_of_turn>\n"
    assert m["row_counts"]["truncated_closing_unsupervised"] == 1


@pytest.mark.slow
def test_local_profile_renders_with_the_embedded_tokenizer(tmp_path, repo_root):
    """The local profile's render section on the embedded target's real tokenizer (after scripts/setup.sh)."""
    from regen.config import load_profile

    cfg = load_profile("local").render.model_copy(update={"min_loss_tokens": 1})  # short literal answers
    model_dir = repo_root / cfg.tokenizer
    if not (model_dir / "tokenizer.json").is_file():
        pytest.skip(f"{model_dir} not prepared: run `bash scripts/setup.sh`")
    write_generations(tmp_path, rows())
    run = RunDir.at(tmp_path)
    m = run_render(cfg, run, progress=False)
    r = HFTemplateRenderer(model_dir)
    spec = MODELS[model_dir.name]  # the profile's embedded target (regen.target.prepare_model)
    assert r.mask == "markers" and m["contract"]["tokenizer_name"] == spec.name
    by_key = {(x["prompt_id"], x["turn"]): x for x in rows()}
    samples = [s for e in m["shards"] for s in pq.read_table(run.shards / e["path"]).to_pylist()]
    assert len(samples) == len(rows())
    for s in samples:
        (span,) = s["loss_spans"]
        assert r.decode(s["input_ids"][span["start"]:span["end"]]) == generated_text(
            by_key[(s["prompt_id"], s["turn"])], spec.end_of_turn)
        tok = r.tokenizer
        first = tok.bos_token_id if "bos_token" in spec.chat_template else tok.convert_tokens_to_ids("<|im_start|>")
        assert s["input_ids"][0] == first and s["input_ids"][span["end"] - 1] == spec.end_of_turn_id


def test_template_that_drops_history_reasoning_renders_per_turn_rows(tmp_path, make_hf_dir):
    from render_fixtures import UNSTABLE_TEMPLATE

    tok_dir = make_hf_dir(UNSTABLE_TEMPLATE, "drops-history-reasoning")
    a0 = {"role": "assistant", "content": "Two plus three is five.", "reasoning_content": "EARLIER REASONING"}
    gen = [generation_row("u", 0, [U1], content=a0["content"], reasoning_content=a0["reasoning_content"]),
           generation_row("u", 1, [U1, a0, {"role": "user", "content": "Times ten?"}],
                          content="Fifty, which is five times ten.", reasoning_content="5*10")]
    write_generations(tmp_path, gen)
    run = RunDir.at(tmp_path)
    m = run_render(RenderConfig(renderer="hf", tokenizer=str(tok_dir), min_loss_tokens=1), run, progress=False)
    r = HFTemplateRenderer(tok_dir)
    samples = {s["turn"]: s for s in pq.read_table(run.shards / m["shards"][0]["path"]).to_pylist()}
    assert m["num_rows"] == 2 and not m["rejected"]
    for turn, row in enumerate(gen):
        (span,) = samples[turn]["loss_spans"]
        text = r.decode(samples[turn]["input_ids"][span["start"]:span["end"]])
        assert text == f"<think>{row['reasoning_content']}</think>{row['content']}<|im_end|>"
    assert "EARLIER REASONING" not in r.decode(samples[1]["input_ids"])  # history as the template renders it
