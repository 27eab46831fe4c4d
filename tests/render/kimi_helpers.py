"""Shared fixture and helpers of the Kimi-K3 renderer tests (test vocabulary, real control ids)."""
from __future__ import annotations

import pytest

from regen.render.kimi_k3.renderer import KimiK3Renderer


@pytest.fixture(scope="module")
def kimi() -> KimiK3Renderer:
    """The Kimi-K3 renderer on the project's test vocabulary, default mask policy (spec §6)."""
    return KimiK3Renderer()


def expected_ids(r: KimiK3Renderer, parts: list) -> list[int]:
    """ids of a list of parts: an int is a control id, a str is one text segment encoded on its own."""
    out: list[int] = []
    for p in parts:
        out.extend([p] if isinstance(p, int) else r.tokenizer.encode_text(p))
    return out
