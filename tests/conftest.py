"""Shared test fixtures. Stage-specific fixtures live in tests/<stage>/conftest.py."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_PROMPTS = (REPO_ROOT.parent / "shared" / "data" / "prompts").resolve()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_prompts() -> Path:
    """`../shared/data/prompts` (present locally and in CI); tests that need it skip loudly without it."""
    if not SHARED_PROMPTS.is_dir():
        pytest.fail(f"{SHARED_PROMPTS} not found: tests need the shared prompt sets beside the repository")
    return SHARED_PROMPTS
