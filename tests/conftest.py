"""Shared test fixtures. Stage-specific fixtures live in tests/<stage>/conftest.py."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
POOL = REPO_ROOT / "data" / "pool"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def pool_dir() -> Path:
    """`data/pool`: the first rows of every file of the public prompt sets (its SOURCES.md), in the repository."""
    return POOL
