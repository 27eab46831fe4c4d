"""The row-level error of the selection stage (a `parse` reject), shared by the shape parsers."""
from __future__ import annotations


class RowError(ValueError):
    """A malformed row in a known shape: `field` names the offending field, `reason` says what is wrong."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
