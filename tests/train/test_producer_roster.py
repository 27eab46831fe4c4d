"""Every producer ever started is in the run summary with its final state, whatever the timing of its death.

The pool's producer report (`FeaturePool.producer_report`, `regen.train.features.roster`) over a real dispatcher
(its HTTP interface, an in-memory stand-in for the store) and real local processes (`fake_producer.py`: the
dispatcher's protocol with the standard library only). Each test kills a producer at one chosen point of the
protocol (before it registers, registered, holding a lease of the last micro-batch, after its last object was
consumed, after the dispatcher declared it dead) by waiting for that point, never by racing for it; the end-to-end
run with a real producer SIGKILLed is tests/train/test_producers.py.
"""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_dispatcher import RemovalLog, _mb

from regen.train.features.contract import FeatureSpec
from regen.train.features.dispatcher import Dispatcher, post
from regen.train.features.pool import FeaturePool
from regen.train.features.roster import final_producers

SPEC = FeatureSpec("regen/t", (0, 1), "prefix", "float32", 8, 4, "rev")
FAKE = Path(__file__).with_name("fake_producer.py")


def wait_until(pred, what: str, timeout_s: float = 30.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def pool():
    """(make, pool): make(n_items, lease_timeout_s) starts the pool's dispatcher over n_items micro-batches of one
    rank; spawn(pool, *actions) starts a local fake producer. Everything is stopped at the end."""
    p = FeaturePool()
    p.stop_grace_s = 5.0

    def make(n_items: int = 1, lease_timeout_s: float = 60.0):
        p.dispatcher = Dispatcher(iter([(0, g, _mb(g), 0) for g in range(n_items)]), SPEC, store=RemovalLog(),
                                  segments=["seg-0"], budget_bytes=10**9, max_ahead=16,
                                  lease_timeout_s=lease_timeout_s, heartbeat_s=0.1, put_release_s=0.2).start()
        return p

    yield make
    p.end_local()
    if p.dispatcher is not None:
        p.dispatcher.stop()


def spawn(p: FeaturePool, *actions: str) -> subprocess.Popen:
    i = len(p.procs)
    proc = subprocess.Popen([sys.executable, str(FAKE), p.dispatcher.url, f"local-{i}", *actions],
                            stdin=subprocess.DEVNULL)
    p.procs.append(proc)
    p.logs.append(f"producer-{i}.log")
    return proc


def registration(p: FeaturePool, proc: subprocess.Popen):
    """The dispatcher's latest registration of `proc`, or None."""
    with p.dispatcher._lock:
        regs = [r for r in p.dispatcher.producers.values() if r.info.get("pid") == proc.pid]
    return regs[-1] if regs else None


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)  # dead before the report: no timing left to the kernel


def by_pid(report: dict) -> dict:
    entries = report["producers"]
    assert len(entries) == len({e["pid"] for e in entries}), entries  # one entry per process
    return {e["pid"]: e for e in entries}


def assert_killed(e: dict, *, registered: bool) -> None:
    assert e["alive"] is False and e["state"] == "dead" and e["local"], e
    assert "signal 9" in e["observed"] and "signal 9" in e["process"], e
    assert e["registered"] is registered and bool(e["registrations"]) is registered, e
    assert ("never registered" in e["observed"]) is not registered, e


def test_killed_before_it_registered_is_dead_beside_a_producer_that_finished(pool):
    p = pool(n_items=2)
    loading = spawn(p, "block")  # a real producer loads the target before it registers: killed there
    worker = spawn(p, "register", "serve")
    kill(loading)
    wait_until(lambda: p.dispatcher.stats["completed"] == 2, "the other producer's two objects")
    assert registration(p, loading) is None  # the dispatcher never heard of it
    rep = by_pid(p.producer_report())
    assert list(rep) == [loading.pid, worker.pid]  # in the order the pool started them
    assert_killed(rep[loading.pid], registered=False)
    assert rep[loading.pid]["name"] == "local-0" and rep[loading.pid]["completed"] == 0
    w = rep[worker.pid]  # told there was no more work, it exited 0
    assert w["state"] == "finished" and w["alive"] is False and "status 0" in w["observed"]
    assert w["completed"] == 2 and w["rows"] == 2 and w["registered"] and w["last_seen_at"]


def test_killed_after_registering_before_the_dispatcher_noticed(pool):
    p = pool(n_items=1, lease_timeout_s=60.0)
    proc = spawn(p, "register", "block")
    wait_until(lambda: registration(p, proc), "its registration")
    kill(proc)
    assert registration(p, proc).alive  # silent for less than lease_timeout_s: not declared dead
    assert_killed(by_pid(p.producer_report())[proc.pid], registered=True)


def test_killed_holding_the_lease_of_the_last_micro_batch(pool):
    p = pool(n_items=1, lease_timeout_s=60.0)
    proc = spawn(p, "register", "lease", "block")
    wait_until(lambda: registration(p, proc) and registration(p, proc).leases, "its lease")
    kill(proc)
    assert [i.state for i in p.dispatcher.items.values()] == ["leased"]  # still leased to the dead one
    e = by_pid(p.producer_report())[proc.pid]
    assert_killed(e, registered=True)
    assert e["leases"] == 1 and e["completed"] == 0


def test_killed_after_its_last_object_was_consumed(pool):
    p = pool(n_items=1, lease_timeout_s=60.0)
    proc = spawn(p, "register", "lease", "complete", "block")
    wait_until(lambda: p.dispatcher.stats["completed"] == 1, "its object")
    post(p.dispatcher.url, "/consumed", {"epoch": 0, "index": 0})  # the last step trained
    kill(proc)
    e = by_pid(p.producer_report())[proc.pid]
    assert_killed(e, registered=True)
    assert e["completed"] == 1 and e["rows"] == 1 and e["leases"] == 0


def test_killed_after_the_dispatcher_declared_it_dead(pool):
    p = pool(n_items=1, lease_timeout_s=0.3)
    proc = spawn(p, "register", "lease", "block")  # leases, then is silent: no heartbeat
    wait_until(lambda: registration(p, proc) and not registration(p, proc).alive, "the dispatcher's declaration")
    kill(proc)
    assert [(i.state, i.attempts) for i in p.dispatcher.items.values()] == [("pending", 1)]  # its lease came back
    e = by_pid(p.producer_report())[proc.pid]
    assert_killed(e, registered=True)
    assert "the dispatcher: dead: silent for over 0.3 s, declared dead at" in e["observed"]  # both sources, with when


def test_declared_dead_then_back_is_one_producer_with_its_last_state(pool):
    p = pool(n_items=1, lease_timeout_s=0.3)
    proc = spawn(p, "register", "wait-dead", "serve")  # silent until declared dead, then registers again
    wait_until(lambda: p.dispatcher.stats["completed"] == 1, "its object, after registering again")
    rep = by_pid(p.producer_report())
    e = rep[proc.pid]
    assert len(e["registrations"]) == 2 and e["id"] == e["registrations"][-1]
    assert e["state"] == "finished" and e["completed"] == 1 and e["rows"] == 1


def test_a_producer_that_does_not_exit_when_told_is_stopped_by_the_pool(pool):
    p = pool(n_items=1)
    p.stop_grace_s = 0.3
    proc = spawn(p, "register", "block")
    wait_until(lambda: registration(p, proc), "its registration")
    e = by_pid(p.producer_report())[proc.pid]
    assert e["state"] == "stopped" and e["alive"] is False and "SIGTERM" in e["observed"]
    assert "signal 15" in e["process"] and p.ended_by_pool == {proc.pid: "SIGTERM"}


def test_the_roster_merges_the_dispatcher_and_the_pool_views():
    """The pure merge: producers started elsewhere keep the dispatcher's view (it cannot know more), a local
    process still loading is `starting`, one still running keeps the dispatcher's liveness."""
    host = socket.gethostname()

    def reg(id_, pid, host_, state="alive_as_last_observed", **kw):
        return {"id": id_, "pid": pid, "host": host_, "alive": state != "dead", "state": state,
                "last_seen_at": "2026-01-01T00:00:00.000Z", "observed": f"{state} (dispatcher)", "leases": 0,
                "completed": 1, "rows": 2, "failed": 0, "busy_s": 0.5, "cpu_s": 0.25, **kw}

    regs = [reg("p0-elsewhere-7", 7, "elsewhere", state="dead"), reg("p1-%s-11" % host, 11, host),
            reg("p2-elsewhere-7", 7, "elsewhere"), reg("p3-other-7", 7, "other")]
    local = [{"name": "local-0", "pid": 10, "log": "a.log", "returncode": None, "ended_by_pool": None},
             {"name": "local-1", "pid": 11, "log": "b.log", "returncode": None, "ended_by_pool": None}]
    out = final_producers(regs, local, host=host, now=0.0)
    assert [(e["host"], e["pid"]) for e in out] == [(host, 10), (host, 11), ("elsewhere", 7), ("other", 7)]
    starting, running, remote, other = out
    assert starting["state"] == "starting" and starting["alive"] and not starting["registered"]
    assert starting["process"].startswith("running at 1970-01-01T00:00:00.000Z") and starting["engine"] is None
    assert running["state"] == "alive_as_last_observed" and running["alive"] and running["log"] == "b.log"
    # re-registered elsewhere: one entry, the last registration's state, counters summed over both
    assert remote["registrations"] == ["p0-elsewhere-7", "p2-elsewhere-7"] and remote["alive"]
    assert (remote["completed"], remote["rows"], remote["busy_s"], remote["local"]) == (2, 4, 1.0, False)
    assert other["registrations"] == ["p3-other-7"] and other["completed"] == 1
