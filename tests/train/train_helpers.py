"""Helpers for the trainer tests: token shards listed in a manifest the way `regen render` lists them."""
from __future__ import annotations

import random
from pathlib import Path

from schemas.io import write_json_atomic, write_rows_atomic
from schemas.shard import SHARD_SCHEMA, spans_from_mask


def make_rows(num_rows: int, *, seed: int, vocab: int = 512, min_len: int = 20, max_len: int = 64,
              prefix: str = "s") -> list[dict]:
    """Random shard rows: a prompt part (no loss) then an assistant part (loss), ids in [3, vocab)."""
    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        n = rng.randint(min_len, max_len)
        prompt_len = rng.randint(2, max(2, n // 3))
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        mask = [0] * prompt_len + [1] * (n - prompt_len)
        spans = spans_from_mask(mask)
        rows.append({
            "sample_id": f"{prefix}{seed}-{i}", "prompt_id": f"p{prefix}{seed}-{i}", "turn": 0,
            "category": "math", "language": "en", "input_ids": ids, "loss_spans": spans,
            "num_tokens": n, "num_loss_tokens": sum(mask),
        })
    return rows


class ShardWriter:
    """Append shards to `<dir>/shards/` and list them in its manifest (atomically, like the render stage)."""

    def __init__(self, root: Path):
        self.dir = Path(root) / "shards"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.entries: list[dict] = []
        self.rows: list[dict] = []

    def add(self, rows: list[dict], *, complete: bool = False) -> dict:
        info = write_rows_atomic(rows, self.dir / f"shard-{len(self.entries):05d}.parquet", SHARD_SCHEMA)
        info["tokens"] = sum(r["num_tokens"] for r in rows)
        self.entries.append(info)
        self.rows.extend(rows)
        self.write_manifest(complete)
        return info

    def write_manifest(self, complete: bool, **extra) -> None:
        write_json_atomic({"schema": "regen.shards", "shards": self.entries, "complete": complete, **extra},
                          self.dir / "manifest.json")

