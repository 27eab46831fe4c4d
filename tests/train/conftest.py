"""Fixtures for the trainer tests."""
from __future__ import annotations

import pytest
from train_helpers import ShardWriter


@pytest.fixture
def shard_writer(tmp_path) -> ShardWriter:
    return ShardWriter(tmp_path / "run")
