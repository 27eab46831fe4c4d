"""Token shards: the training rows and the manifest that states the training contract.

A row is one training sample: `input_ids: int32[num_tokens]` and the assistant loss mask encoded exactly as
half-open spans `loss_spans: [{start, end}]` over token positions (mask[i] = 1 iff start <= i < end for some
span). Spans are sorted, non-overlapping and non-adjacent. Written by `regen render` to
`runs/<name>/shards/shard-*.parquet`, each listed in `shards/manifest.json` with rows, tokens and sha256.
"""
from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1

SPAN_TYPE = pa.struct([("start", pa.int32()), ("end", pa.int32())])

SHARD_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),  # sha256 of (prompt_id, turns, render contract)
        ("prompt_id", pa.string()),
        ("turn", pa.int32()),  # last supervised assistant turn
        ("category", pa.string()),
        ("language", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_spans", pa.list_(SPAN_TYPE)),
        ("num_tokens", pa.int32()),
        ("num_loss_tokens", pa.int32()),
    ],
    metadata={"schema": "regen.shard", "schema_version": str(SCHEMA_VERSION)},
)


def spans_from_mask(mask) -> list[dict]:
    """0/1 sequence -> sorted half-open spans `[{start, end}]`."""
    spans, start = [], None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append({"start": start, "end": i})
            start = None
    if start is not None:
        spans.append({"start": start, "end": len(mask)})
    return spans


def mask_from_spans(spans, num_tokens: int) -> list[int]:
    """Half-open spans -> 0/1 list of length `num_tokens`. Raises ValueError on a span out of range."""
    mask = [0] * num_tokens
    for s in spans:
        if not (0 <= s["start"] < s["end"] <= num_tokens):
            raise ValueError(f"loss span {s} outside [0, {num_tokens})")
        mask[s["start"] : s["end"]] = [1] * (s["end"] - s["start"])
    return mask
