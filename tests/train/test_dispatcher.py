"""The feature dispatcher's rules over its real HTTP interface: order, byte budget, leases, attempts, drops.

The store here is an in-memory stand-in that records removals (the dispatcher only removes objects); the real
Mooncake store carries the objects in tests/train/test_producers.py.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from regen.train.features.contract import FeatureSpec, object_nbytes
from regen.train.features.dispatcher import Dispatcher, post

SPEC = FeatureSpec("regen/t", (0, 1), "prefix", "float32", 8, 4, "rev")


class RemovalLog:
    segment = "seg-0"

    def __init__(self):
        self.removed: list[str] = []

    def remove(self, keys):
        self.removed += list(keys)
        return [0] * len(keys)


def _mb(i, S=10):
    return SimpleNamespace(input_ids=torch.full((1, S), 3 + i), attention_mask=torch.ones(1, S, dtype=torch.bool),
                           sample_ids=[f"s{i}"])


def _dispatcher(stream, **kw):
    store = RemovalLog()
    args = dict(store=store, segments=["seg-0", "seg-1"], budget_bytes=10**9, max_ahead=16, lease_timeout_s=1.0,
                heartbeat_s=0.2, put_release_s=0.5)
    args.update(kw)
    return Dispatcher(iter(stream), SPEC, **args).start(), store


@pytest.fixture
def stop_after():
    made = []
    yield made.append
    for d in made:
        d.stop()


def _register(d, name="x"):
    return post(d.url, "/register", {"engine": "test", "engine_version": "0", "host": name, "pid": 1})["producer_id"]


def _lease(d, pid, wait_s=0.0):
    return post(d.url, "/lease", {"producer_id": pid, "wait_s": wait_s})


def _complete(d, pid, item):
    return post(d.url, "/complete", {"producer_id": pid, "lease_id": item["lease_id"], "key": item["key"],
                                     "header": {"ok": 1}, "busy_s": 0.01})


def test_items_are_leased_in_plan_order_within_the_byte_budget(stop_after):
    size = object_nbytes(1, 10, SPEC)
    d, store = _dispatcher([(0, g, _mb(g), g % 2) for g in range(5)], budget_bytes=int(2.5 * size))
    stop_after(d)
    pid = _register(d)
    a, b = _lease(d, pid, 2)["item"], _lease(d, pid, 2)["item"]
    assert (a["index"], b["index"]) == (0, 1) and a["nbytes"] == size
    assert a["preferred_segment"] == "seg-0" and b["preferred_segment"] == "seg-1"  # the consuming rank's memory
    assert _lease(d, pid, 0.3)["item"] is None  # a third object would not fit: nothing is leased
    _complete(d, pid, a)
    assert _lease(d, pid, 0.3)["item"] is None  # ready but not consumed: still counted
    r = post(d.url, "/wait", {"epoch": 0, "index": 0, "timeout_s": 1})
    assert r["status"] == "ready" and r["key"] == a["key"]
    post(d.url, "/consumed", {"epoch": 0, "index": 0})
    assert a["key"] in store.removed  # consumed objects leave the store
    c = _lease(d, pid, 2)["item"]
    assert c["index"] == 2
    assert d.stats["max_accounted_bytes"] <= 2.5 * size


def test_a_silent_producer_loses_its_leases_to_the_others(stop_after):
    d, store = _dispatcher([(0, g, _mb(g), 0) for g in range(2)])
    stop_after(d)
    dead, alive = _register(d, "dead"), _register(d, "alive")
    item = _lease(d, dead, 2)["item"]
    # `alive` heartbeats; `dead` never does again: after lease_timeout_s its lease returns to the pool
    t0 = time.monotonic()
    again = None
    while time.monotonic() - t0 < 10:
        post(d.url, "/heartbeat", {"producer_id": alive})
        r = _lease(d, alive, 0.3)
        if r["item"] is not None and r["item"]["index"] == 0:
            again = r["item"]
            break
    assert again is not None and again["attempt"] == 1 and again["key"] != item["key"]
    assert item["key"] in store.removed  # whatever the dead producer may have written is removed
    assert post(d.url, "/heartbeat", {"producer_id": dead})["reregister"]
    assert not _complete(d, dead, item)["ok"]  # a late completion of the expired lease is refused
    assert _complete(d, alive, again)["ok"]
    status = post(d.url, "/status")
    assert status["stats"]["lease_expiries"] == 1 and status["stats"]["stale_completions"] == 1
    # liveness is what was last observed, with when: never "alive" without the time it was last heard from
    seen = {p["id"]: p for p in status["producers"]}
    assert seen[dead]["state"] == "dead" and "declared dead at" in seen[dead]["observed"] and not seen[dead]["alive"]
    assert seen[alive]["state"] == "alive_as_last_observed" and seen[alive]["alive"]
    assert f"alive as last observed at {seen[alive]['last_seen_at']}" in seen[alive]["observed"]


def test_an_item_failing_on_every_attempt_is_failed_with_its_reasons(stop_after):
    d, _ = _dispatcher([(0, 0, _mb(0), 0)], max_attempts=2)
    stop_after(d)
    pid = _register(d)
    for k in range(2):
        item = _lease(d, pid, 2)["item"]
        assert item["attempt"] == k
        post(d.url, "/fail", {"producer_id": pid, "lease_id": item["lease_id"], "reason": f"boom {k}"})
    r = post(d.url, "/wait", {"epoch": 0, "index": 0, "timeout_s": 1})
    assert r["status"] == "failed" and "boom 0" in r["reason"] and "boom 1" in r["reason"]
    assert r["sample_ids"] == ["s0"]
    assert _lease(d, pid, 0.5).get("done")  # nothing left to do


def test_dropped_items_and_the_end_of_the_plan(stop_after):
    d, store = _dispatcher([(0, g, _mb(g), 0) for g in range(3)])
    stop_after(d)
    pid = _register(d)
    items = [_lease(d, pid, 2)["item"] for _ in range(3)]
    _complete(d, pid, items[2])
    d.drop(0, range(1, 3))  # a trailing partial step the trainer will not consume
    assert items[2]["key"] in store.removed
    assert not _complete(d, pid, items[1])["ok"]  # its producer is told to remove its object
    _complete(d, pid, items[0])
    post(d.url, "/consumed", {"epoch": 0, "index": 0})
    assert _lease(d, pid, 0.5).get("done")
    r = post(d.url, "/wait", {"epoch": 0, "index": 7, "timeout_s": 0.5})
    assert r["status"] == "error" and "not in the plan" in r["reason"]


def test_a_planning_error_reaches_every_waiting_rank(stop_after):
    def stream():
        yield 0, 0, _mb(0), 0
        raise OSError("shard-00003.parquet vanished")

    d, _ = _dispatcher(stream())
    stop_after(d)
    time.sleep(0.3)
    r = post(d.url, "/wait", {"epoch": 0, "index": 1, "timeout_s": 2})
    assert r["status"] == "error" and "shard-00003.parquet vanished" in r["reason"]


def test_an_object_larger_than_the_budget_fails_with_the_fix(stop_after):
    d, _ = _dispatcher([(0, 0, _mb(0, S=100), 0)], budget_bytes=1000)
    stop_after(d)
    r = post(d.url, "/wait", {"epoch": 0, "index": 0, "timeout_s": 2})
    assert r["status"] == "failed" and "train.producers.budget_bytes" in r["reason"]


def test_waiting_reports_when_no_producer_is_alive(stop_after):
    d, _ = _dispatcher([(0, 0, _mb(0), 0)])
    stop_after(d)
    r = post(d.url, "/wait", {"epoch": 0, "index": 0, "timeout_s": 0.3})
    assert r["status"] == "pending" and r["live_producers"] == 0 and not r["ever_registered"]
    pid = _register(d)
    _lease(d, pid, 1)
    time.sleep(1.6)  # silent past lease_timeout_s: dead
    r = post(d.url, "/wait", {"epoch": 0, "index": 0, "timeout_s": 0.3})
    assert r["ever_registered"] and r["live_producers"] == 0 and r["no_producer_s"] > 0
