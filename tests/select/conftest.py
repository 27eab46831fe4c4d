"""Fixtures of the selection tests: one selection of the whole pool sample (data/pool) per session."""
from __future__ import annotations

import pytest

from regen.config import load_profile
from regen.rundir import RunDir
from regen.select.stage import run_select


@pytest.fixture(scope="session")
def shared_profile(pool_dir):
    return load_profile("shared-prompts")


@pytest.fixture(scope="session")
def shared_run(shared_profile, tmp_path_factory):
    """(RunDir, manifest) of `shared-prompts`: every file of data/pool selected once per session."""
    run = RunDir.at(tmp_path_factory.mktemp("shared-run"))
    manifest = run_select(shared_profile.select, run, seed=shared_profile.seed, progress=False)
    return run, manifest
