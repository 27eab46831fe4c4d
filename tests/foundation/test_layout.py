"""The layout is the map: stage packages, one-way imports, no cycles, modules of readable size.

Parses every module's imports with `ast` (function-level and TYPE_CHECKING imports included), so a lazy
import that closes a cycle fails here as surely as a top-level one.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "filters", "regen", "flows")
STAGES = ("select", "generate", "render", "train")
# layer order: a module may import only from its own layer or the ones before it
LAYERS = ["schemas", "filters", "regen.config", "regen.stages", "regen.top", "flows"]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that `path` imports: `from a.b import c` counts `a.b.c` when that is a module, else `a.b`."""
    me = module_name(path)
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != me:
                out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {m: imports_of(p, modules) for m, p in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def layer(module: str) -> str:
    top = module.split(".")[0]
    if top != "regen":
        return top
    if module.startswith("regen.config") or module in ("regen", "regen.errors", "regen.rundir"):
        return "regen.config"
    if module.split(".")[1] in STAGES:
        return "regen.stages"
    return "regen.top"


def test_no_import_cycles():
    assert find_cycle(import_graph()) is None, f"import cycle: {' -> '.join(find_cycle(import_graph()))}"


def test_cycle_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_imports_point_one_way():
    """schemas <- filters <- regen.config <- regen.<stage> <- regen.pipeline / cli / report / serve <- flows."""
    wrong = []
    for m, deps in import_graph().items():
        for d in deps:
            if LAYERS.index(layer(d)) > LAYERS.index(layer(m)):
                wrong.append(f"{m} imports {d}")
    assert not wrong, "imports against the data path:\n" + "\n".join(sorted(wrong))


def test_stages_use_each_other_only_through_public_entries():
    """A stage reaches another only through its documented entry (render's `make_renderer`); the hand-off
    between stages is files read through `schemas`."""
    allowed = {
        ("train", "regen.render.stage"),  # eval renders held-out prompts with render's public entry
        ("render", "regen.generate.ledger"),  # render verifies generation parts with `check_parts` before reading
        ("select", "regen.render.stage"),  # `regen select` asks `prompt_control_tokens` what the renderer parses
    }
    wrong = []
    for m, deps in import_graph().items():
        if layer(m) != "regen.stages":
            continue
        mine = m.split(".")[1]
        for d in deps:
            if layer(d) == "regen.stages" and d.split(".")[1] != mine and (mine, d) not in allowed:
                wrong.append(f"{m} imports {d}")
    assert not wrong, "\n".join(sorted(wrong))


def test_only_flows_import_prefect():
    for m, p in project_modules().items():
        if m.startswith("flows"):
            continue
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.split(".")[0] == "prefect" for n in names), f"{m} imports prefect"


def test_top_level_is_small_and_holds_the_stage_packages():
    entries = [p.name for p in (ROOT / "regen").iterdir() if p.name != "__pycache__"]
    assert len(entries) <= 15, sorted(entries)
    for stage in STAGES:
        init = ROOT / "regen" / stage / "__init__.py"
        assert init.exists(), f"regen/{stage}/ is not a package"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "Entry point" in doc and "In:" in doc and "Out:" in doc, f"regen/{stage}/__init__.py: no map"


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_module_over_600_lines(pkg):
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / pkg).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_no_bench_script_shadows_the_standard_library():
    """`python bench/x.py` puts bench/ first on sys.path: a bench named like a stdlib module would shadow it."""
    import sys

    shadowing = [p.name for p in (ROOT / "bench").glob("*.py") if p.stem in sys.stdlib_module_names]
    assert not shadowing, shadowing
