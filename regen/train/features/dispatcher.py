"""The feature dispatcher: leases the trainer's micro-batches to producers, in the feed's order, within a byte budget.

Runs in trainer rank 0 (`regen.train.trainer`), as an HTTP/JSON server (stdlib `ThreadingHTTPServer`; `host`
127.0.0.1 unless a cluster's producers must reach it). Only the control plane passes through it: token ids of a
micro-batch to its producer, then the key, size and header of the object the producer put in the store. Feature
bytes go producer -> store -> trainer rank (`regen.train.features.store`).

The work is exactly what the trainer consumes: a `ShardFeed` with the trainer's settings and resume position
enumerates the global micro-batches (rows cut by `truncate`/`max_len`, shuffled, bucketed, padded, the feed's
order), each a `WorkItem` for the rank that consumes it, up to the schedule's last step; a trailing partial step
of an epoch, which the trainer drops, is dropped here too.

Leases (SpecForge's model, ../shared/docs/online-target-facts.md §2): a producer leases the lowest-numbered
pending item whose object fits the budget (strict order, so the item a rank waits for is never behind later
ones); it heartbeats every `heartbeat_s`; a producer silent for `lease_timeout_s` is dead and its leases return
to the pool for the others. A producer that reports a failure, or dies holding the lease, costs the item one
attempt; after `max_attempts` the item is `failed` and its consumer applies `on_failure` (stop, naming it, or
zero its loss mask). A trainer rank asks `/wait` for its item (long-poll), reads the object from the store, then
`/consumed` removes it. Nothing needs a durable ledger: the trainer's checkpoint holds the feed position, so a
resumed run re-plans exactly the micro-batches after it (objects of the killed run are removed at start, by key
prefix: `namespace`).

Budget: bytes of objects leased, ready or possibly half-written by a producer that died (held for
`put_release_s`, Mooncake's `put_start_release_timeout_sec`, until the store frees them) never exceed
`budget_bytes`, so the store's own `master_allocated_bytes` stays within it too.
"""
from __future__ import annotations

import base64
import itertools
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

from regen.train.features.contract import FeatureSpec, object_nbytes

log = logging.getLogger(__name__)


@dataclass
class WorkItem:
    """One global micro-batch: `seq` its place in the plan, `rank` the trainer rank that consumes it."""

    seq: int
    epoch: int
    index: int
    rank: int
    sample_ids: list[str]
    input_ids: object  # torch.LongTensor [B, S]
    attention_mask: object  # torch.BoolTensor [B, S]
    nbytes: int
    state: str = "pending"  # pending | leased | ready | failed | dropped
    attempts: int = 0
    failures: list[str] = field(default_factory=list)
    lease_id: int | None = None
    key: str | None = None
    header: dict | None = None
    producer: str | None = None
    t_planned: float = field(default_factory=time.monotonic)
    t_ready: float | None = None


@dataclass
class Producer:
    id: str
    info: dict
    last_seen: float
    leases: set = field(default_factory=set)
    completed: int = 0
    rows: int = 0
    failed: int = 0
    busy_s: float = 0.0
    cpu_s: float = 0.0
    alive: bool = True
    dead_at: float | None = None  # monotonic time it was declared dead


class Dispatcher:
    """Plan, lease, account (see the module docstring). `stream` yields (epoch, index, MicroBatch, rank) in plan
    order and may block (follow mode); `store` is a `StoreClient` used to remove objects."""

    def __init__(self, stream: Iterator, spec: FeatureSpec, *, store, segments: list[str | None], budget_bytes: int,
                 max_ahead: int, max_attempts: int = 3, lease_timeout_s: float = 15.0, heartbeat_s: float = 1.0,
                 put_release_s: float = 15.0, store_info: dict | None = None, host: str = "127.0.0.1",
                 port: int = 0, session: str | None = None):
        import uuid

        self.spec, self.store, self.segments = spec, store, segments
        self.budget_bytes, self.max_ahead, self.max_attempts = int(budget_bytes), int(max_ahead), int(max_attempts)
        self.lease_timeout_s, self.heartbeat_s, self.put_release_s = lease_timeout_s, heartbeat_s, put_release_s
        self.store_info = store_info or {}
        self.session = session or uuid.uuid4().hex[:12]
        self._stream = stream
        self._lock = threading.Condition()
        self.items: OrderedDict[int, WorkItem] = OrderedDict()  # seq -> item, not yet consumed or dropped
        self._by_key: dict[tuple[int, int], WorkItem] = {}
        self.producers: dict[str, Producer] = {}
        self._leases: dict[int, tuple[WorkItem, str, int]] = {}  # lease id -> (item, producer, bytes)
        self._quarantine: list[tuple[float, int, str]] = []  # (until, bytes, key) of leases whose producer died
        self._lease_ids = itertools.count(1)
        self._planned = 0
        self.plan_done = False
        self.plan_error: str | None = None
        self.stopping = False
        self.t_start = time.monotonic()
        self.t_last_alive = self.t_start
        self.ever_registered = False
        self.stats = {"planned": 0, "leased": 0, "completed": 0, "stale_completions": 0, "failures": 0,
                      "lease_expiries": 0, "items_failed": 0, "rows_completed": 0, "consumed": 0, "dropped": 0,
                      "bytes_consumed": 0, "max_accounted_bytes": 0, "producer_busy_s": 0.0, "wait_s": 0.0}
        self._server = _Server((host, port), _handler(self))
        self._server.daemon_threads = True
        self.host, self.port = self._server.server_address[:2]
        self._threads = [threading.Thread(target=self._server.serve_forever, name="dispatcher-http", daemon=True),
                         threading.Thread(target=self._plan, name="dispatcher-plan", daemon=True),
                         threading.Thread(target=self._reap, name="dispatcher-reap", daemon=True)]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "Dispatcher":
        for t in self._threads:
            t.start()
        log.info("feature dispatcher on %s (session %s, budget %.1f MiB, %d ahead)", self.url, self.session,
                 self.budget_bytes / 2**20, self.max_ahead)
        return self

    def stop(self) -> None:
        with self._lock:
            self.stopping = True
            self._lock.notify_all()
        self._server.shutdown()
        self._server.server_close()

    # -- accounting -----------------------------------------------------------------------------------------
    def accounted_bytes(self) -> int:
        """Bytes the store may hold for this run now: leased + ready + quarantined (see the module docstring)."""
        return (sum(b for _, _, b in self._leases.values()) + sum(q[1] for q in self._quarantine)
                + sum(i.nbytes for i in self.items.values() if i.state == "ready"))

    def _quarantine_lease(self, lid: int, nbytes: int, key: str, hold_s: float) -> None:
        self._quarantine.append((time.monotonic() + hold_s, nbytes, key))
        self.store.remove([key])

    def _prune_quarantine(self, now: float) -> None:
        keep = []
        for until, nbytes, key in self._quarantine:
            if until > now:
                keep.append((until, nbytes, key))
            else:
                self.store.remove([key])  # a late put of a producer presumed dead, now released by the store
        self._quarantine = keep

    def live_producers(self) -> int:
        return sum(1 for p in self.producers.values() if p.alive)

    # -- planning -------------------------------------------------------------------------------------------
    def _plan(self) -> None:
        try:
            for epoch, index, mb, rank in self._stream:
                with self._lock:
                    while not self.stopping and len(self.items) >= self.max_ahead:
                        self._lock.wait(0.5)
                    if self.stopping:
                        return
                    B, S = (int(x) for x in mb.input_ids.shape)
                    item = WorkItem(self._planned, epoch, index, rank, list(mb.sample_ids), mb.input_ids,
                                    mb.attention_mask, object_nbytes(B, S, self.spec))
                    if item.nbytes > self.budget_bytes:
                        item.state = "failed"
                        item.failures.append(
                            f"its feature object is {item.nbytes:,} bytes, more than the whole budget of "
                            f"{self.budget_bytes:,}: raise train.producers.budget_bytes or lower train.max_tokens")
                    self._planned += 1
                    self.stats["planned"] += 1
                    self.items[item.seq] = item
                    self._by_key[(epoch, index)] = item
                    self._lock.notify_all()
        except Exception as exc:  # noqa: BLE001 - reported to every waiting rank, then re-raised in the log
            log.exception("feature planning failed")
            with self._lock:
                self.plan_error = f"planning the feature work failed: {type(exc).__name__}: {exc}"
                self._lock.notify_all()
        finally:
            with self._lock:
                self.plan_done = True
                self._lock.notify_all()

    def drop(self, epoch: int, indices) -> None:
        """Micro-batches the trainer will not consume (an epoch's trailing partial step): free them."""
        with self._lock:
            for g in indices:
                item = self._by_key.get((epoch, g))
                if item is not None and item.seq in self.items:
                    self._release(item)
                    self.stats["dropped"] += 1

    # -- leases ---------------------------------------------------------------------------------------------
    def _release(self, item: WorkItem) -> None:
        """Forget an item (consumed or dropped): remove its object and any lease on it."""
        if item.lease_id is not None and item.lease_id in self._leases:
            lid = item.lease_id
            _, pid, nbytes = self._leases.pop(lid)
            if pid in self.producers:
                self.producers[pid].leases.discard(lid)
            # its producer is still writing: count the bytes until its completion is refused and it removes them
            self._quarantine_lease(lid, nbytes, self.key_of(item, lid), self.lease_timeout_s + self.put_release_s)
        if item.key:
            self.store.remove([item.key])
        self.items.pop(item.seq, None)
        self._by_key.pop((item.epoch, item.index), None)
        self._lock.notify_all()

    def _next_for_lease(self) -> WorkItem | None:
        for item in self.items.values():
            if item.state == "pending":
                return item if self.accounted_bytes() + item.nbytes <= self.budget_bytes else None
        return None

    def key_of(self, item: WorkItem, lease_id: int) -> str:
        """The store key of one lease's object: unique per attempt, so a late put never overwrites a newer one."""
        return f"{self.spec.namespace}/e{item.epoch}/i{item.index}/l{lease_id}"

    def lease(self, producer_id: str, wait_s: float) -> dict:
        """The next item for `producer_id` (long-poll up to `wait_s`): {"item": {...}} with its token ids, or
        {"item": None} (nothing fits now), {"done": True} (the plan is finished), {"reregister": True}."""
        import torch

        deadline = time.monotonic() + max(0.0, wait_s)
        with self._lock:
            while True:
                p = self.producers.get(producer_id)
                if p is None or not p.alive:
                    return {"item": None, "reregister": True}
                p.last_seen = time.monotonic()
                if self.stopping:
                    return {"item": None, "done": True}
                item = self._next_for_lease()
                if item is not None:
                    break
                if self.plan_done and not any(i.state in ("pending", "leased") for i in self.items.values()):
                    return {"item": None, "done": True}
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"item": None}
                self._lock.wait(min(left, 0.5))
            lid = next(self._lease_ids)
            item.state, item.lease_id = "leased", lid
            key = self.key_of(item, lid)
            self._leases[lid] = (item, producer_id, item.nbytes)
            p.leases.add(lid)
            self.stats["leased"] += 1
            self.stats["max_accounted_bytes"] = max(self.stats["max_accounted_bytes"], self.accounted_bytes())
            ids = item.input_ids.to(dtype=torch.int32).contiguous().numpy()
            mask = item.attention_mask.to(dtype=torch.uint8).contiguous().numpy()
            return {"item": {
                "lease_id": lid, "key": key, "epoch": item.epoch, "index": item.index, "attempt": item.attempts,
                "sample_ids": item.sample_ids, "shape": list(ids.shape), "nbytes": item.nbytes,
                "input_ids_b64": base64.b64encode(ids.astype("<i4").tobytes()).decode(),
                "attention_mask_b64": base64.b64encode(mask.tobytes()).decode(),
                "preferred_segment": self.segments[item.rank] if item.rank < len(self.segments) else None}}

    def complete(self, producer_id: str, lease_id: int, key: str, header: dict, busy_s: float,
                 cpu_s: float = 0.0) -> dict:
        with self._lock:
            entry = self._leases.pop(lease_id, None)
            p = self.producers.get(producer_id)
            if p is not None:
                p.leases.discard(lease_id)
                p.busy_s += busy_s
                p.cpu_s += cpu_s
                p.last_seen = time.monotonic()
            self.stats["producer_busy_s"] += busy_s
            if entry is None or entry[0].state != "leased" or entry[0].lease_id != lease_id:
                self.stats["stale_completions"] += 1
                self._lock.notify_all()
                return {"ok": False, "reason": "stale lease: the item was re-leased, finished or dropped; remove "
                                                "your object"}
            item = entry[0]
            item.state, item.key, item.header, item.producer = "ready", key, header, producer_id
            item.t_ready = time.monotonic()
            if p is not None:
                p.completed += 1
                p.rows += len(item.sample_ids)
            self.stats["completed"] += 1
            self.stats["rows_completed"] += len(item.sample_ids)
            self._lock.notify_all()
            return {"ok": True}

    def fail(self, producer_id: str, lease_id: int, reason: str) -> dict:
        with self._lock:
            entry = self._leases.pop(lease_id, None)
            p = self.producers.get(producer_id)
            if p is not None:
                p.leases.discard(lease_id)
                p.failed += 1
            self.stats["failures"] += 1
            if entry is not None and entry[0].lease_id == lease_id and entry[0].state == "leased":
                self._retry_or_fail(entry[0], f"producer {producer_id}: {reason}")
            self._lock.notify_all()
            return {"ok": True}

    def _retry_or_fail(self, item: WorkItem, reason: str) -> None:
        item.attempts += 1
        item.failures.append(reason)
        item.lease_id = None
        if item.attempts >= self.max_attempts:
            item.state = "failed"
            self.stats["items_failed"] += 1
            log.warning("micro-batch %d:%d failed on %d attempts: %s", item.epoch, item.index, item.attempts,
                        "; ".join(item.failures))
        else:
            item.state = "pending"

    # -- producers ------------------------------------------------------------------------------------------
    def register(self, info: dict) -> dict:
        with self._lock:
            pid = f"p{len(self.producers)}-{info.get('host', '?')}-{info.get('pid', '?')}"
            self.producers[pid] = Producer(pid, dict(info), time.monotonic())
            self.ever_registered = True
            self.t_last_alive = time.monotonic()
            self._lock.notify_all()
            log.info("producer %s registered (%s %s)", pid, info.get("engine"), info.get("engine_version"))
            return {"producer_id": pid, "session": self.session, "config": self.config()}

    def heartbeat(self, producer_id: str) -> dict:
        with self._lock:
            p = self.producers.get(producer_id)
            if p is None or not p.alive:
                return {"ok": False, "reregister": True}
            p.last_seen = time.monotonic()
            return {"ok": True, "stop": self.stopping}

    def _reap(self) -> None:
        while not self.stopping:
            time.sleep(min(0.5, self.heartbeat_s))
            with self._lock:
                now = time.monotonic()
                for p in self.producers.values():
                    if p.alive and now - p.last_seen > self.lease_timeout_s:
                        p.alive, p.dead_at = False, now
                        log.warning("producer %s silent for %.0f s: dead; its %d lease(s) go back to the pool",
                                    p.id, now - p.last_seen, len(p.leases))
                        for lid in list(p.leases):
                            item, _, nbytes = self._leases.pop(lid)
                            self._quarantine_lease(lid, nbytes, self.key_of(item, lid), self.put_release_s)
                            self.stats["lease_expiries"] += 1
                            if item.lease_id == lid and item.state == "leased":
                                self._retry_or_fail(item, f"producer {p.id} died holding its lease")
                        p.leases.clear()
                if self.live_producers():
                    self.t_last_alive = now
                self._prune_quarantine(now)
                self._lock.notify_all()

    # -- consumers ------------------------------------------------------------------------------------------
    def wait(self, epoch: int, index: int, timeout_s: float) -> dict:
        t0 = time.monotonic()
        deadline = t0 + max(0.0, timeout_s)
        with self._lock:
            while True:
                item = self._by_key.get((epoch, index))
                if item is not None and item.state == "ready":
                    self.stats["wait_s"] += time.monotonic() - t0
                    return {"status": "ready", "key": item.key, "nbytes": item.nbytes, "header": item.header,
                            "producer": item.producer}
                if item is not None and item.state == "failed":
                    return {"status": "failed", "reason": "; ".join(item.failures), "sample_ids": item.sample_ids}
                if self.plan_error:
                    return {"status": "error", "reason": self.plan_error}
                if item is None and self.plan_done:
                    return {"status": "error", "reason": f"micro-batch {epoch}:{index} is not in the plan"}
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stats["wait_s"] += time.monotonic() - t0
                    return {"status": "pending", "live_producers": self.live_producers(),
                            "no_producer_s": 0.0 if self.live_producers() else time.monotonic() - self.t_last_alive,
                            "ever_registered": self.ever_registered}
                self._lock.wait(min(left, 0.5))

    def consumed(self, epoch: int, index: int) -> dict:
        with self._lock:
            item = self._by_key.get((epoch, index))
            if item is not None:
                self.stats["consumed"] += 1
                if item.state == "ready":
                    self.stats["bytes_consumed"] += item.nbytes
                self._release(item)
            return {"ok": True}

    # -- views ----------------------------------------------------------------------------------------------
    def config(self) -> dict:
        return {"session": self.session, "spec": self.spec.to_dict(), "store": self.store_info,
                "heartbeat_s": self.heartbeat_s, "lease_timeout_s": self.lease_timeout_s}

    def status(self) -> dict:
        with self._lock:
            states = {}
            for i in self.items.values():
                states[i.state] = states.get(i.state, 0) + 1
            return {"session": self.session, "url": self.url, "plan_done": self.plan_done, "items": states,
                    "accounted_bytes": self.accounted_bytes(), "budget_bytes": self.budget_bytes,
                    "stats": dict(self.stats), "elapsed_s": time.monotonic() - self.t_start,
                    "producers": [{"id": p.id, **self._liveness(p), "leases": len(p.leases),
                                   "completed": p.completed, "rows": p.rows, "failed": p.failed,
                                   "busy_s": round(p.busy_s, 3), "cpu_s": round(p.cpu_s, 3), "pid": p.info.get("pid"),
                                   "host": p.info.get("host"), "name": p.info.get("name"),
                                   "engine": p.info.get("engine")}
                                  for p in self.producers.values()]}

    def _liveness(self, p: Producer) -> dict:
        """What the dispatcher knows of `p`, never more: `alive` (not yet declared dead), `state` ("dead", or
        "alive_as_last_observed"), `last_seen_at` (UTC wall time of its last message), `silent_s` and `observed`
        (one sentence with the times). A producer killed less than `lease_timeout_s` ago still reads
        alive_as_last_observed, with the time it was last heard from."""
        now_m, now_w = time.monotonic(), time.time()
        seen = _iso(now_w - (now_m - p.last_seen))
        silent = round(now_m - p.last_seen, 3)
        if not p.alive:
            dead = _iso(now_w - (now_m - (p.dead_at or now_m)))
            return {"alive": False, "state": "dead", "last_seen_at": seen, "silent_s": silent,
                    "observed": f"dead: silent for over {self.lease_timeout_s:g} s, declared dead at {dead} (last "
                                f"heard from at {seen})"}
        return {"alive": True, "state": "alive_as_last_observed", "last_seen_at": seen, "silent_s": silent,
                "observed": f"alive as last observed at {seen} ({silent:.1f} s before this report; declared dead "
                            f"after {self.lease_timeout_s:g} s of silence)"}


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # a dropped connection is a dead peer, not a server fault
        log.debug("dispatcher: connection from %s ended abruptly", client_address, exc_info=True)


def _handler(d: Dispatcher):
    routes = {
        ("GET", "/config"): lambda q: d.config(),
        ("GET", "/status"): lambda q: d.status(),
        ("POST", "/register"): lambda q: d.register(q),
        ("POST", "/heartbeat"): lambda q: d.heartbeat(q["producer_id"]),
        ("POST", "/lease"): lambda q: d.lease(q["producer_id"], float(q.get("wait_s", 0))),
        ("POST", "/complete"): lambda q: d.complete(q["producer_id"], int(q["lease_id"]), q["key"], q["header"],
                                                    float(q.get("busy_s", 0)), float(q.get("cpu_s", 0))),
        ("POST", "/fail"): lambda q: d.fail(q["producer_id"], int(q["lease_id"]), str(q.get("reason", ""))[:2000]),
        ("POST", "/wait"): lambda q: d.wait(int(q["epoch"]), int(q["index"]), float(q.get("timeout_s", 0))),
        ("POST", "/consumed"): lambda q: d.consumed(int(q["epoch"]), int(q["index"])),
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # requests are not logged: producers poll
            pass

        def _serve(self, method: str) -> None:
            route = routes.get((method, self.path.split("?")[0]))
            if route is None:
                return self._send(404, {"error": f"no route {method} {self.path}"})
            try:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else {}
                return self._send(200, route(body))
            except (KeyError, ValueError, TypeError) as exc:
                return self._send(400, {"error": f"{type(exc).__name__}: {exc}"})

        def _send(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the caller died (a killed producer): nothing to say
                self.close_connection = True

        def do_GET(self):  # noqa: N802
            self._serve("GET")

        def do_POST(self):  # noqa: N802
            self._serve("POST")

    return Handler


def post(url: str, path: str, body: dict | None = None, timeout_s: float = 30.0) -> dict:
    """POST (or GET when body is None) JSON to a dispatcher; raises OSError when it cannot be reached."""
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def _iso(t: float) -> str:
    """UTC wall time `t` (s since the epoch) as 2026-12-02T11:52:03.120Z."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int((t % 1) * 1000):03d}Z"
