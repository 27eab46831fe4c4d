"""The row-level error of the selection stage (a `parse` reject), shared by the shape parsers."""
from __future__ import annotations

import json

_JSON_TYPES = ((bool, "a boolean"), (int, "a number"), (float, "a number"), (str, "a string"), (list, "a list"),
               (tuple, "a list"), (dict, "an object"), (bytes, "bytes"))


class RowError(ValueError):
    """A malformed row in a known shape: `field` names the offending field, `reason` says what is wrong."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def type_found(value) -> str:
    """A value as a row error names it: its JSON type and a short preview, e.g. `a number (12345)`, `null`,
    `a list (["a", "b"])`, `an object ({"text": "hi"})`; other Python types (from Parquet) by their type name."""
    if value is None:
        return "null"
    kind = next((name for t, name in _JSON_TYPES if isinstance(value, t)), f"a {type(value).__name__}")
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return f"{kind} ({text if len(text) <= 40 else text[:37] + '...'})"


def wrong_type(field: str, value, expected: str) -> RowError:
    """The RowError for a field holding the wrong type: `FIELD: must be EXPECTED, got FOUND` (FOUND from
    `type_found`), e.g. `prompt: must be a string (the prompt text), got a number (12345)`."""
    return RowError(field, f"must be {expected}, got {type_found(value)}")
