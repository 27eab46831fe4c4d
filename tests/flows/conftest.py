"""Fixtures for the flow tests: one real Prefect stack per test session (server + deployments + worker)."""
from __future__ import annotations

import pytest
from prefect_stack import PrefectStack


@pytest.fixture(scope="session")
def prefect_stack(tmp_path_factory):
    stack = PrefectStack(tmp_path_factory.mktemp("prefect-home")).start()
    yield stack
    stack.stop()
