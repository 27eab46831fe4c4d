"""End-to-end fixtures: a headless Chromium (Debian `chromium`, installed by .ci/run)."""
from __future__ import annotations

import os

import pytest
from e2e_helpers import chromium_path


@pytest.fixture(scope="session")
def chromium():
    """The browser binary; CI installs it (.ci/run), so its absence is a failure, not a skip."""
    path = chromium_path()
    if path is None:
        if os.environ.get("REGEN_ALLOW_NO_BROWSER") == "1":
            pytest.skip("no chromium and REGEN_ALLOW_NO_BROWSER=1")
        pytest.fail("chromium not found: `apt-get install -y chromium` (.ci/run does this)")
    return path
