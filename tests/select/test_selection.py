"""Selection: mix planning, shortfall policy, caps, determinism by seed, planted duplicates, resume."""
from __future__ import annotations

import json
import random

import pyarrow as pa
import pytest
from select_helpers import perturb

from regen.config import load_profile
from regen.config.select import SelectConfig, SourceConfig
from regen.report.query import query
from regen.rundir import RunDir
from regen.select.stage import largest_remainder, plan_mix, run_select, select_rows
from schemas.prompt import CATEGORIES

SHARES = {"general": 0.25, "reasoning": 0.2, "coding": 0.2, "tool_use": 0.15, "chinese": 0.1, "multilingual": 0.1}


def test_largest_remainder_sums_exactly():
    out = largest_remainder(7, {"a": 1, "b": 1, "c": 1})
    assert sum(out.values()) == 7 and sorted(out.values()) == [2, 2, 3]


def test_plan_mix_redistributes_shortfall_by_share():
    supply = {"general": 1000, "reasoning": 1000, "coding": 1000, "tool_use": 10, "chinese": 1000, "multilingual": 1000}
    plan = plan_mix(SHARES, supply, 1000)
    assert plan["target"]["tool_use"] == 150 and plan["alloc"]["tool_use"] == 10
    assert plan["shortfall"] == {"tool_use": 140}
    assert sum(plan["alloc"].values()) == 1000
    # the 140 go to the others in proportion to their shares (0.25 : 0.2 : 0.2 : 0.1 : 0.1)
    assert plan["alloc"]["general"] == 250 + 41 and plan["alloc"]["chinese"] == 100 + 17
    report = plan_mix(SHARES, supply, 1000, "report_only")
    assert sum(report["alloc"].values()) == 860
    tiny = plan_mix(SHARES, {c: 5 for c in CATEGORIES}, 1000)
    assert sum(tiny["alloc"].values()) == 30


def _pool(n=3000, seed=0):
    rng = random.Random(seed)
    rows = {"prompt_id": [f"{i:032x}" for i in range(n)],
            "category": [rng.choice(CATEGORIES) for _ in range(n)],
            "language": [rng.choice(["en", "de", "fr"]) for _ in range(n)],
            "source": [rng.choice(["a", "b", "c"]) for _ in range(n)]}
    return pa.table(rows)


def test_select_rows_seeded_stratified_and_capped():
    pool = _pool()
    cfg = SelectConfig(total=600, mix=SHARES)
    a, rep = select_rows(pool, cfg, seed=0)
    b, _ = select_rows(pool, cfg, seed=0)
    c, rep_c = select_rows(pool, cfg, seed=1)
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()
    for cat in CATEGORIES:
        assert rep["mix"][cat]["selected"] == rep_c["mix"][cat]["selected"] == round(600 * SHARES[cat])
    capped = SelectConfig(total=600, mix=SHARES, max_per_source={"a": 50}, max_per_language={"fr": 100})
    idx, rep = select_rows(pool, capped, seed=0)
    sel = pool.take(pa.array(idx))
    assert sel.column("source").to_pylist().count("a") <= 50
    assert sel.column("language").to_pylist().count("fr") <= 100
    assert len(idx) == 600 and rep["capped"]


@pytest.mark.integration
def test_local_profile_deterministic_by_seed(tmp_path):
    profile = load_profile("local")
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        run = RunDir.at(tmp_path / name)
        m = run_select(profile.select, run, seed=seed, progress=False)
        ids = [r[0] for r in query(run.root, "SELECT prompt_id FROM prompts")[1]]
        runs[name] = (m, ids)
    (ma, a), (_, b), (mc, c) = runs["a"], runs["b"], runs["c"]
    assert a == b and len(a) == profile.select.total == len(set(a))
    assert set(a) != set(c)
    assert ma["counts"]["category"] == mc["counts"]["category"]
    assert set(ma["counts"]["category"]) == set(CATEGORIES)
    for cat in CATEGORIES:
        assert abs(ma["mix"][cat]["share_selected"] - ma["mix"][cat]["share_requested"]) <= 0.01
    # image prompts never reach the text-only embedded target
    assert ma["filters"]["image_only"] == 15
    # resume: same config and seed -> the same manifest, no rewrite
    part = RunDir.at(tmp_path / "a").prompts / ma["parts"][0]["path"]
    before = part.stat().st_mtime_ns
    again = run_select(profile.select, RunDir.at(tmp_path / "a"), seed=0, progress=False)
    assert again == ma and part.stat().st_mtime_ns == before


def test_planted_exact_and_near_duplicates_removed(repo_root, tmp_path):
    rng = random.Random(3)
    src = repo_root / "data/prompts/gsm8k/train.sample3000.jsonl"
    originals = [json.loads(x)["question"] for x in src.read_text().splitlines()[:150]]
    originals = [q for q in originals if len(q) >= 200][:20]
    planted = []
    for q in originals[:10]:
        planted.append({"question": "  " + q.upper() + "\n"})  # exact after normalization
    for q in originals[10:20]:
        planted.append({"question": perturb(q, 2, rng)})  # a few characters changed
    p = tmp_path / "planted.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in planted) + "\n")
    cfg = SelectConfig(total=100, sources=[SourceConfig(name="gsm8k", path=str(src), category="reasoning"),
                                           SourceConfig(name="planted", path=str(p), category="reasoning")])
    run = RunDir.at(tmp_path / "run")
    m = run_select(cfg, run, seed=0, progress=False)
    rows = query(run.root, "SELECT source_row, filter, reason FROM rejected WHERE source = 'planted' ORDER BY 1")[1]
    assert [r[0] for r in rows] == list(range(20))
    assert {r[1] for r in rows[:10]} == {"exact_dedup"} and {r[1] for r in rows[10:]} == {"near_dedup"}
    assert all("duplicate" in r[2] and "of prompt" in r[2] for r in rows)
    assert m["accounting"]["files"][str(p)]["rejected"] == 20


def test_resume_redoes_work_when_an_input_file_changes(tmp_path):
    p = tmp_path / "pool.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": f"Explain idea number {i} of the theory of relativity."}) for i in range(5)))
    cfg = SelectConfig(total=3, sources=[SourceConfig(name="p", path=str(p), category="general")], mix={"general": 1.0})
    run = RunDir.at(tmp_path / "run")
    first = run_select(cfg, run, seed=0, progress=False)
    assert run_select(cfg, run, seed=0, progress=False) == first
    p.write_text(p.read_text() + "\n" + json.dumps({"prompt": "A brand new prompt about black holes and light."}))
    again = run_select(cfg, run, seed=0, progress=False)
    assert again["config_hash"] != first["config_hash"]
    assert again["accounting"]["totals"]["input_rows"] == 6


def test_empty_file_is_accounted_for(tmp_path):
    (tmp_path / "pool").mkdir()
    (tmp_path / "pool" / "a.jsonl").write_text(json.dumps({"prompt": "Why is the sky blue during the day?"}) + "\n")
    (tmp_path / "pool" / "b.jsonl").write_text("\n\n")
    cfg = SelectConfig(total=1, sources=[SourceConfig(name="p", path=str(tmp_path / "pool"), category="general")])
    m = run_select(cfg, RunDir.at(tmp_path / "run"), seed=0, progress=False)
    files = m["accounting"]["files"]
    assert files[str(tmp_path / "pool" / "b.jsonl")]["input_rows"] == 0
    assert files[str(tmp_path / "pool" / "a.jsonl")]["selected"] == 1


def test_workers_do_not_change_the_output(tmp_path):
    profile = load_profile("local")
    out = {}
    for w in (1, 2):
        run = RunDir.at(tmp_path / f"w{w}")
        m = run_select(profile.select.model_copy(update={"workers": w, "batch_rows": 500}), run, seed=0, progress=False)
        ids = [r[0] for r in query(run.root, "SELECT prompt_id FROM prompts")[1]]
        rej = query(run.root, "SELECT source_file, source_row, filter, reason FROM rejected ORDER BY ALL")[1]
        out[w] = (ids, rej, m["accounting"], m["filters"])
    assert out[1] == out[2]


def _select_workers(timeout_s: float = 60.0) -> list:
    """The live `select.workers` processes: the children of this process's multiprocessing forkserver."""
    import time

    import psutil

    me, t0 = psutil.Process(), time.time()
    while time.time() - t0 < timeout_s:
        for child in me.children():
            if "forkserver" in " ".join(child.cmdline()) and child.children():
                return child.children()
        time.sleep(0.01)
    raise AssertionError("no select worker started")


def _select_workers_alive() -> list:
    """The forkserver's children that are still running (not zombies), without waiting for one to start."""
    import psutil

    alive = []
    for child in psutil.Process().children():
        try:
            if "forkserver" in " ".join(child.cmdline()):
                alive += [w for w in child.children() if w.status() != psutil.STATUS_ZOMBIE]
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.integration
def test_workers_are_not_forked_from_the_calling_process(tmp_path):
    """A fork of a process with threads can inherit a lock one of them held and wait on it forever (a loop round
    hung so under CI): the workers come from the forkserver, a single-threaded process started once."""
    import os
    import threading

    profile = load_profile("local")
    cfg = profile.select.model_copy(update={"workers": 2, "batch_rows": 50})
    parents: list = []
    spy = threading.Thread(target=lambda: parents.extend(p.ppid() for p in _select_workers()), daemon=True)
    spy.start()
    run_select(cfg, RunDir.at(tmp_path / "run"), seed=0, progress=False)
    spy.join(timeout=60)
    assert parents and os.getpid() not in parents


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_killed_worker_fails_the_stage_with_its_remedy_and_keeps_the_last_selection(tmp_path, capsys):
    """A worker killed by the OS (here SIGKILL, as the OOM killer sends) ends `regen select` with a named error and
    exit status 1, not a wait without end; the run's previous selection is left as it was."""
    import signal
    import threading

    from regen.errors import exit_code

    profile = load_profile("local")
    run = RunDir.at(tmp_path / "run")
    cfg = profile.select.model_copy(update={"workers": 2, "batch_rows": 20, "total": 40})
    run_select(cfg.model_copy(update={"workers": 1}), run, seed=0, progress=False)
    before = (run.prompts / "manifest.json").read_text()

    def kill():
        for p in _select_workers():
            p.send_signal(signal.SIGKILL)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()

    def main():
        run_select(cfg.model_copy(update={"total": 41}), run, seed=0, progress=False)

    assert exit_code(main, "regen select") == 1
    killer.join(timeout=60)
    assert not [p for p in _select_workers_alive()], "a select worker outlived the failed stage"
    err = capsys.readouterr().err
    assert err.startswith("regen select: error: a select worker process died") and "select.workers" in err
    assert (run.prompts / "manifest.json").read_text() == before
