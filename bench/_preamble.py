"""What every bench script does before its other imports. Each starts with the same lines:

    import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
    import sys

    sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
    from _preamble import ROOT  # noqa: E402 - bench/ off sys.path, the repository root first, HF offline

(ruff's isort keeps `_preamble` in a section of its own, before the standard library: pyproject.toml), and
then, on import:

- `python bench/x.py` puts bench/ first on sys.path, where a script named like a standard-library module would
  shadow it (tests/foundation/test_layout.py forbids such a name; this is the second guard): bench/ leaves
  sys.path when a bench script is the program. A bench imported by a test leaves sys.path as the test set it.
- the repository root `ROOT` goes first on sys.path, so `regen`, `schemas`, `filters` come from this checkout
  (a worktree's own, not the one an editable install points at);
- Hugging Face stays offline (`HF_HUB_OFFLINE`, `TRANSFORMERS_OFFLINE`, unless set): a bench loads its models
  from disk and downloads nothing.

`sibling(name)` imports another bench script (bench/<name>.py) for its functions, whatever sys.path holds.
"""
from __future__ import annotations

import os
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
_main = getattr(sys.modules.get("__main__"), "__file__", None)
if _main and os.path.dirname(os.path.abspath(_main)) == BENCH:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != BENCH]

import importlib.util  # noqa: E402 - after bench/ left sys.path
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402

ROOT = Path(BENCH).parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def sibling(name: str) -> ModuleType:
    """The bench script bench/<name>.py as module `name`, imported once (kept in sys.modules)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
