"""Shard writer and manifest: sizes, exact loss-span encoding, checksums, query views, the trainer's reader."""
from __future__ import annotations

import hashlib

import pyarrow.parquet as pq
import pytest

from regen.render.shards import ShardWriter, rows_to_table
from regen.report.query import query
from schemas.shard import SHARD_SCHEMA, mask_from_spans, spans_from_mask


def row(i: int, n: int) -> dict:
    mask = [0] * (n // 2) + [1] * (n - n // 2)
    spans = spans_from_mask(mask)
    return {"sample_id": f"s{i}", "prompt_id": f"p{i}", "turn": 0, "category": "chat", "language": "en",
            "input_ids": list(range(i, i + n)), "loss_spans": spans, "num_tokens": n, "num_loss_tokens": sum(mask)}


def test_rows_to_table_is_exact():
    rows = [row(i, 5 + i) for i in range(4)] + [row(9, 1)]
    table = rows_to_table(rows)
    assert table.schema == SHARD_SCHEMA
    back = table.to_pylist()
    for a, b in zip(rows, back):
        assert b["input_ids"] == a["input_ids"] and b["loss_spans"] == a["loss_spans"]
        assert mask_from_spans(b["loss_spans"], b["num_tokens"]) == [0] * (b["num_tokens"] // 2) + [1] * (
            b["num_tokens"] - b["num_tokens"] // 2)
    assert rows_to_table([]).num_rows == 0


@pytest.mark.parametrize("max_rows,max_tokens,sizes",
                         [(3, 10**9, [3, 3, 1]), (100, 25, [3, 3, 1]), (2, 16, [2, 2, 2, 1]), (100, 20, [2, 2, 2, 1])])
def test_shards_close_at_rows_or_tokens(tmp_path, max_rows, max_tokens, sizes):
    w = ShardWriter(tmp_path, max_rows=max_rows, max_tokens=max_tokens)
    entries = []
    for i in range(7):
        r = row(i, 8)
        if not w.fits(r):
            entries.append(w.flush())
        entries.append(w.add(r))
    entries = [e for e in entries if e] + [w.flush()]
    assert [e["rows"] for e in entries] == sizes
    for k, e in enumerate(entries):
        p = tmp_path / e["path"]
        assert e["path"] == f"shard-{k:05d}.parquet" and e["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
        assert e["tokens"] == 8 * e["rows"] == pq.read_metadata(p).num_rows * 8
    assert w.flush() is None
    assert not list(tmp_path.glob(".tmp-*"))
    with pytest.raises(ValueError):
        ShardWriter(tmp_path, max_rows=0, max_tokens=1)


def test_query_views_and_trainer_feed_read_a_rendered_run(tmp_path):
    from render_fixtures import generation_row, write_generations

    from regen.config.render import RenderConfig
    from regen.render.stage import run_render
    from regen.rundir import RunDir

    u = {"role": "user", "content": "Name three prime numbers and say why they are prime."}
    rows = [generation_row(f"p{i}", 0, [u], category=["math", "chat"][i % 2],
                           content=f"Two, three and five ({i}); each has no divisor but one and itself.",
                           reasoning_content="Small primes.") for i in range(6)]
    write_generations(tmp_path, rows)
    run = RunDir.at(tmp_path)
    m = run_render(RenderConfig(template_kwargs={"thinking": True}, shard_max_rows=4), run, progress=False)
    cols, got = query(tmp_path, "SELECT category, count(*), sum(num_loss_tokens) FROM samples GROUP BY 1 ORDER BY 1")
    assert [(r[0], r[1]) for r in got] == [("chat", 3), ("math", 3)]
    assert sum(r[2] for r in got) == m["num_loss_tokens"]
    _, shards = query(tmp_path, "SELECT path, rows, sha256 FROM shards ORDER BY path")
    assert [(p, r, s) for p, r, s in shards] == [(e["path"], e["rows"], e["sha256"]) for e in m["shards"]]
    # the trainer's feed accepts the manifest (checksums, complete flag, columns)
    from regen.train.feed import manifest_entries, manifest_finished

    assert manifest_finished(m) and [e["path"] for e in manifest_entries(m)] == ["shard-00000.parquet", "shard-00001.parquet"]
