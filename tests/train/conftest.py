"""Fixtures for the trainer tests."""
from __future__ import annotations

import pytest
from train_helpers import ShardWriter


@pytest.fixture
def shard_writer(tmp_path) -> ShardWriter:
    return ShardWriter(tmp_path / "run")


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A random Qwen3-style target (hidden 64, 4 layers, vocab 512) saved to a temporary directory."""
    from train_helpers import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("tiny-target") / "target")


@pytest.fixture
def tiny_run(tmp_path, tiny_target):
    """(profile path, run dir with 3 complete shards of 20 rows) for the tiny target."""
    from train_helpers import make_rows, write_profile

    writer = ShardWriter(tmp_path / "run")
    for k in range(3):
        writer.add(make_rows(20, seed=k), complete=(k == 2))
    return write_profile(tmp_path / "tiny.yaml", tiny_target), tmp_path / "run"
