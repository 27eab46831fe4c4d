"""The rejected-row record: every row any stage drops, with the filter that dropped it and why.

Written to `runs/<name>/rejected/<stage>/part-*.parquet` with `REJECTED_SCHEMA`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import pyarrow as pa

SCHEMA_VERSION = 1

REJECTED_SCHEMA = pa.schema(
    [
        ("stage", pa.string()),  # select | generate | render
        ("filter", pa.string()),  # filter name, e.g. "exact_dedup", or "parse" for malformed rows
        ("reason", pa.string()),  # human-readable reason naming the field or value
        ("score", pa.float64()),  # the filter's score where it has one
        ("source", pa.string()),
        ("source_file", pa.string()),
        ("source_row", pa.int64()),
        ("prompt_id", pa.string()),  # null when the row never became a prompt
        ("sample_id", pa.string()),  # render stage: the sample that was dropped
        ("turn", pa.int32()),
        ("category", pa.string()),
        ("payload", pa.string()),  # the raw row or record as JSON, truncated to 4 KiB, for debugging
    ],
    metadata={"schema": "regen.rejected", "schema_version": str(SCHEMA_VERSION)},
)

PAYLOAD_LIMIT = 4096


@dataclass(frozen=True)
class RejectedRecord:
    stage: str
    filter: str
    reason: str
    score: float | None = None
    source: str | None = None
    source_file: str | None = None
    source_row: int | None = None
    prompt_id: str | None = None
    sample_id: str | None = None
    turn: int | None = None
    category: str | None = None
    payload: str | None = None

    def to_arrow_row(self) -> dict:
        row = asdict(self)
        if row["payload"] is not None and len(row["payload"]) > PAYLOAD_LIMIT:
            row["payload"] = row["payload"][:PAYLOAD_LIMIT]
        return row
