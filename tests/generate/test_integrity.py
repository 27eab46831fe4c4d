"""Damaged generations parts: checksums checked when parts are read, a clear error naming the
file, and `--repair` that re-requests exactly the lost rows (and the later turns that depended on them), against
the real test server whose request log is the witness. Plus the crash windows of a part rewrite."""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import conversations, fast_config, write_prompts

from regen.errors import InputError
from regen.generate import ledger
from regen.generate.stage import accounting, prompt_files, run_generate
from regen.render.stage import generation_files
from regen.report.query import query
from schemas.generation import GENERATION_SCHEMA

pytestmark = pytest.mark.timeout(180)


def live_rows(run) -> dict:
    out = {}
    for name in ledger.listed_parts(run.generations):
        for r in pq.read_table(run.generations / name).to_pylist():
            key = (r["prompt_id"], r["turn"])
            assert key not in out, f"duplicate row {key}"
            out[key] = (r["request_key"], r["status"], r["content"], str(r["messages"]))
    return out


def truncate_half(p):
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def flip_bytes(p):  # in the column data, far from the footer: Parquet still opens the file
    data = bytearray(p.read_bytes())
    for i in range(20, 40):
        data[i] ^= 0xFF
    p.write_bytes(bytes(data))
    pq.read_metadata(p)


def rewrite_one_answer(p):  # a valid Parquet file with the same rows, one answer changed: only sha256 tells
    t = pq.read_table(p).to_pylist()
    t[0]["content"] = (t[0]["content"] or "") + " edited"
    pq.write_table(pa.Table.from_pylist(t, schema=GENERATION_SCHEMA), p)
    assert pq.read_table(p).num_rows == len(t)


def delete(p):
    p.unlink()


@pytest.mark.parametrize("damage", [truncate_half, flip_bytes, rewrite_one_answer, delete])
@pytest.mark.parametrize("which", [0, -1])
def test_damaged_part_is_named_and_repair_rerequests_exactly_its_rows(server, run_dir, damage, which):
    write_prompts(run_dir, conversations(24))
    cfg = fast_config(part_rows=7, max_in_flight=4)
    first = run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False)
    assert first["complete"]
    expected = live_rows(run_dir)
    parts = sorted(ledger.listed_parts(run_dir.generations))
    assert len(parts) >= 3
    victim = run_dir.generations / parts[which]
    lost = {(r["prompt_id"], r["turn"]): r["request_key"] for r in pq.read_table(victim).to_pylist()}
    # later turns of the conversations that lost a turn: their history holds the lost answer
    dependent = {k: v[0] for k, v in expected.items()
                 if any(k[0] == pid and k[1] > t for pid, t in lost)}
    damage(victim)

    for attempt in (lambda: run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False),
                    lambda: query(run_dir.root, "SELECT count(*) FROM generations"),
                    lambda: generation_files(run_dir)):  # what render reads first
        with pytest.raises(InputError) as err:
            attempt()
        assert victim.name in str(err.value) and "--repair" in str(err.value)
    assert ledger.verify_parts(run_dir.generations)[0].path == victim

    server.server.log.clear()
    fixed = run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False, repair=True)
    assert fixed["complete"] and fixed["accounting"]["balanced"], fixed["accounting"]
    assert fixed["recovered"]["repair"]["parts_quarantined"] == [victim.name]
    assert fixed["recovered"]["repair"]["rows_lost"] == len(lost)
    sent = [e["key"] for e in server.server.log]
    assert len(sent) == len(set(sent)), "a lost row was requested twice"
    assert set(sent) == set(lost.values()) | set(dependent.values())
    assert live_rows(run_dir) == expected  # nothing lost, nothing duplicated (the server answers deterministically)
    assert ledger.verify_parts(run_dir.generations) == []
    assert not victim.exists()
    if damage is not delete:
        assert (run_dir.generations / "quarantine" / f"{victim.name}.damaged").exists()
    cols, rows = query(run_dir.root, "SELECT count(*), count(DISTINCT (prompt_id, turn)) FROM generations")
    assert rows[0][0] == rows[0][1] == len(expected)
    # the manifest (what render reads) lists exactly the live parts, each present
    listed = {e["path"] for e in fixed["parts"]}
    assert listed == set(ledger.listed_parts(run_dir.generations))
    assert all((run_dir.generations / p).exists() for p in listed)
    assert sorted(f.name for f in generation_files(run_dir)) == sorted(listed)  # render reads the repaired run
    # a later plain run sends nothing
    server.server.log.clear()
    run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False)
    assert not server.server.log


def test_a_deleted_part_with_no_repair_stops_before_any_request(server, run_dir):
    write_prompts(run_dir, conversations(8))
    cfg = fast_config(part_rows=5)
    run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False)
    name = sorted(ledger.listed_parts(run_dir.generations))[1]
    os.remove(run_dir.generations / name)
    (run_dir.generations / "manifest.json").unlink()  # not the finished-run shortcut: the recover path
    server.server.log.clear()
    with pytest.raises(InputError, match=f"{name}: listed in the ledger but missing"):
        run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False)
    assert not server.server.log


def _rows(pid: str, n: int, start: int = 0) -> list[dict]:
    return [{"request_key": f"{pid}-{t}", "prompt_id": pid, "turn": t, "status": "ok", "flags": []}
            for t in range(start, start + n)]


def _part(directory, writer: str, rows: list[dict]) -> dict:
    return ledger._write_part(directory, writer, ledger.rows_to_table(rows))


def test_supersede_moves_rows_to_quarantine_and_keeps_the_audit_trail(tmp_path):
    _part(tmp_path, "w0", _rows("a", 3))
    _part(tmp_path, "w0", _rows("b", 2))
    out = ledger.supersede(tmp_path, {"a-1", "a-2", "b-0", "b-1"}, "retry_errors")
    assert out == {"rows": 4, "parts": 2}
    keys = sorted(ledger.read_index(tmp_path).column("request_key").to_pylist())
    assert keys == ["a-0"]
    lines = ledger.ledger_lines(tmp_path)
    assert [bool(e.get("replaces")) for e in lines] == [False, False, True, False]
    assert lines[3]["removed"] == "retry_errors" and lines[3]["path"] == "part-w0-00001.parquet"
    quarantined = sorted(r["request_key"] for q in (tmp_path / "quarantine").glob("*.parquet")
                         for r in pq.read_table(q).to_pylist())
    assert quarantined == ["a-1", "a-2", "b-0", "b-1"]
    assert ledger.verify_parts(tmp_path) == [] and ledger.recover(tmp_path)["parts_adopted"] == 0
    assert [p.name for p in ledger.part_paths(tmp_path)] == ["part-w0-00002.parquet"]


def test_recover_finishes_a_rewrite_cut_at_each_step(tmp_path):
    # cut after the new part N was renamed, before its ledger line: N duplicates rows still live in P -> dropped
    _part(tmp_path, "w0", _rows("a", 3))
    from schemas.io import write_parquet_atomic

    write_parquet_atomic(ledger.rows_to_table(_rows("a", 2)), tmp_path / "part-w0-00001.parquet", GENERATION_SCHEMA)
    write_parquet_atomic(ledger.rows_to_table(_rows("a", 1, 2)), tmp_path / "quarantine" / "x.retry_errors.parquet",
                         GENERATION_SCHEMA)
    report = ledger.recover(tmp_path)
    assert report["parts_adopted"] == 0
    assert sorted(ledger.read_index(tmp_path).column("request_key").to_pylist()) == ["a-0", "a-1", "a-2"]
    assert not list((tmp_path / "quarantine").glob("*.parquet"))  # an unreferenced quarantine copy is dropped
    assert (tmp_path / "quarantine" / "part-w0-00001.parquet.duplicate").exists()
    # cut after the ledger line, before P was deleted: P is stale, its rows are in N and quarantine
    ledger.supersede(tmp_path, {"a-2"}, "retry_errors")
    old = tmp_path / "part-w0-00000.parquet"
    write_parquet_atomic(ledger.rows_to_table(_rows("a", 3)), old, GENERATION_SCHEMA)  # as if never deleted
    ledger.recover(tmp_path)
    assert not old.exists()
    assert sorted(ledger.read_index(tmp_path).column("request_key").to_pylist()) == ["a-0", "a-1"]


def test_accounting_counts_only_live_rows(server, run_dir):
    write_prompts(run_dir, conversations(6))
    run_generate(fast_config(), run_dir, endpoints=[server.base_url], progress=False)
    acc = accounting(run_dir.generations, prompt_files(run_dir))
    assert acc["balanced"] and acc["rows"] == acc["units"]
