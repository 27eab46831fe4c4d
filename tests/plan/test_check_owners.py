"""Each stage owns its check before a run: `regen/<stage>/preflight.py` exports `check(...)`, and the profile's
preflight (`regen/preflight.py`) calls those checks, reaching into no stage's internals."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from regen import preflight
from regen.config import load_profile
from regen.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("select", "generate", "render", "train")


def project_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("regen"):
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("regen"))
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_exports_its_check(stage):
    import importlib

    module = importlib.import_module(f"regen.{stage}.preflight")
    params = list(inspect.signature(module.check).parameters)
    assert params[0] == "cfg" and "rep" in params, params  # the stage's own sub-config, and the report


def test_preflight_reaches_only_the_stages_checks():
    allowed_stage_modules = {f"regen.{s}.preflight" for s in STAGES}
    wrong = []
    for name in project_imports(ROOT / "regen" / "preflight.py"):
        parts = name.split(".")
        if len(parts) > 1 and parts[1] in STAGES and ".".join(parts[:3]) not in allowed_stage_modules:
            wrong.append(name)
        if len(parts) > 1 and parts[1] == "serve" and name not in ("regen.serve.engines", "regen.target.server"):
            wrong.append(name)
    assert not wrong, f"regen/preflight.py reaches into stage internals: {sorted(wrong)}"


def test_preflight_is_the_list_of_checks(tmp_path):
    """Which checks a profile's run needs: the embedded target's instead of the endpoints', train only when on."""
    def needed(name: str, **overrides) -> list[str]:
        return [c.name for c in preflight.CHECKS if c.needed(load_profile(name, overrides))]

    assert needed("local") == ["select", "serve", "render", "train", "output"]
    assert needed("kimi-k3") == ["select", "generate", "render", "train", "output"]
    assert needed("kimi-k3", **{"train.enabled": False}) == ["select", "generate", "render", "output"]
    rep = preflight.check_profile(load_profile("local"), RunDir.at(tmp_path / "run"), network=False)
    assert not rep.problems, rep.problems
    assert any(c.startswith("serve.model_dir") and c.endswith("config.json loads") for c in rep.checks), rep.checks
    assert not any("endpoint(s) list" in c for c in rep.checks)  # the embedded target's endpoint: once it is up
