"""The run summary and the report's tables: stage counts as readable rows (no Python dicts), the finish-reason mix."""
from __future__ import annotations

from regen.pipeline import print_summary
from regen.report import summary
from regen.report.html import render_report
from regen.rundir import RunDir
from schemas.generation import GENERATION_SCHEMA
from schemas.io import write_json_atomic, write_rows_atomic

# (status, finish_reason, completion tokens): 7 stop, 2 length, 1 error row (not an answer)
ROWS = [("ok", "stop", 10)] * 7 + [("ok", "length", 64)] * 2 + [("error", None, None)]


def make_run(root, rows=ROWS, failures={"empty_content": 18, "timeout": 2}):
    gens = [{"request_key": f"k{i}", "prompt_id": f"p{i}", "turn": i % 2, "status": s, "finish_reason": f,
             "num_completion_tokens": n, "category": "general", "language": "en", "model": "m",
             "error_class": None if s == "ok" else "empty_content"} for i, (s, f, n) in enumerate(rows)]
    write_rows_atomic(gens, root / "generations" / "part-w0-00000.parquet", GENERATION_SCHEMA)
    write_json_atomic({"accounting": {"generated": 9, "error": 1, "skipped": 0, "units": 10, "balanced": True},
                       "metrics": {"attempts": 12, "output_tokens": 198, "output_tok_per_s": 12.345678,
                                   "failures_by_class": failures, "error_rows_by_class": {}}},
                      root / "generations" / "manifest.json")
    return root


def test_stage_table_has_one_row_per_count_and_per_dict_key():
    counts = {"select": {"rows": 48, "shortfall": None},
              "generate": {"generated": 9, "output_tok_per_s": 12.345678, "failures_by_class": {"empty_content": 18},
                           "error_rows_by_class": {}}}
    cols, rows = summary.stage_table(counts)
    assert cols == ["stage", "measure", "value"]
    assert rows == [("select", "rows", 48), ("generate", "generated", 9), ("generate", "output_tok_per_s", "12.35"),
                    ("generate", "failures_by_class: empty_content", 18)]
    assert summary.stage_table({}) == (["stage", "measure", "value"], [])


def test_stage_table_flattens_nested_counts_no_dict_printed():
    """The filter stage's counts hold a dict inside a dict (`counts: {dropped: {...}}`): one row per leaf."""
    counts = {"filter": {"counts": {"rows": 148, "kept": 113, "dropped": {"language": 4, "repetition": 29}},
                         "by_filter": {}}}
    _, rows = summary.stage_table(counts)
    assert rows == [("filter", "counts: rows", 148), ("filter", "counts: kept", 113),
                    ("filter", "counts: dropped: language", 4), ("filter", "counts: dropped: repetition", 29)]
    assert not any(isinstance(v, (dict, list)) or "{" in str(v) for _, _, v in rows)


def test_finish_mix_counts_answers_only(tmp_path):
    con = summary.connect(make_run(tmp_path))
    cols, rows = summary.finish_table(con)
    assert cols[:3] == ["finish_reason", "answers", "pct"]
    assert [(r[0], r[1], r[2]) for r in rows] == [("stop", 7, 77.8), ("length", 2, 22.2)]
    assert rows[1][3] == 128 and rows[0][4] == 10.0  # output tokens, mean tokens
    assert summary.finish_line(con) == "finish_reason of 9 answers: stop 77.8% (7), length 22.2% (2)"


def test_finish_mix_other_mixes(tmp_path):
    only_length = make_run(tmp_path / "a", rows=[("ok", "length", 5)] * 3)
    assert summary.finish_line(summary.connect(only_length)) == "finish_reason of 3 answers: length 100.0% (3)"
    unknown = make_run(tmp_path / "b", rows=[("ok", None, 5), ("ok", "tool_calls", 7), ("ok", "tool_calls", 3)])
    assert summary.finish_line(summary.connect(unknown)) == (
        "finish_reason of 3 answers: tool_calls 66.7% (2), (none) 33.3% (1)")
    (tmp_path / "empty").mkdir()
    con = summary.connect(tmp_path / "empty")
    assert summary.finish_table(con) == ([], []) and summary.finish_line(con) == ""


def test_report_and_run_summary_print_tables_not_dicts(tmp_path, capsys):
    run = make_run(tmp_path)
    text = render_report(run)
    assert "failures_by_class: empty_content</td><td>18</td>" in text
    assert "failures_by_class: timeout</td><td>2</td>" in text
    assert "{" not in text.split("<h2>Stages</h2>")[1].split("<h2>Plots</h2>")[0]
    assert "<h2>Finish reasons</h2><table><tr><th>finish_reason</th>" in text
    print_summary(RunDir.at(tmp_path))
    out = capsys.readouterr().out
    assert "finish_reason of 9 answers: stop 77.8% (7), length 22.2% (2)" in out
    assert "failures_by_class: empty_content" in out and "{'empty_content'" not in out


def test_an_unexplained_lossless_difference_is_a_warning_in_the_run_summary(tmp_path):
    """engine-eval.json's lossless check (regen.serve.engines.spec_eval.lossless) on a run: a difference beyond a
    near-tie reaches the run's stage counts (the summary `regen run` prints and the report's table) as a warning."""
    import json

    from regen.report.summary import stage_counts, stage_table
    from regen.serve.engines.spec_eval import lossless

    ref = [{"prompt_id": "p", "tokens": [5, 6, 7], "top": [[(5, -0.1), (8, -2.0)], [(6, -0.1), (4, -2.5)], []]}]
    ll = lossless(ref, [{"prompt_id": "p", "tokens": [5, 0], "stop_type": "eos"}])
    res = {"engine": "llama.cpp", "by_gguf_type": {"q8_0": {"engine": {"acc_len": 2.0}, "speed": {}, "lossless": ll}}}
    (tmp_path / "engine-eval.json").write_text(json.dumps(res))
    serve = stage_counts(tmp_path)["serve (llama.cpp q8_0)"]
    assert serve["answers_differing_unexplained"] == 1 and "p at token 1: stop_not_chosen" in serve["warning"]
    assert any(m == "warning" and "stop_not_chosen" in str(v) for _, m, v in stage_table({"s": serve})[1])
