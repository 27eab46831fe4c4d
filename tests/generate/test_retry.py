"""`regen generate --retry-errors` and the response policies in the resume identity,
against the real test server with injected faults."""
from __future__ import annotations

import collections

import pytest
from conftest import conversations, fast_config, write_prompts
from test_faults import control, rows_of

from regen.errors import InputError
from regen.generate import ledger
from regen.generate.checks import TRANSIENT
from regen.generate.stage import parse_retry_classes, run_generate
from regen.report.query import query

pytestmark = pytest.mark.timeout(240)
FAULTS = {"500": 0.12, "503": 0.08, "close": 0.05, "malformed": 0.05, "stall": 0.04}


def faulty_prompts(run_dir):
    convs = conversations(48)
    convs += [([{"role": "user", "content": f"bad {i} [[fault:400]]"}], None) for i in range(3)]
    convs += [([{"role": "user", "content": f"long {i} [[fault:overflow_vllm]]"}], None) for i in range(2)]
    return write_prompts(run_dir, convs)


def error_counts(run_dir) -> collections.Counter:
    return collections.Counter(r["error_class"] for r in rows_of(run_dir) if r["status"] == "error")


def test_retry_errors_recovers_every_transient_error_exactly_once(server, run_dir):
    faulty_prompts(run_dir)
    cfg = fast_config(retry={"max_attempts": 1}, timeouts={"first_byte": 0.5, "between_chunks": 0.3}, part_rows=9)
    control(server, faults=FAULTS, seed=7)
    first = run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False)
    assert first["accounting"]["balanced"]
    before = rows_of(run_dir)
    errors = error_counts(run_dir)
    transient = {k: v for k, v in errors.items() if k in TRANSIENT}
    assert len(transient) >= 3 and errors["bad_request"] == 3 and errors["context_overflow"] == 2, errors
    retried = {r["prompt_id"] for r in before if r["status"] == "error" and r["error_class"] in TRANSIENT}
    ok_keys = {r["request_key"] for r in before if r["status"] == "ok"}
    superseded = [r for r in before if r["prompt_id"] in retried and
                  r["turn"] >= min(x["turn"] for x in before if x["prompt_id"] == r["prompt_id"] and x["status"] == "error")]

    control(server, faults={})
    server.server.log.clear()
    after = run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False, retry_classes="")
    acc = after["accounting"]
    assert acc["balanced"] and acc["duplicates"] == 0 and acc["units"] == first["accounting"]["units"], acc
    assert error_counts(run_dir) == {"bad_request": 3, "context_overflow": 2}  # never retried unless named
    report = after["last_retry"]
    assert report["error_rows_resent"] == report["recovered"] == sum(transient.values())
    assert report["units_resent"] == len(superseded) and report["still_error"] == {}
    assert after["retries"] == [report] and not (run_dir.generations / "retry.json").exists()
    # the server saw only the superseded units, each once, and nothing that had been received before
    sent = [e["key"] for e in server.server.log]
    assert len(sent) == len(set(sent)) and not (set(sent) & ok_keys)
    by_key = {r["request_key"]: r["prompt_id"] for r in rows_of(run_dir)}
    assert {by_key[k] for k in sent} == retried
    # views: one row per unit; the superseded rows stay auditable
    _, rows = query(run_dir.root, "SELECT count(*), count(DISTINCT (prompt_id, turn)) FROM generations")
    assert rows[0][0] == rows[0][1] == acc["units"]
    _, rows = query(run_dir.root, "SELECT status, error_class, count(*) FROM superseded GROUP BY ALL")
    assert sum(n for _, _, n in rows) == len(superseded)
    assert {(s, c) for s, c, _ in rows} <= {("error", c) for c in TRANSIENT} | {("skipped", None)}
    audit = [e for e in ledger.ledger_lines(run_dir.generations) if e.get("reason") == "retry_errors"]
    assert audit and sum(e["quarantine"]["rows"] for e in audit) == len(superseded)

    # a retry with nothing left to retry sends nothing
    server.server.log.clear()
    again = run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False, retry_classes=None)
    assert not server.server.log and again["accounting"]["balanced"]


def test_permanent_classes_only_when_named_and_the_cli_reports(server, run_dir, capsys):
    from regen.cli import main

    faulty_prompts(run_dir)
    args = ["generate", "--profile", "local", "--run", str(run_dir.root), "--endpoint", server.base_url,
            "--no-progress", "--set", "generate.model=fake", "--set", "generate.retry.max_attempts=1",
            "--set", "generate.retry.base_s=0.01", "--set", "generate.max_in_flight=16"]
    control(server, faults={"500": 0.2}, seed=3)
    assert main(args) == 0
    n500 = error_counts(run_dir)["server_error"]
    assert n500 > 0
    control(server, faults={})
    capsys.readouterr()
    assert main(args + ["--retry-errors", "--classes", "bad_request,context_overflow"]) == 0
    out = capsys.readouterr().out
    assert "re-sent 5 error rows" in out and "recovered 0/5" in out, out
    assert "still error: bad_request=3, context_overflow=2" in out
    assert error_counts(run_dir)["server_error"] == n500  # not named: untouched
    assert main(args + ["--retry-errors"]) == 0
    out = capsys.readouterr().out
    assert f"recovered {n500}/{n500}" in out and error_counts(run_dir)["server_error"] == 0, out
    assert main(args + ["--classes", "timeout"]) == 2  # --classes alone is a user error
    assert "--classes needs --retry-errors" in capsys.readouterr().err


def test_unknown_retry_class_names_the_allowed_ones():
    # the defaults: the transient classes, then the server faults a new sample fixes (unfinished, ...)
    assert parse_retry_classes(None) == parse_retry_classes("") == TRANSIENT + ("unfinished", "text_after_end",
                                                                               "over_max_tokens")
    assert parse_retry_classes("timeout, truncated") == ("timeout", "truncated")
    with pytest.raises(InputError, match="unknown error class.*'auth'.*allowed: rate_limited"):
        parse_retry_classes("server_error,auth")


@pytest.mark.parametrize("change,named", [
    ({"policies": {"truncated": "keep_flagged"}}, "generate.policies.truncated: retry_larger -> keep_flagged"),
    ({"policies": {"empty_content": "drop"}}, "generate.policies.empty_content: retry -> drop"),
    ({"policies": {"reasoning_leak": "drop", "malformed": "drop"}}, "generate.policies.malformed: retry -> drop"),
    ({"think_markers": ["<thinking>", "</thinking>"]}, "generate.think_markers"),
])
def test_a_changed_response_policy_is_refused_on_resume(server, run_dir, change, named):
    write_prompts(run_dir, conversations(4))
    run_generate(fast_config(), run_dir, endpoints=[server.base_url], progress=False)
    sent = len(server.server.log)
    with pytest.raises(InputError) as err:
        run_generate(fast_config(**change), run_dir, endpoints=[server.base_url], progress=False)
    msg = str(err.value)
    assert named in msg and "new --run directory" in msg
    if "policies" in change:
        assert "--set generate.policies." in msg
    assert len(server.server.log) == sent
    # naming the default explicitly is no change
    run_generate(fast_config(policies={"truncated": "retry_larger"}), run_dir, endpoints=[server.base_url],
                 progress=False)
    assert len(server.server.log) == sent


def test_the_flow_path_prepare_then_a_plain_run_reports_the_retry(server, run_dir):
    """flows/regen_flow.py calls stage.prepare(retry_classes=...) and then the usual generate step."""
    from regen.generate.stage import prepare

    write_prompts(run_dir, conversations(12))
    cfg = fast_config(retry={"max_attempts": 1})
    control(server, faults={"503": 0.3}, seed=5)
    run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False)
    n = error_counts(run_dir)["server_error"]
    assert n > 0
    control(server, faults={})
    done = prepare(cfg, run_dir, retry_classes=[])
    assert done["retry"]["error_rows"] == n and (run_dir.generations / "retry.json").exists()
    manifest = run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False)
    assert manifest["last_retry"]["recovered"] == n and manifest["accounting"]["balanced"]
    assert not error_counts(run_dir)
