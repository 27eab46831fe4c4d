"""`regen render` and the bench's --quick smoke run, through their command lines."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from render_fixtures import generation_row, write_generations

from regen.cli import main as cli_main

U1 = {"role": "user", "content": "What is the sum of two and three? Explain it briefly."}


def test_regen_render_cli(tmp_path, capsys):
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump({"name": "t", "render": {
        "renderer": "kimi-k3", "template_kwargs": {"thinking": True, "thinking_effort": "max"}}}))
    run = tmp_path / "run"
    write_generations(run, [generation_row("c1", 0, [U1], content="Five, since two plus three is five.",
                                           reasoning_content="2+3=5"),
                            generation_row("c2", 0, [U1], content="Five", finish_reason="length")])
    assert cli_main(["render", "--profile", str(profile), "--run", str(run), "--filters-only", "--no-progress"]) == 0
    assert '"truncated": 1' in capsys.readouterr().out
    assert cli_main(["render", "--profile", str(profile), "--run", str(run), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "shards / rows" in out and "1 / 1" in out
    assert (run / "shards" / "manifest.json").is_file()
    # a missing generations directory is an input error naming the fix, not a traceback
    assert cli_main(["render", "--profile", str(profile), "--run", str(tmp_path / "none"), "--no-progress"]) == 2
    assert "regen generate" in capsys.readouterr().err


@pytest.mark.integration
def test_bench_quick_runs(repo_root):
    out = subprocess.run([sys.executable, str(repo_root / "bench" / "render.py"), "--quick"], capture_output=True,
                         text=True, timeout=120, cwd=repo_root)
    assert out.returncode == 0, out.stderr
    assert "ratio render / baseline:" in out.stdout and "tokens/s/core" in out.stdout
