"""The flow and deployment declarations, without a server: names, parameters, task options, imports."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

from flows import deploy, regen_flow
from regen.config import load_profile

REPO = Path(__file__).resolve().parents[2]


def test_flow_is_named_regen_and_tasks_do_not_cache():
    assert regen_flow.regen.name == "regen"
    tasks = [regen_flow.select_task, regen_flow.generate_task, regen_flow.filter_task, regen_flow.render_task,
             regen_flow.train_task, regen_flow.eval_task]
    assert [t.name for t in tasks] == ["select", "generate", "filter", "render", "train", "eval"]
    for t in tasks:
        assert t.persist_result is False and t.retries == 0
        assert type(t.cache_policy).__name__ in ("_None", "NoCache", "NONE")


def test_deployments_match_the_flow_parameters_and_profiles():
    params = set(inspect.signature(regen_flow.regen.fn).parameters)
    assert set(deploy.DEPLOYMENTS) == {"local", "kimi-k3"}
    for name, (defaults, _) in deploy.DEPLOYMENTS.items():
        assert set(defaults) <= params
        assert load_profile(defaults["profile"]).name == name
    assert deploy.ENTRYPOINT == "flows/regen_flow.py:regen" and (REPO / "flows" / "regen_flow.py").exists()


def test_only_flows_import_prefect():
    """Imports point one way (schemas <- filters <- regen <- flows): no stage module imports Prefect."""
    offenders = []
    for package in ("regen", "schemas", "filters"):
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(n == "prefect" or n.startswith("prefect.") for n in names):
                    offenders.append(str(path.relative_to(REPO)))
    assert offenders == []
