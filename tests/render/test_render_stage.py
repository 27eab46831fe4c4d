"""The render stage end to end on literal generation rows: the mask property over every written row, bad rows
rejected with reasons, server ids, drift, turn modes, limits, determinism and resume."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from render_fixtures import generation_row, k3_generated_text, write_generations

from regen.config.render import RenderConfig
from regen.render.kimi_k3.renderer import KimiK3Renderer
from regen.render.stage import filter_responses, make_renderer, run_render
from regen.rundir import RunDir

K3 = {"thinking": True, "thinking_effort": "max"}
PARAMS = json.dumps({"temperature": 1.0, "thinking": True, "thinking_effort": "max"})
U1 = {"role": "user", "content": "What is the sum of two and three? Explain it briefly."}
U2 = {"role": "user", "content": "And what is that number times ten, please?"}
A0 = {"role": "assistant", "content": "Two plus three is five.", "reasoning_content": "2+3=5."}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "add numbers",
                                           "parameters": {"type": "object", "properties": {"b": {"type": "number"},
                                                                                           "a": {"type": "number"}}}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": "three"}'}}


def good_rows() -> list[dict]:
    return [
        generation_row("p-single", 0, [U1], content="The sum of two and three is five.",
                       reasoning_content="Two plus three equals five.", request_params=PARAMS),
        generation_row("p-multi", 0, [U1], content=A0["content"], reasoning_content=A0["reasoning_content"]),
        generation_row("p-multi", 1, [U1, A0, U2], content="Five times ten is fifty.",
                       reasoning_content="5*10 = 50.\n"),
        generation_row("p-tools", 0, [U1], tools=TOOLS, content="", reasoning_content="Use the tool.",
                       tool_calls=[CALL]),
        generation_row("p-tools", 1, [U1, {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
                                           "tool_calls": [CALL]},
                                      {"role": "tool", "tool_call_id": "c1", "content": "5"}],
                       tools=TOOLS, content="The tool says the sum is 5.", reasoning_content="Tool said 5."),
        generation_row("p-parts", 0, [{"role": "system", "content": "  Be terse.  "},
                                      {"role": "user", "name": 'A&B "x"',
                                       "content": [{"type": "text", "text": "<|sep|> is text here, "},
                                                   {"type": "text", "text": "not a control token."}]}],
                       content="Right: <|close|>message<|sep|> typed as text stays text.", reasoning_content="  "),
        generation_row("p-cjk", 0, [{"role": "user", "content": "漢字テスト, please answer in English anyway."}],
                       content="Kanji test: 漢字 means Chinese characters.", reasoning_content="OK."),
    ]


def bad_rows() -> list[dict]:
    """(rows, expected filter, expected reason substring) for rows that must not become samples."""
    return [
        (generation_row("b-order", 0, [U1, A0], content="Another answer right after an assistant.",
                        reasoning_content="x"), "parse", "role_order: messages[2]"),
        (generation_row("b-tool", 0, [U1, {"role": "tool", "tool_call_id": "zz", "content": "5"}],
                        content="An answer to a tool result nobody asked for.", reasoning_content="x"),
         "parse", "tool_result_without_call: messages[1]"),
        # issue #11 point 5: the Kimi-K3 renderer renders this as the reference does; validation rejects it
        (generation_row("b-tool-after-user", 0, [
            U1, {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"}, {"role": "user", "content": "And now?"},
            {"role": "tool", "tool_call_id": "zz", "name": "add", "content": "6"}], tools=TOOLS,
            content="An answer after a stray tool result.", reasoning_content="x"),
         "parse", "tool_result_without_call: messages[4]"),
        (generation_row("b-noreason", 0, [U1], content="An answer whose reasoning the server lost.",
                        reasoning_content=None), "parse", "no_reasoning: messages[1]"),
        (generation_row("b-args", 0, [U1, {"role": "assistant", "content": "", "reasoning_content": "r",
                                           "tool_calls": [{"id": "c9", "type": "function",
                                                           "function": {"name": "add", "arguments": "{a: 2"}}]},
                                      {"role": "tool", "tool_call_id": "c9", "content": "5"}],
                        tools=TOOLS, content="History had arguments that are not JSON.", reasoning_content="x"),
         "parse", "bad_arguments: messages[1]: tool_calls[0] (add) arguments are not JSON"),
        (generation_row("b-part", 0, [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"}, {"type": "image_url", "image_url": {"url": "x"}}]}],
            content="A picture of a cat sitting on the mat.", reasoning_content="x"),
         "parse", "unknown_content_part: messages[0]: content[1] has type 'image_url'"),
        (generation_row("b-trunc", 0, [U1], content="Two plus", reasoning_content="x", finish_reason="length"),
         "truncated", "finish_reason is 'length'"),
        (generation_row("b-empty", 0, [U1], content=" ", reasoning_content="I thought but said nothing."),
         "empty_answer", "content is empty"),
        (generation_row("b-leak", 0, [U1], content="<think>hmm</think>Five.", reasoning_content="x"),
         "reasoning_leak", "think markers"),
        (generation_row("b-toolargs", 0, [U1], tools=TOOLS, content="", reasoning_content="x",
                        tool_calls=[{"id": "c2", "type": "function", "function": {"name": "add", "arguments": "[2]"}}]),
         "tool_args", "arguments are JSON list, not an object"),
    ]


def read_samples(run: RunDir) -> list[dict]:
    m = run.manifest(run.shards)
    return [r for e in m["shards"] for r in pq.read_table(run.shards / e["path"]).to_pylist()]


def read_rejects(run: RunDir) -> list[dict]:
    return [r for p in sorted(run.rejected("render").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]


def k3_cfg(**kw) -> RenderConfig:
    base = dict(renderer="kimi-k3", template_kwargs=K3, require_reasoning=True, shard_max_rows=3)
    base.update(kw)
    return RenderConfig(**base)


def assert_mask_property(run: RunDir, rows: list[dict], renderer, expected_text) -> int:
    """Every written row: one span; its tokens decode to exactly what the target generated (+ closing markers)."""
    by_key = {(r["prompt_id"], r["turn"]): r for r in rows}
    samples = read_samples(run)
    for s in samples:
        assert len(s["loss_spans"]) == 1 and s["num_tokens"] == len(s["input_ids"])
        span = s["loss_spans"][0]
        ids = s["input_ids"]
        assert s["num_loss_tokens"] == span["end"] - span["start"] >= 14
        assert renderer.decode(ids[span["start"]:span["end"]]) == expected_text(by_key[(s["prompt_id"], s["turn"])])
    return len(samples)


def test_k3_every_row_masks_exactly_the_generated_text(tmp_path):
    rows = good_rows()
    write_generations(tmp_path, rows, parts=2)
    run = RunDir.at(tmp_path)
    m = run_render(k3_cfg(), run, progress=False)
    r = KimiK3Renderer()
    assert assert_mask_property(run, rows, r, k3_generated_text) == len(rows) == m["num_rows"]
    for s in read_samples(run):  # the prompt ends with the generation prompt; <|end_of_msg|> follows, unsupervised
        start, end = s["loss_spans"][0]["start"], s["loss_spans"][0]["end"]
        assert r.decode(s["input_ids"][:start]).endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
        assert s["input_ids"][end:] == [163586]
    assert m["complete"] and m["contract"]["renderer"] == "kimi-k3" and m["contract"]["test_vocabulary"]
    assert m["contract"]["tokenizer_hash"] == r.tokenizer_hash and m["contract"]["max_tokens"] == 32768
    assert m["num_shards"] == 3 and [e["rows"] for e in m["shards"]] == [3, 3, 1]
    # control strings typed by a user are text: only structural <|sep|> ids appear
    parts = next(s for s in read_samples(run) if s["prompt_id"] == "p-parts")
    assert r.decode(parts["input_ids"]).count("<|sep|>") > parts["input_ids"].count(163589)


def test_bad_rows_are_rejected_with_reasons_and_the_run_goes_on(tmp_path):
    bad = bad_rows()
    rows = good_rows() + [b[0] for b in bad]
    write_generations(tmp_path, rows)
    run = RunDir.at(tmp_path)
    m = run_render(k3_cfg(), run, progress=False)
    assert m["num_rows"] == len(good_rows())
    rejects = {r["prompt_id"]: r for r in read_rejects(run)}
    for row, filt, reason in bad:
        got = rejects[row["prompt_id"]]
        assert got["filter"] == filt and reason in got["reason"], got
        assert got["stage"] == "render" and got["source_file"] == "part-00000.parquet" and got["payload"]
    assert len(rejects) == len(bad)
    assert m["rejected"] == {"parse": 6} and m["filters"]["dropped"] == {
        "empty_answer": 1, "reasoning_leak": 1, "tool_args": 1, "truncated": 1}


def test_error_and_skipped_generations_are_not_rendered(tmp_path):
    rows = good_rows()[:2] + [generation_row("e", 0, [U1], status="error", content=None),
                              generation_row("s", 1, [U1], status="skipped", content=None)]
    write_generations(tmp_path, rows)
    m = run_render(k3_cfg(), RunDir.at(tmp_path), progress=False)
    assert m["num_rows"] == 2 and m["filters"]["error"] == 1 and m["filters"]["skipped"] == 1


def server_row(renderer, row: dict, *, trim_closing=False, prompt_prefix=(), eos=True) -> dict:
    """Attach server ids to `row` as a server would return them (completion + <|end_of_msg|>)."""
    msgs = [m for m in row["_messages"]] + [{"role": "assistant", "content": row["content"],
                                            "reasoning_content": row["reasoning_content"]}]
    out = renderer.render(msgs, None, **K3, add_generation_prompt=False)
    s, e = out.assistant_spans[-1]
    completion = out.input_ids[s:e - 3] if trim_closing else out.input_ids[s:e]
    row["prompt_token_ids"] = list(prompt_prefix) + out.input_ids[:s]
    row["completion_token_ids"] = completion + ([163586] if eos else [])
    return row


def test_server_ids_win_and_drift_is_counted(tmp_path):
    r = KimiK3Renderer()
    rows = []
    for i, kw in enumerate([{}, {"trim_closing": True}, {"eos": False}, {"prompt_prefix": [163584]}]):
        row = generation_row(f"srv{i}", 0, [U1], content=f"Answer number {i}: five.", reasoning_content="2+3=5.")
        row["_messages"] = [U1]
        rows.append(server_row(r, row, **kw))
    # a completion sampled with other token boundaries than the renderer would pick: kept verbatim
    odd = generation_row("srv-odd", 0, [U1], content="Five.", reasoning_content="Two plus three.")
    odd["_messages"] = [U1]
    server_row(r, odd)
    text_ids = r.encode("Five.")
    split = [t for ch in "Five." for t in r.encode(ch)]
    assert split != text_ids
    c = odd["completion_token_ids"]
    i = next(k for k in range(len(c)) if c[k:k + len(text_ids)] == text_ids)
    odd["completion_token_ids"] = c[:i] + split + c[i + len(text_ids):]
    rows.append(odd)
    for row in rows:
        row.pop("_messages")
    write_generations(tmp_path, rows)
    run = RunDir.at(tmp_path)
    m = run_render(k3_cfg(), run, progress=False)
    samples = {s["prompt_id"]: s for s in read_samples(run)}
    assert set(samples) == {"srv0", "srv1", "srv2", "srv-odd"}  # srv3 drifted (server BOS) and is dropped
    assert m["drift"]["rows_checked"] == 5 and m["drift"]["rows_drifted"] == 1
    assert m["drift"]["causes"] == {"server_bos": 1} and m["drift"]["rate"] == pytest.approx(0.2)
    assert m["row_counts"]["closing_appended"] == 1 and m["row_counts"]["completion_differs"] == 1
    by_id = {row["prompt_id"]: row for row in rows}
    for pid, s in samples.items():
        span = s["loss_spans"][0]
        masked = s["input_ids"][span["start"]:span["end"]]
        comp = [t for t in by_id[pid]["completion_token_ids"] if t != 163586]
        assert masked[:len(comp)] == comp  # verbatim
        assert r.decode(masked) == k3_generated_text(by_id[pid])
    odd_ids = samples["srv-odd"]["input_ids"]
    assert any(odd_ids[k:k + len(split)] == split for k in range(len(odd_ids)))  # the server's split, not ours
    drift = [x for x in read_rejects(run) if x["filter"] == "drift"]
    assert len(drift) == 1 and drift[0]["reason"].startswith("server_bos: rendered prompt ids differ")
    # keep policy: the row is written with the server's prompt ids
    run2 = RunDir.at(tmp_path / "keep")
    write_generations(run2.root, rows)
    m2 = run_render(k3_cfg(on_drift="keep"), run2, progress=False)
    kept = {s["prompt_id"]: s for s in read_samples(run2)}["srv3"]
    assert m2["num_rows"] == 5 and kept["input_ids"][0] == 163584 and kept["input_ids"][1:] != []


def test_conversation_mode_loss_on_last_turn_only(tmp_path):
    rows = good_rows()
    write_generations(tmp_path, rows)
    run = RunDir.at(tmp_path)
    m = run_render(k3_cfg(turn_mode="conversation"), run, progress=False)
    samples = read_samples(run)
    assert sorted((s["prompt_id"], s["turn"]) for s in samples) == [
        ("p-cjk", 0), ("p-multi", 1), ("p-parts", 0), ("p-single", 0), ("p-tools", 1)]
    assert assert_mask_property(run, rows, KimiK3Renderer(), k3_generated_text) == m["num_rows"] == 5


def test_overlong_drop_or_cut_and_min_loss_tokens(tmp_path):
    rows = good_rows()
    write_generations(tmp_path, rows)
    r = KimiK3Renderer()
    multi = rows[2]
    msgs = [U1, A0, U2, {"role": "assistant", "content": multi["content"], "reasoning_content": multi["reasoning_content"]}]
    full = len(r.render(msgs, None, **K3, add_generation_prompt=False).input_ids)
    first = len(r.render(msgs[:2], None, **K3, add_generation_prompt=False).input_ids)
    limit = (full + first) // 2
    run = RunDir.at(tmp_path / "drop")
    write_generations(run.root, rows)
    m = run_render(k3_cfg(turn_mode="conversation", max_tokens=limit), run, progress=False)
    assert "p-multi" not in {s["prompt_id"] for s in read_samples(run)}
    assert all(s["num_tokens"] <= limit for s in read_samples(run))
    assert m["rejected"].get("over_long", 0) >= 1
    run = RunDir.at(tmp_path / "cut")
    write_generations(run.root, rows)
    m = run_render(k3_cfg(turn_mode="conversation", max_tokens=limit, overlong="cut"), run, progress=False)
    cut = {s["prompt_id"]: s for s in read_samples(run)}["p-multi"]
    assert cut["turn"] == 0 and cut["num_tokens"] == first and m["row_counts"]["cut"] >= 1
    sp = cut["loss_spans"][0]
    assert r.decode(cut["input_ids"][sp["start"]:sp["end"]]) == k3_generated_text(rows[1])
    run = RunDir.at(tmp_path / "minloss")
    write_generations(run.root, rows)
    m = run_render(k3_cfg(min_loss_tokens=10_000), run, progress=False)
    assert m["num_rows"] == 0 and m["rejected"] == {"min_loss_tokens": len(rows)}
    assert all("supervised tokens (min 10000)" in x["reason"] for x in read_rejects(run))


@pytest.mark.parametrize("size", [{"shard_max_rows": 2}, {"shard_max_tokens": 300}])
def test_deterministic_and_resumable(tmp_path, monkeypatch, size):
    rows = good_rows()
    for d in ("a", "b", "c"):
        write_generations(tmp_path / d, rows, parts=2)
    ma = run_render(k3_cfg(**size), RunDir.at(tmp_path / "a"), progress=False)
    mb = run_render(k3_cfg(**size), RunDir.at(tmp_path / "b"), progress=False)
    assert [e["sha256"] for e in ma["shards"]] == [e["sha256"] for e in mb["shards"]]
    assert len(ma["shards"]) >= 3 and all(e["tokens"] <= size.get("shard_max_tokens", 10**9) or e["rows"] == 1
                                          for e in ma["shards"])
    # a re-run with the same input and config does nothing
    assert run_render(k3_cfg(**size), RunDir.at(tmp_path / "a"), progress=False)["shards"] == ma["shards"]
    # crash after 5 samples, then resume: same shards as an uninterrupted run
    from regen.render import rows as render_rows

    real = render_rows.RowRenderer.sample
    calls = {"n": 0}

    def crashing(self, row):
        calls["n"] += 1
        if calls["n"] > 5:
            raise KeyboardInterrupt
        return real(self, row)

    monkeypatch.setattr(render_rows.RowRenderer, "sample", crashing)
    run_c = RunDir.at(tmp_path / "c")
    with pytest.raises(KeyboardInterrupt):
        run_render(k3_cfg(**size), run_c, progress=False)
    partial = run_c.manifest(run_c.shards)
    assert partial["status"] == "running" and not partial["complete"] and len(partial["shards"]) >= 1
    cursor = partial["cursor"]
    consumed = (len(rows[0::2]) if cursor["file"] == 1 else 0) + cursor["row"]
    assert consumed == partial["num_rows"] <= 5
    resumed = {"n": 0}

    def counting(self, row):
        resumed["n"] += 1
        return real(self, row)

    monkeypatch.setattr(render_rows.RowRenderer, "sample", counting)
    mc = run_render(k3_cfg(**size), run_c, progress=False)
    assert resumed["n"] == len(rows) - consumed  # rows in listed shards are not rendered again
    assert [e["sha256"] for e in mc["shards"]] == [e["sha256"] for e in ma["shards"]]
    assert mc["complete"] and mc["counts"] == ma["counts"] and mc["row_counts"] == ma["row_counts"]


def test_resume_with_rejects_gives_the_same_outputs(tmp_path, monkeypatch):
    rows = good_rows() + [b[0] for b in bad_rows()]
    for d in ("a", "c"):
        write_generations(tmp_path / d, rows, parts=3)
    cfg = k3_cfg(shard_max_rows=2)
    ma = run_render(cfg, RunDir.at(tmp_path / "a"), progress=False)
    from regen.render import rows as render_rows

    real = render_rows.RowRenderer.sample
    calls = {"n": 0}

    def crashing(self, row):
        calls["n"] += 1
        if calls["n"] > 7:
            raise KeyboardInterrupt
        return real(self, row)

    monkeypatch.setattr(render_rows.RowRenderer, "sample", crashing)
    run_c = RunDir.at(tmp_path / "c")
    with pytest.raises(KeyboardInterrupt):
        run_render(cfg, run_c, progress=False)
    monkeypatch.setattr(render_rows.RowRenderer, "sample", real)
    mc = run_render(cfg, run_c, progress=False)
    for key in ("counts", "rejected", "row_counts", "drift", "num_rows", "num_tokens"):
        assert mc[key] == ma[key], key
    assert [e["sha256"] for e in mc["shards"]] == [e["sha256"] for e in ma["shards"]]
    key = lambda r: (r["prompt_id"], r["filter"], r["reason"])  # noqa: E731
    assert sorted(map(key, read_rejects(run_c))) == sorted(map(key, read_rejects(RunDir.at(tmp_path / "a"))))


def test_filters_alone_and_scores_are_columns(tmp_path):
    write_generations(tmp_path, good_rows() + [b[0] for b in bad_rows()])
    run = RunDir.at(tmp_path)
    summary = filter_responses(k3_cfg(), run, progress=False)
    assert summary["counts"]["kept"] == len(good_rows()) + 6  # the 6 parse rejects pass the response filters
    table = pq.read_table(run.shards / "responses.parquet")
    assert {"score_truncated", "score_repetition", "score_language", "keep", "reason"} <= set(table.column_names)


def test_make_renderer_errors_name_the_fix():
    from regen.errors import InputError

    with pytest.raises(InputError, match="render.tokenizer"):
        make_renderer(RenderConfig(renderer="hf"))
    with pytest.raises(InputError, match="environment variable"):
        make_renderer(RenderConfig(renderer="kimi-k3", tokenizer="${REGEN_SURELY_UNSET_VAR}"))


def test_over_long_filter_uses_the_server_ids_lengths(tmp_path):
    row = generation_row("long", 0, [U1], content="A long answer that the server counted.", reasoning_content="r",
                         prompt_token_ids=[5] * 30, completion_token_ids=[6] * 40, num_prompt_tokens=1,
                         num_completion_tokens=1)
    write_generations(tmp_path, [row] + good_rows()[:1])
    run = RunDir.at(tmp_path)
    m = run_render(k3_cfg(max_tokens=64), run, progress=False)
    (rej,) = [r for r in read_rejects(run) if r["prompt_id"] == "long"]
    assert rej["filter"] == "over_long" and rej["reason"] == "prompt + completion is 70 tokens by the server's count (max 64)"
    assert m["filters"]["dropped"] == {"over_long": 1}


FINISHED = {"complete": True, "accounting": {"balanced": True, "missing": 0, "duplicates": 0, "stray": 0}}


def test_generation_parts_come_from_the_generate_manifest(tmp_path):
    from schemas.io import write_json_atomic

    write_generations(tmp_path, good_rows()[:2], parts=2)
    run = RunDir.at(tmp_path)
    write_json_atomic({"stage": "generate", "parts": [{"path": "part-00001.parquet"}], **FINISHED},
                      run.generations / "manifest.json")
    m = run_render(k3_cfg(), run, progress=False)
    assert m["input"]["files"] == ["part-00001.parquet"] and m["num_rows"] == 1
    write_json_atomic({"stage": "generate", "parts": [{"path": "part-00009.parquet"}], **FINISHED},
                      run.generations / "manifest.json")
    from regen.errors import InputError

    with pytest.raises(InputError, match="part-00009.parquet"):
        run_render(k3_cfg(), run, progress=False)


# -- issue #11 point 11: render of an unfinished generate stage ----------------------------------------------

UNFINISHED = [
    ("no manifest", None, None, "manifest.json is missing"),
    ("unbalanced: stray rows", {"stage": "generate", "complete": False, "accounting": {
        "balanced": False, "missing": 0, "duplicates": 0, "stray": 3}}, None, "accounting is not balanced (stray 3)"),
    ("unbalanced: missing rows", {"stage": "generate", "complete": False, "accounting": {
        "balanced": False, "missing": 5, "duplicates": 2, "stray": 0}}, None, "missing 5, duplicates 2"),
    ("balanced but not complete", {"stage": "generate", "complete": False, "accounting": {"balanced": True}}, None,
     "complete is False"),
    ("no accounting", {"stage": "generate", "complete": True}, None, "no accounting recorded"),
    ("journal left by a killed session", {"stage": "generate", **FINISHED}, '{"prompt_id": "x"}\n',
     "journal-w0.jsonl"),
]


def unfinished_run(tmp_path, manifest, journal) -> RunDir:
    write_generations(tmp_path, good_rows()[:3], finished=False)
    run = RunDir.at(tmp_path)
    if manifest is not None:
        from schemas.io import write_json_atomic

        write_json_atomic(manifest, run.generations / "manifest.json")
    if journal is not None:
        (run.generations / "journal-w0.jsonl").write_text(journal)
    return run


@pytest.mark.parametrize("case,manifest,journal,match", UNFINISHED, ids=[u[0] for u in UNFINISHED])
def test_unfinished_generation_is_refused_with_what_is_missing(tmp_path, case, manifest, journal, match):
    from regen.errors import InputError

    run = unfinished_run(tmp_path, manifest, journal)
    with pytest.raises(InputError) as err:
        run_render(k3_cfg(), run, progress=False)
    assert match in str(err.value) and "regen generate --run" in str(err.value) and "--allow-incomplete" in str(err.value)
    assert not (run.shards / "manifest.json").exists() and not list(run.shards.glob("shard-*.parquet"))


@pytest.mark.parametrize("case,manifest,journal,match", UNFINISHED, ids=[u[0] for u in UNFINISHED])
def test_allow_incomplete_renders_what_is_there_and_records_it(tmp_path, case, manifest, journal, match):
    run = unfinished_run(tmp_path, manifest, journal)
    m = run_render(k3_cfg(), run, progress=False, allow_incomplete=True)
    assert m["num_rows"] == 3
    g = m["generations"]
    assert g["complete"] is False and g["allowed_incomplete"] is True and any(match in p for p in g["problems"])
    assert run.manifest(run.shards)["generations"] == g


def test_a_finished_generation_renders_and_a_finished_rerun_replaces_an_incomplete_render(tmp_path):
    run = unfinished_run(tmp_path, None, None)
    first = run_render(k3_cfg(), run, progress=False, allow_incomplete=True)
    assert first["generations"]["complete"] is False
    write_generations(tmp_path, good_rows()[:3])  # generate finished: same parts, now with its manifest
    m = run_render(k3_cfg(), run, progress=False)
    assert m["generations"] == {"complete": True, "allowed_incomplete": False, "problems": []}
    assert m["num_rows"] == 3


def test_cli_refuses_then_renders_with_allow_incomplete(tmp_path, capsys):
    from regen.cli import main as cli

    run = unfinished_run(tmp_path, {"stage": "generate", "complete": False, "accounting": {
        "balanced": False, "missing": 0, "duplicates": 0, "stray": 3}}, None)
    args = ["render", "--profile", "kimi-k3", "--run", str(run.root), "--no-progress",
            "--set", "render.require_reasoning=false", "--set", "render.tokenizer=null"]
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert "unfinished" in err and "stray 3" in err and "--allow-incomplete" in err and "Traceback" not in err
    assert cli(args + ["--filters-only"]) == 2
    capsys.readouterr()
    assert cli(args + ["--allow-incomplete"]) == 0
    assert "UNFINISHED" in capsys.readouterr().err
    assert run.manifest(run.shards)["generations"]["allowed_incomplete"] is True
