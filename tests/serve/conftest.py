"""Fixtures for the embedded target: the prepared model directory (made by scripts/setup.sh)."""
from __future__ import annotations

import pytest

from regen.config import resolve_path
from regen.config.serve import ServeConfig


@pytest.fixture(scope="session")
def model_dir():
    path = resolve_path(ServeConfig().model_dir)
    if not (path / "model.safetensors").exists():
        pytest.fail(f"{path} is missing: run `bash scripts/setup.sh` (it calls `python -m regen.serve.prepare_model`)")
    return path
