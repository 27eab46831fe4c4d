"""The trainer feed: checksums, determinism, rank split, resume position, follow mode, filters and batching."""
from __future__ import annotations

import threading
import time

import pytest
from train_helpers import make_rows

from regen.errors import InputError
from regen.train.feed import FeedConfig, ShardFeed
from schemas.io import write_rows_atomic
from schemas.shard import SHARD_SCHEMA, mask_from_spans

CFG = FeedConfig(seed=3, max_len=48, max_tokens=160, max_batch=4, shuffle_buffer=16, bucket_window=8,
                 min_loss_tokens=4, poll_s=0.05)


def ids_of(feed, **kw) -> list[list[list[str]]]:
    """Per step, per micro-batch: the sample ids."""
    return [[mb.sample_ids for mb in step.microbatches] for step in feed.steps(**kw)]


def flat(steps) -> list[str]:
    return [s for step in steps for mb in step for s in mb]


@pytest.fixture
def three_shards(shard_writer):
    for k in range(3):
        shard_writer.add(make_rows(20, seed=k), complete=(k == 2))
    return shard_writer


def test_every_sample_once_per_epoch_and_deterministic(three_shards):
    a = ids_of(ShardFeed(three_shards.dir, CFG))
    b = ids_of(ShardFeed(three_shards.dir, CFG))
    assert a == b
    seen = flat(a)
    assert len(seen) == len(set(seen)) == 60  # world 1, accum 1: nothing dropped
    assert seen != [r["sample_id"] for r in three_shards.rows]  # shuffled
    other = flat(ids_of(ShardFeed(three_shards.dir, FeedConfig(**{**CFG.__dict__, "seed": 4}))))
    assert sorted(other) == sorted(seen) and other != seen


def test_batches_respect_token_budget_and_match_the_spans(three_shards):
    by_id = {r["sample_id"]: r for r in three_shards.rows}
    for step in ShardFeed(three_shards.dir, CFG).steps():
        for mb in step.microbatches:
            B, S = mb.input_ids.shape
            assert B <= CFG.max_batch and B * S <= CFG.max_tokens and S <= CFG.max_len
            for b, sid in enumerate(mb.sample_ids):
                row = by_id[sid]
                n = min(row["num_tokens"], CFG.max_len)
                assert mb.input_ids[b, :n].tolist() == row["input_ids"][:n]
                assert mb.attention_mask[b].sum() == n and not mb.loss_mask[b, n:].any()
                assert mb.loss_mask[b, :n].int().tolist() == mask_from_spans(row["loss_spans"], row["num_tokens"])[:n]


def test_two_ranks_split_the_same_global_batches_as_accumulation(three_shards):
    one = ids_of(ShardFeed(three_shards.dir, CFG, grad_accum=2))
    r0 = ids_of(ShardFeed(three_shards.dir, CFG, rank=0, world_size=2))
    r1 = ids_of(ShardFeed(three_shards.dir, CFG, rank=1, world_size=2))
    assert len(one) == len(r0) == len(r1) > 3
    for s1, a, b in zip(one, r0, r1):
        assert s1 == [a[0], b[0]]
    assert not set(flat(r0)) & set(flat(r1))


def test_resume_sees_exactly_the_remaining_samples(three_shards):
    full = ids_of(ShardFeed(three_shards.dir, CFG), num_epochs=2)
    feed = ShardFeed(three_shards.dir, CFG)
    it = feed.steps(num_epochs=2)
    head = [[mb.sample_ids for mb in next(it).microbatches] for _ in range(len(full) // 2 + 1)]
    state = feed.state_dict()
    resumed = ShardFeed(three_shards.dir, CFG)
    resumed.load_state_dict(state)
    tail = ids_of(resumed, num_epochs=2)
    assert head + tail == full
    # another world size (same global sequence) resumes at the same global position
    r0 = ShardFeed(three_shards.dir, CFG, rank=0, world_size=2)
    r1 = ShardFeed(three_shards.dir, CFG, rank=1, world_size=2)
    r0.load_state_dict(state)
    r1.load_state_dict(state)
    rest = flat(ids_of(r0, num_epochs=2)) + flat(ids_of(r1, num_epochs=2))
    remaining = flat(full[len(head):])
    assert len(rest) == len(set(rest)) and set(rest) <= set(remaining)
    assert len(rest) >= len(remaining) - 2 * CFG.max_batch  # at most one trailing micro-batch per epoch dropped


def test_resume_with_other_stream_settings_is_refused(three_shards):
    feed = ShardFeed(three_shards.dir, CFG)
    next(feed.steps())
    other = ShardFeed(three_shards.dir, FeedConfig(**{**CFG.__dict__, "shuffle_buffer": 4}))
    with pytest.raises(InputError, match="shuffle_buffer"):
        other.load_state_dict(feed.state_dict())


def test_bad_checksum_shard_is_never_read(three_shards):
    # Replace shard 1 with a valid parquet holding other samples: any read of it would surface their ids.
    intruders = make_rows(20, seed=99, prefix="BAD")
    write_rows_atomic(intruders, three_shards.dir / "shard-00001.parquet", SHARD_SCHEMA)
    with pytest.raises(InputError, match="shard-00001.parquet: sha256"):
        list(ShardFeed(three_shards.dir, CFG).steps())
    feed = ShardFeed(three_shards.dir, FeedConfig(**{**CFG.__dict__, "on_bad_shard": "skip"}))
    seen = flat(ids_of(feed))
    assert seen and not any(s.startswith("BAD") for s in seen)
    assert {s.split("-")[0] for s in seen} == {"s0", "s2"}
    assert feed.stats["shards_skipped"] == ["shard-00001.parquet"]


def test_follow_picks_up_appended_shards_and_ends_on_the_finished_marker(shard_writer):
    shard_writer.add(make_rows(20, seed=0))
    cfg = FeedConfig(**{**CFG.__dict__, "follow_timeout_s": 30})
    got, done = [], threading.Event()

    def consume():
        for step in ShardFeed(shard_writer.dir, cfg, follow=True).steps():
            got.append([mb.sample_ids for mb in step.microbatches])
        done.set()

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    for k in (1, 2):
        time.sleep(0.3)
        assert not done.is_set()  # still following: the run is not finished
        shard_writer.add(make_rows(20, seed=k))
    time.sleep(0.3)
    assert not done.is_set()
    shard_writer.write_manifest(False, status="finished")  # the render stage's own finished state also ends it
    assert done.wait(10)
    # the followed run saw what a run over the finished manifest sees, in the same order
    assert got == ids_of(ShardFeed(shard_writer.dir, CFG))
    assert len(flat(got)) == 60


def test_follow_waits_for_the_manifest_and_times_out_without_progress(tmp_path):
    cfg = FeedConfig(**{**CFG.__dict__, "follow_timeout_s": 0.3})
    with pytest.raises(InputError, match="no new shard"):
        list(ShardFeed(tmp_path / "shards", cfg, follow=True).steps())
    with pytest.raises(InputError, match="regen render"):
        list(ShardFeed(tmp_path / "shards", cfg).steps())


def test_heldout_short_and_long_rows(shard_writer):
    rows = make_rows(30, seed=5, min_len=10, max_len=120)
    rows[0]["loss_spans"], rows[0]["num_loss_tokens"] = [{"start": 0, "end": 2}], 2  # too few loss tokens
    shard_writer.add(rows, complete=True)
    heldout = {rows[1]["prompt_id"], rows[2]["prompt_id"]}
    feed = ShardFeed(shard_writer.dir, CFG, heldout=heldout.__contains__)
    seen = set(flat(ids_of(feed)))
    assert rows[0]["sample_id"] not in seen
    assert not seen & {rows[1]["sample_id"], rows[2]["sample_id"]}
    assert feed.stats["rows_heldout"] == 2 and feed.stats["rows_short"] >= 1
    assert feed.stats["rows_truncated"] == sum(r["num_tokens"] > CFG.max_len for r in rows[:1] + rows[3:])


def test_manifest_may_only_grow(three_shards):
    feed = ShardFeed(three_shards.dir, CFG)
    list(feed.steps())
    three_shards.entries[0], three_shards.entries[1] = three_shards.entries[1], three_shards.entries[0]
    three_shards.write_manifest(True)
    with pytest.raises(InputError, match="appended"):
        list(feed.steps(num_epochs=2))


def test_count_steps_matches_iteration(three_shards):
    feed = ShardFeed(three_shards.dir, CFG, world_size=1, grad_accum=3)
    assert feed.count_steps(2) == len(ids_of(ShardFeed(three_shards.dir, CFG, grad_accum=3), num_epochs=2))


def test_left_truncation_keeps_the_end_of_long_rows(shard_writer):
    rows = make_rows(12, seed=7, min_len=70, max_len=120)
    shard_writer.add(rows, complete=True)
    cfg = FeedConfig(**{**CFG.__dict__, "truncate": "left"})
    by_id = {r["sample_id"]: r for r in rows}
    n = 0
    for step in ShardFeed(shard_writer.dir, cfg).steps():
        for mb in step.microbatches:
            for b, sid in enumerate(mb.sample_ids):
                row, n = by_id[sid], n + 1
                assert mb.input_ids[b, :CFG.max_len].tolist() == row["input_ids"][-CFG.max_len:]
                mask = mask_from_spans(row["loss_spans"], row["num_tokens"])[-CFG.max_len:]
                assert mb.loss_mask[b].int().tolist() == mask
    assert n == 12


def test_heldout_fraction_uses_the_eval_split(shard_writer):
    from regen.train.heldout import is_heldout

    rows = make_rows(60, seed=11)
    shard_writer.add(rows, complete=True)
    feed = ShardFeed(shard_writer.dir, FeedConfig(**{**CFG.__dict__, "heldout_fraction": 0.3}))
    seen = set(flat(ids_of(feed)))
    held = {r["sample_id"] for r in rows if is_heldout(r["prompt_id"], 0.3)}
    assert held and not seen & held
    assert seen == {r["sample_id"] for r in rows} - held
