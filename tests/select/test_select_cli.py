"""`regen select` on the command line: the mix table, --source, --set overrides, errors without tracebacks."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from regen.cli import main as cli_main


def test_select_cli_prints_mix_and_takes_extra_sources(tmp_path, repo_root, capsys):
    extra = tmp_path / "extra.jsonl"
    extra.write_text("\n".join(json.dumps({"prompt": f"Write a limerick about the number {i} and a cat."})
                               for i in range(30)) + "\n")
    run = tmp_path / "run"
    rc = cli_main(["select", "--profile", "local", "--run", str(run), "--no-progress", "--set", "select.total=60",
                   "--set", "seed=5", "--source", str(extra)])
    out = capsys.readouterr().out
    assert rc == 0 and "prompt mix: 60 of 60 requested (seed 5)" in out and "multilingual" in out
    manifest = json.loads((run / "prompts" / "manifest.json").read_text())
    assert manifest["seed"] == 5 and str(extra) in manifest["accounting"]["files"]
    assert manifest["config"]["total"] == 60 and manifest["extra_sources"] == [str(extra)]


def test_kimi_profile_without_pool_path_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KIMI_MTP_DATASET", raising=False)
    rc = cli_main(["select", "--profile", "kimi-k3", "--run", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "KIMI_MTP_DATASET" in err and "Traceback" not in err


def test_kimi_profile_on_the_fixture(tmp_path, repo_root, capsys, monkeypatch):
    monkeypatch.setenv("KIMI_MTP_DATASET", str(repo_root / "data/prompts/kimi_mtp_sample"))
    run = tmp_path / "run"
    rc = cli_main(["select", "--profile", "kimi-k3", "--run", str(run), "--no-progress", "--set", "select.total=100"])
    assert rc == 0
    manifest = json.loads((run / "prompts" / "manifest.json").read_text())
    # the fixture's MT-Bench and arena rows are benchmark prompts: the contamination list drops them
    assert manifest["filters"]["contamination"] >= 40
    assert manifest["counts"]["category"]["tool_use"] > 0


@pytest.mark.integration
def test_bench_quick_smoke(repo_root):
    out = subprocess.run([sys.executable, str(repo_root / "bench/selection.py"), "--quick", "--rows", "3000", "--total", "500"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "rows per CPU-second" in out and "select / read ratio" in out and "selected 500 of 500" in out
