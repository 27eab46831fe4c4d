"""The select stage's check before a run: what `run_select` will read exists.

    check(cfg, rep)   every `select.sources` entry holds data files (`regen.select.sources.source_files`: its
                      environment variables set, the path there); every `select.contamination_files` entry exists
                      when the contamination filter is on

Problems go to `rep` (a `regen.errors.CheckReport`), one line each naming the field and the fix; nothing is read
beyond the file listing.
"""
from __future__ import annotations

from regen.config import resolve_path
from regen.config.select import SelectConfig
from regen.errors import CheckReport, InputError
from regen.select.sources import source_files


def check(cfg: SelectConfig, rep: CheckReport) -> None:
    """Check the sources and contamination files of `cfg` (module docstring); never raises for a problem."""
    for src in cfg.sources:
        try:
            files = source_files(src)
            rep.ok(f"select.sources {src.name}: {len(files)} file(s)")
        except InputError as exc:
            rep.bad(str(exc))
    if "contamination" in cfg.filters:
        for raw in cfg.contamination_files:
            path = resolve_path(raw)
            if "$" in str(path):
                rep.bad(f"select.contamination_files {raw!r}: an environment variable is not set; export it")
            elif not path.exists():
                rep.bad(f"select.contamination_files {raw!r}: {path} does not exist; fix the path or remove the entry")
