"""The lock files' three chores for scripts/refresh-lock.sh (stdlib only, runs before any venv exists).

    python3 scripts/lock.py unbounded              # pyproject's requirements without their ceilings (for pip -r)
    python3 scripts/lock.py freeze VENV FILE       # FILE's comment header kept, then VENV's `pip freeze --all`
    python3 scripts/lock.py ceilings               # pyproject's ceilings (<=X) set to requirements/lock.txt
"""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements() -> list[str]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["dev"]]


def unbounded() -> None:
    for req in requirements():
        print(re.sub(r",?\s*<=\s*[^,;]+", "", req))


def freeze(venv: str, file: str) -> None:
    path = ROOT / file
    header = [ln for ln in path.read_text().splitlines() if ln.startswith("#")] if path.exists() else []
    out = subprocess.run([f"{venv}/bin/pip", "freeze", "--all", "--exclude-editable"], check=True,
                         capture_output=True, text=True).stdout.splitlines()
    pins = [ln for ln in out if ln and not re.match(r"regen(==| @)", ln)]
    path.write_text("\n".join(header + pins) + "\n")
    print(f"lock: {len(pins)} packages of {venv} in {file}", file=sys.stderr)


def ceilings() -> None:
    lock = {norm(n): v for n, _, v in (ln.partition("==") for ln in (ROOT / "requirements" / "lock.txt")
                                       .read_text().splitlines() if "==" in ln and not ln.startswith("#"))}
    text = PYPROJECT.read_text()

    def bump(m):
        name = m.group(1)
        return f'"{name}{m.group(2)}<={lock[norm(name)]}"' if norm(name) in lock else m.group(0)

    PYPROJECT.write_text(re.sub(r'"([A-Za-z0-9_.-]+)([^"]*?)<=[^",;]+"', bump, text))


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:] or ["--help"]
    if cmd == "unbounded":
        unbounded()
    elif cmd == "freeze" and len(rest) == 2:
        freeze(*rest)
    elif cmd == "ceilings":
        ceilings()
    else:
        sys.exit(__doc__)
