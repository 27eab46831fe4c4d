"""Runs made before the fix: an old run directory resumes (a rule its stamp predates is adopted and
recorded, not refused), and `regen generate --recheck` turns the ok rows the old checks let through into error
rows that `--retry-errors` re-sends. The old run is made by this generator with the issue-20 checks switched off
(what the code before the fix did), against the real test server."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from conftest import fast_config, write_prompts

from regen.cli import main as regen_cli
from regen.errors import InputError
from regen.generate import ledger
from regen.generate import runner as runner_mod
from regen.generate.checks import judge
from regen.generate.stage import recheck_run, run_generate

pytestmark = pytest.mark.timeout(120)
NEW_POLICIES = ("content_filter", "unfinished", "text_after_end", "over_max_tokens", "usage_inconsistent")
OLD_CLASSES = ("empty_body", "truncated", "empty_content", "invalid_tool_args", "unbalanced_think", "reasoning_leak")


def rows_of(run) -> dict:
    return {(r["prompt_id"], r["turn"]): r for p in ledger.part_paths(run.generations)
            for r in pq.read_table(p).to_pylist()}


def old_checks(monkeypatch):
    """The checks of the code before the row-kind checks: only "length" of finish_reason mattered (any other value, or none,
    was a finished answer), no end-of-turn markers, no usage checks."""
    import dataclasses

    def before(c, think, end, max_tokens):
        as_finished = dataclasses.replace(c, finish_reason="length" if c.finish_reason == "length" else "stop")
        return [(k, d) for k, d in judge(as_finished, think) if k in OLD_CLASSES]

    monkeypatch.setattr(runner_mod, "judge", before)
    monkeypatch.setattr(runner_mod, "strip_echoed_end", lambda c, markers: None)


def age_stamp(run) -> None:
    """request_config.json as written before the row-kind checks: no new policies, no end_of_turn_markers."""
    path = run.generations / "request_config.json"
    stamp = json.loads(path.read_text())
    for k in NEW_POLICIES:
        del stamp["acceptance"]["policies"][k]
    del stamp["acceptance"]["end_of_turn_markers"]
    path.write_text(json.dumps(stamp))


CONVS = [
    ([{"role": "user", "content": "a [[fault:abort]]"}], None),
    ([{"role": "user", "content": "b [[fault:after_end]]"}, {"role": "assistant", "content": "old"},
      {"role": "user", "content": "then this"}, {"role": "assistant", "content": "old"},
      {"role": "user", "content": "and this"}], None),
    ([{"role": "user", "content": "c [[fault:usage_reasoning]]"}], None),
    ([{"role": "user", "content": "d [[fault:echo_end]]"}], None),
    ([{"role": "user", "content": "plain question"}], None),
]


def make_old_run(server, run_dir, monkeypatch):
    records = write_prompts(run_dir, CONVS)
    with monkeypatch.context() as m:
        old_checks(m)
        manifest = run_generate(fast_config(), run_dir, endpoints=[server.base_url], progress=False)
    assert manifest["accounting"]["generated"] == 7  # every unit stored ok by the old checks
    age_stamp(run_dir)
    return [r.prompt_id for r in records]


def test_an_old_run_resumes_and_adopts_the_new_rules(server, run_dir, monkeypatch):
    make_old_run(server, run_dir, monkeypatch)
    cfg = fast_config(end_of_turn_markers=["<|im_end|>"])  # a rule the stamp predates, at a non-default value
    sent = len(server.server.log)
    again = run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False)  # complete: nothing to send
    assert again["complete"] and len(server.server.log) == sent
    manifest = run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False, retry_classes="")
    assert manifest["complete"] and sorted(manifest["adopted_rules"]) == sorted(
        [f"generate.policies.{k} = {fast_config().policy(k)}" for k in NEW_POLICIES]
        + ["generate.end_of_turn_markers = ['<|im_end|>']"])
    stamp = json.loads((run_dir.generations / "request_config.json").read_text())
    assert stamp["acceptance"]["policies"]["unfinished"] == "retry" and stamp["adopted"][0]["rules"]
    # once adopted, the rules are the run's: a change to one of them is refused as any policy change is
    with pytest.raises(InputError, match="generate.policies.over_max_tokens: retry -> drop"):
        run_generate(fast_config(end_of_turn_markers=["<|im_end|>"], policies={"over_max_tokens": "drop"}), run_dir,
                     endpoints=[server.base_url], progress=False)


def test_recheck_turns_what_the_old_checks_let_through_into_rows_retry_errors_resends(server, run_dir, monkeypatch,
                                                                                     capsys):
    pids = make_old_run(server, run_dir, monkeypatch)
    before = rows_of(run_dir)
    assert before[(pids[0], 0)]["status"] == "ok" and before[(pids[0], 0)]["content"]  # the partial answer, stored
    cfg = fast_config(end_of_turn_markers=["<|im_end|>"])
    profile = run_dir.root.parent / "profile.yaml"  # the user's profile: this generate config (JSON is YAML)
    profile.write_text(json.dumps({"name": "t", "generate": cfg.model_dump(mode="json")}))
    cli = ["generate", "--profile", str(profile), "--run", str(run_dir.root), "--endpoint", server.base_url,
           "--no-progress"]
    sent = len(server.server.log)
    assert regen_cli(cli + ["--recheck"]) == 0
    out = capsys.readouterr().out
    assert len(server.server.log) == sent  # a recheck alone sends nothing
    assert "recheck: 7 ok rows judged by the current checks; now error rows: text_after_end=1, unfinished=1 (and " \
           "2 later turns skipped after them" in out, out
    assert "generated 3 + error 2 + skipped 2 == 7" in out
    rep = json.loads((run_dir.generations / "manifest.json").read_text())["rechecks"][-1]
    assert rep["checked"] == 7 and rep["now_error"] == {"unfinished": 1, "text_after_end": 1}
    assert rep["later_turns_skipped"] == 2 and rep["would_flag"] == {"usage_inconsistent": 1, "end_marker_stripped": 1}
    assert len(rep["adopted_rules"]) == len(NEW_POLICIES) + 1
    after = rows_of(run_dir)
    abort = after[(pids[0], 0)]
    assert (abort["status"], abort["error_class"], abort["finish_reason"], abort["content"]) == \
        ("error", "unfinished", "abort", None)
    assert abort["error_detail"].startswith("transient: recheck (retry); finish_reason 'abort'")
    assert (after[(pids[1], 0)]["status"], after[(pids[1], 0)]["error_class"]) == ("error", "text_after_end")
    assert [after[(pids[1], t)]["status"] for t in (1, 2)] == ["skipped", "skipped"]
    assert after[(pids[1], 1)]["stop_reason"] == "previous_turn_error"
    assert all(after[(p, 0)]["status"] == "ok" for p in pids[2:])  # flagged or clean: left as they were
    superseded = [r for p in (run_dir.generations / "quarantine").glob("*.recheck.parquet")
                  for r in pq.read_table(p).to_pylist()]
    assert len(superseded) == 4 and all(r["status"] == "ok" for r in superseded)  # the old rows, kept for audit
    assert recheck_run(cfg, run_dir)["recheck"]["now_error"] == {}  # idempotent

    # the server stops running past its stop: a plain --retry-errors re-sends both classes (its default classes)
    server.server.settings.end_marker = "[x]"
    assert regen_cli(cli + ["--retry-errors"]) == 0
    out = capsys.readouterr().out
    assert "re-sent 2 error rows and 2 later turns; recovered 1/2; still error: unfinished=1" in out, out
    final = rows_of(run_dir)
    assert all(final[(pids[1], t)]["status"] == "ok" for t in range(3))
    assert final[(pids[0], 0)]["error_class"] == "unfinished"  # the marker forces abort on every attempt


def test_a_crash_inside_a_recheck_is_finished_by_the_next_session(server, run_dir, monkeypatch):
    pids = make_old_run(server, run_dir, monkeypatch)
    cfg = fast_config(end_of_turn_markers=["<|im_end|>"])
    calls = []
    real = ledger.supersede

    def crash_after_supersede(*a, **k):
        out = real(*a, **k)
        calls.append(out)
        raise KeyboardInterrupt("killed after the rows left the live set, before their replacements were listed")

    monkeypatch.setattr(ledger, "supersede", crash_after_supersede)
    with pytest.raises(KeyboardInterrupt):
        recheck_run(cfg, run_dir)
    monkeypatch.setattr(ledger, "supersede", real)
    assert (run_dir.generations / ledger.REPLACE_PENDING).exists()
    recovered = ledger.recover(run_dir.generations)  # what the next regen generate does first
    assert recovered["replace_finished"]["written"] == 4
    after = rows_of(run_dir)
    assert after[(pids[0], 0)]["error_class"] == "unfinished" and len(after) == 7
    assert not (run_dir.generations / ledger.REPLACE_PENDING).exists()
