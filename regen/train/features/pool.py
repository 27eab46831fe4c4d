"""The trainer's side of the producer path, set up and torn down in one place: store, dispatcher, local producers.

`FeaturePool.start(...)` is collective (every trainer rank calls it):

1. sizes: the largest object (`train.max_tokens` padded tokens of `max_batch` rows), the byte budget, each rank's
   segment and transfer buffer; a budget or segment too small for one object is an InputError here, before any
   work;
2. the store: rank 0 starts a local `mooncake_master` on loopback (`store.master: local`) or takes the named one;
   every rank connects and mounts its segment; rank 0 removes objects an earlier (killed) run of the same
   training directory left under this run's key prefix;
3. rank 0 starts the dispatcher (`regen.train.features.dispatcher`) over its own copy of the feed at the resume
   position and writes `<train dir>/features/dispatcher.json` (URL, session, store) for producers started
   elsewhere;
4. rank 0 starts `producers.num_local` producer processes (`regen.train.features.producer`, the train.target
   checkpoint, logs in `<train dir>/features/producer-N.log`), which die with it;
5. every rank gets a `RemoteFeatures` on the dispatcher's URL.

`close()` ends the producers, removes this run's objects, stops the dispatcher and the master. `report()` is the
producer/trainer balance for the log and summary: data-wait fraction, feature bytes/s, rows/s each side can do,
and (rank 0) every producer ever started or registered with its final state: it ends the local producers first,
since the run's work is done (`producer_report`, `regen.train.features.roster`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from regen.errors import InputError
from regen.train.features.contract import _PREFIX, FeatureSpec, header_reserve

log = logging.getLogger(__name__)
MIN_SEGMENT_BYTES = 16 << 20  # Mooncake refuses smaller segments (client_buffer_allocation.cpp)


def expanded(value: str | None, field: str) -> str | None:
    """`value` with ${ENV} expanded; InputError naming `field` when a variable is unset."""
    if value is None:
        return None
    out = os.path.expandvars(str(value))
    if "$" in out:
        raise InputError(f"train.producers.{field}={value!r} names an unset environment variable: export it")
    return out


def host_address(toward: str | None = None, *, field: str = "an auto address") -> str:
    """This host's address as other nodes see it, for `auto` settings: the source address of the route toward
    `toward` (the master's host; connecting a UDP socket sends nothing), else the host name resolved.

    Raises InputError when the result is a loopback address (127.x, ::1; Debian images map the host name to
    127.0.1.1): other nodes could not reach it. `field` names the setting in the message.
    """
    import ipaddress
    import socket

    addr = None
    if toward:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.connect((toward, 9))
                addr = sock.getsockname()[0]
        except OSError:
            addr = None
    if not addr or ipaddress.ip_address(addr).is_loopback:
        try:
            addr = socket.gethostbyname(socket.gethostname())
        except OSError as exc:
            raise InputError(f"{field}=auto: this host's name does not resolve ({exc}); set {field} to the address "
                             "other nodes reach this host at") from None
    if ipaddress.ip_address(addr).is_loopback:
        raise InputError(f"{field}=auto resolves to the loopback address {addr} (the host name maps to it, e.g. "
                         "127.0.1.1 in /etc/hosts), which other nodes cannot reach: set " + field + " to this "
                         "host's address on the network the inference nodes use (e.g. ${POD_IP})")
    return addr


def resolve_addresses(pcfg, master: str, metrics_url: str | None) -> tuple[str, str | None, str]:
    """(metrics URL, client hostname, dispatcher host) with `auto` resolved against the master's address: on
    loopback for a loopback master (a local run), else the address routing toward the master, never loopback
    (`host_address`)."""
    master_host = master.rsplit(":", 1)[0] if ":" in master else master
    loopback = master.startswith(("127.", "localhost"))
    hostname = expanded(pcfg.store.hostname, "store.hostname")
    if hostname == "auto":
        hostname = "127.0.0.1" if loopback else host_address(master_host, field="train.producers.store.hostname")
    if metrics_url == "auto":
        metrics_url = f"http://{master_host}:9003/metrics"
    dhost = expanded(pcfg.dispatcher_host, "dispatcher_host")
    if dhost == "auto":
        dhost = "127.0.0.1" if loopback else host_address(master_host, field="train.producers.dispatcher_host")
    return metrics_url, hostname, dhost


def sizes_for(pcfg, spec_num_taps: int, hidden: int, dtype: str, world_size: int, max_tokens: int,
              max_batch: int) -> dict:
    """Object, budget, segment and buffer sizes of a pool (bytes), checked. Raises InputError naming the setting
    that cannot hold one feature object."""
    from regen.train.features.contract import DTYPES

    largest = _PREFIX.size + header_reserve(max_batch) + max_tokens * (spec_num_taps + 1) * hidden * DTYPES[dtype]
    budget = pcfg.budget_bytes or 8 * largest
    seg = pcfg.store.segment_bytes_per_rank
    seg = max(MIN_SEGMENT_BYTES, -(-budget // world_size) + largest) if seg is None else seg
    buf = pcfg.store.local_buffer_bytes or max(64 << 20, 2 * largest)
    fix = "raise train.producers.budget_bytes (or lower train.max_tokens)"
    if budget < largest:
        raise InputError(f"train.producers.budget_bytes={budget:,} is smaller than one feature object: a micro-"
                         f"batch of train.max_tokens={max_tokens} tokens is {largest:,} bytes "
                         f"({spec_num_taps + 1} states x {hidden} x {dtype}); {fix}")
    if 0 < seg < max(largest, MIN_SEGMENT_BYTES):
        raise InputError(f"train.producers.store.segment_bytes_per_rank={seg:,} cannot hold one feature object "
                         f"of {largest:,} bytes (and Mooncake needs at least {MIN_SEGMENT_BYTES:,}): raise it, or "
                         "leave it null (its share of the budget)")
    if buf < largest:
        raise InputError(f"train.producers.store.local_buffer_bytes={buf:,} cannot hold one feature object of "
                         f"{largest:,} bytes: raise it or leave it null")
    return {"largest_object_bytes": largest, "budget_bytes": budget, "segment_bytes_per_rank": seg,
            "local_buffer_bytes": buf}


def namespace_for(train_dir: Path) -> str:
    """The store key prefix of one training directory: the same across restarts, so a resumed run finds what a
    killed one left."""
    return "regen/" + hashlib.sha256(str(Path(train_dir).resolve()).encode()).hexdigest()[:16]


class _StoreWatch(threading.Thread):
    """Rank 0: the store's own allocated bytes (master metrics), sampled every `period_s`: max and series."""

    def __init__(self, metrics_url: str, period_s: float = 0.25):
        super().__init__(name="store-watch", daemon=True)
        self.metrics_url, self.period_s = metrics_url, period_s
        self.max_allocated = 0.0
        self.samples: list[tuple[float, float]] = []
        self.stop_event = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        from regen.train.features.store import store_metrics

        while not self.stop_event.wait(self.period_s):
            try:
                m = store_metrics(self.metrics_url, timeout_s=2.0)
            except OSError:
                continue
            a = m.get("allocated_bytes", 0.0)
            self.max_allocated = max(self.max_allocated, a)
            if len(self.samples) < 20000:
                self.samples.append((round(time.monotonic() - self.t0, 3), a))


class FeaturePool:
    """See the module docstring. Attributes: `features` (RemoteFeatures, every rank), `dispatcher` (rank 0)."""

    def __init__(self):
        self.master = self.store = self.dispatcher = self.features = self.watch = None
        self.procs: list[subprocess.Popen] = []
        self.logs: list[str] = []  # each local producer's log file, by index
        self.ended_by_pool: dict[int, str] = {}  # pid -> "SIGTERM" / "SIGKILL": local producers the pool ended
        self.stop_grace_s = 10.0  # how long local producers get to exit once told there is no more work
        self.info = None
        self.sizes: dict = {}
        self.zeroed: list[dict] = []
        self.submitted_ahead = 0  # steps the loop submitted while the one before computed (read across steps)
        self.on_failure = "error"

    @classmethod
    def start(cls, pcfg, *, info, spec: FeatureSpec, head, plan_feed, num_epochs, num_steps: int, max_tokens: int,
              max_batch: int, train_dir: Path, target_path: str) -> "FeaturePool":
        from regen.train.collectives import control_all_gather_object, control_broadcast_object_list
        from regen.train.features.client import RemoteFeatures
        from regen.train.features.dispatcher import Dispatcher
        from regen.train.features.store import MooncakeMaster, StoreClient

        pool = cls()
        pool.info = info
        W = info.world_size
        pool.sizes = sizes_for(pcfg, spec.num_taps, spec.target_hidden_size, spec.dtype, W, max_tokens, max_batch)
        budget, seg, buf = (pool.sizes[k] for k in ("budget_bytes", "segment_bytes_per_rank", "local_buffer_bytes"))
        largest = pool.sizes["largest_object_bytes"]
        train_dir = Path(train_dir)
        fdir = train_dir / "features"
        try:
            master_addr, metrics_url = expanded(pcfg.store.master, "store.master"), \
                expanded(pcfg.store.metrics_url, "store.metrics_url")
            if info.is_main:
                fdir.mkdir(parents=True, exist_ok=True)
                if master_addr == "local":
                    pool.master = MooncakeMaster(fdir / "mooncake_master.log").start()
                    master_addr = pool.master.address
                    metrics_url = pool.master.metrics_url if metrics_url == "auto" else metrics_url
            box = [(master_addr, metrics_url)]
            if W > 1:
                control_broadcast_object_list(box, src=0)
            master_addr, metrics_url = box[0]
            metrics_url, hostname, dispatcher_host = resolve_addresses(pcfg, master_addr, metrics_url)
            pool.store = StoreClient(master_addr, segment_bytes=seg, local_buffer_bytes=buf,
                                     protocol=pcfg.store.protocol, hostname=hostname,
                                     device=pcfg.store.device)
            segments = [None] * W
            if W > 1:
                control_all_gather_object(segments, pool.store.segment)
            else:
                segments = [pool.store.segment]
            url = None
            if info.is_main:
                left = pool.store.remove_prefix(spec.namespace + "/")
                if left:
                    log.warning("removed %d feature object(s) an earlier run of %s left in the store", left, train_dir)
                pool.sizes["objects_left_by_earlier_run"] = left
                store_info = {"master": master_addr, "protocol": pcfg.store.protocol,
                              "local_buffer_bytes": buf, "target": str(target_path), "metrics_url": metrics_url}
                holder = {}
                stream = plan_feed.plan(num_epochs, num_steps, lambda e, r: holder["d"].drop(e, r))
                pool.dispatcher = holder["d"] = Dispatcher(
                    stream, spec, store=pool.store, segments=segments, budget_bytes=budget,
                    max_ahead=pcfg.max_ahead, max_attempts=pcfg.max_attempts, lease_timeout_s=pcfg.lease_timeout_s,
                    heartbeat_s=pcfg.heartbeat_s, put_release_s=pcfg.store.put_release_s, store_info=store_info,
                    host=dispatcher_host, port=pcfg.dispatcher_port).start()
                url = pool.dispatcher.url
                from schemas.io import write_json_atomic

                write_json_atomic({"url": url, "session": pool.dispatcher.session, "namespace": spec.namespace,
                                   "store": store_info, "pid": os.getpid()}, fdir / "dispatcher.json")
                if metrics_url:
                    pool.watch = _StoreWatch(metrics_url)
                    pool.watch.start()
                pool._spawn_local(pcfg, url, fdir)
            box = [url]
            if W > 1:
                control_broadcast_object_list(box, src=0)
            pool.features = RemoteFeatures(box[0], pool.store, spec, head, info.device,
                                           no_producer_timeout_s=pcfg.no_producer_timeout_s,
                                           startup_timeout_s=pcfg.startup_timeout_s, read_ahead=pcfg.read_ahead,
                                           on_failure=pcfg.on_failure)
        except BaseException:
            pool.close()
            raise
        log.info("feature pool: budget %.1f MiB, largest object %.2f MiB, %d local producer(s), dispatcher %s",
                 budget / 2**20, largest / 2**20, pcfg.num_local if info.is_main else 0, box[0])
        return pool

    def _spawn_local(self, pcfg, url: str, fdir: Path) -> None:
        from regen.train.features.store import die_with_parent, env_for_children

        env = env_for_children()
        if pcfg.local_threads:
            env["OMP_NUM_THREADS"] = str(pcfg.local_threads)
        for i in range(pcfg.num_local):
            cmd = [sys.executable, "-m", "regen.train.features.producer", "--dispatcher", url, "--name", f"local-{i}",
                   "--device", pcfg.local_device, "--threads", str(pcfg.local_threads),
                   "--max-len", str(pcfg.local_max_len), "--orphan-timeout-s", "30"]
            self.logs.append(str(fdir / f"producer-{i}.log"))
            with open(fdir / f"producer-{i}.log", "ab") as logf:
                self.procs.append(subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                   env=env, preexec_fn=die_with_parent))
        from schemas.io import write_json_atomic

        write_json_atomic([{"name": f"local-{i}", "pid": p.pid, "log": str(fdir / f"producer-{i}.log")}
                           for i, p in enumerate(self.procs)], fdir / "producers.json")
        if self.procs:
            threading.Thread(target=self._watch_local, args=(fdir,), name="local-producers", daemon=True).start()

    def _watch_local(self, fdir: Path) -> None:
        """Every local producer exited with an error before any producer registered: stop the ranks now, with their
        logs' last lines, instead of after startup_timeout_s (a producer that cannot load the target exits at once).
        Producers that registered and then died are left to no_producer_timeout_s: another may still register."""
        d = self.dispatcher
        while d is not None and not d.stopping:
            time.sleep(1.0)
            if d.ever_registered:
                return  # producers that ran and died: train.producers.no_producer_timeout_s (others may register)
            codes = [p.poll() for p in self.procs]
            if any(c is None or c == 0 for c in codes) or d.live_producers():
                continue
            tails = []
            for i, c in enumerate(codes):
                lines = (fdir / f"producer-{i}.log").read_text(errors="replace").strip().splitlines()
                tails.append(f"producer-{i} exited with status {c}: {lines[-1] if lines else '(no output)'}")
            with d._lock:
                d.plan_error = "every local feature producer exited: " + "; ".join(tails)
                d._lock.notify_all()
            return

    @classmethod
    def for_training(cls, cfg, *, info, run, follow: bool, feed_cfg, feed_state: dict, dtype: str, head, contract,
                     train_dir: Path, target_path: str, num_epochs, num_steps: int, heldout=None) -> "FeaturePool":
        """The pool of one `regen train` run (collective): the feature spec from the target's config and
        checkpoint (features in `dtype`), the dispatcher's feed (`feed_cfg`, leaving out what `heldout` holds out,
        as the training feed does) at `feed_state`, the training feed's position after resume."""
        from regen.train.feed import ShardFeed
        from regen.train.target_head import target_revision

        tc = getattr(head.config, "text_config", None) or head.config
        spec = FeatureSpec(namespace_for(train_dir), contract.target_layer_ids, contract.aux_hidden_stream, dtype,
                           int(tc.hidden_size), int(tc.num_hidden_layers), target_revision(target_path))
        plan_feed = None
        if info.is_main:
            plan_feed = ShardFeed(run.shards, feed_cfg, rank=0, world_size=info.world_size,
                                  grad_accum=cfg.grad_accum, follow=follow, heldout=heldout)
            plan_feed.load_state_dict(feed_state)
        pool = cls.start(cfg.producers, info=info, spec=spec, head=head, plan_feed=plan_feed, num_epochs=num_epochs,
                         num_steps=num_steps, max_tokens=cfg.max_tokens, max_batch=cfg.max_batch,
                         train_dir=train_dir, target_path=target_path)
        pool.on_failure = cfg.producers.on_failure
        return pool

    @property
    def read_ahead(self) -> int:
        """train.producers.read_ahead: objects read ahead of compute by the client's reader thread (0: serial)."""
        return getattr(self.features, "read_ahead", 0)

    def submit(self, microbatches, *, ahead: bool = False) -> None:
        """Read-ahead: queue these micro-batches (a step's, in training order) for the reader (not collective);
        `ahead`: the loop's early pull of the next step, counted (`steps_submitted_ahead` in the report)."""
        self.submitted_ahead += int(ahead)
        self.features.submit(microbatches)

    def fetch_step(self, microbatches) -> set[tuple[int, int]]:
        """Fetch one step's features on this rank (collective: every rank learns if any rank must stop). Returns
        the (epoch, index) of micro-batches to train with a zeroed loss mask (`on_failure: zero_loss`).
        With read-ahead: submits the step unless it was (the loop submits the next step while this one computes)
        and returns nothing; failures arrive in the step (`RemoteFeatures.lost`), errors by `raise_if_failed`."""
        from regen.train.collectives import raise_if_any_rank_failed
        from regen.train.features.client import FAILURE_HINT, failure_message

        if self.read_ahead > 0:
            self.submit(microbatches)  # those already submitted are skipped
            return set()
        error, zero = None, set()
        try:
            for f in self.features.fetch(microbatches):
                what = failure_message(f)
                if self.on_failure == "error":
                    raise InputError(what + FAILURE_HINT)
                log.warning("%s: its loss mask is zeroed (train.producers.on_failure=zero_loss)", what)
                self.zeroed.append({"epoch": f.epoch, "index": f.index, "sample_ids": f.sample_ids,
                                    "reason": f.reason})
                zero.add((f.epoch, f.index))
        except Exception as exc:  # noqa: BLE001 - agreed on by every rank, then raised on every rank
            error = exc
        raise_if_any_rank_failed(error)
        return zero

    def raise_if_failed(self) -> None:
        """Collective, after a step agreed non-finite: when a rank's read-ahead handed over a failure under
        `on_failure: error` or met an error (`RemoteFeatures.take_error`), every rank raises it (that rank's own
        error, the others an InputError naming it), instead of the non-finite step's message."""
        from regen.train.collectives import raise_if_any_rank_failed

        raise_if_any_rank_failed(self.features.take_error() if self.features is not None else None)

    def report(self, step_s: float) -> dict:
        """The producer-vs-trainer balance: data-wait fraction of the loop, feature bytes/s, rows/s each side."""
        from regen.train.collectives import control_all_gather_object

        f = self.features.stats
        mine = self.zeroed + self.features.zeroed  # serial (fetch_step) + read-ahead (the client)
        zeroed = [mine]
        if self.info is not None and self.info.world_size > 1:
            zeroed = [None] * self.info.world_size
            control_all_gather_object(zeroed, mine)
        # the trainer's wait for producers: serial, the long-poll before each step; read ahead, the compute thread's
        # stall behind the reader (the reader's own long-poll overlaps compute: `reader_wait_s`)
        wait = f["stall_s"] if self.read_ahead > 0 else f["wait_s"]
        out = {"zeroed_microbatches": sorted((z for r in zeroed for z in r), key=lambda z: (z["epoch"], z["index"])),
               "objects": f["objects"], "bytes": f["bytes"], "wait_s": round(wait, 3),
               "first_wait_s": round(min(wait, f["first_wait_s"] or 0.0), 3),
               "read_s": round(f["read_s"], 3), "failed_microbatches": f["failed"],
               "read_ahead": self.read_ahead, "stall_s": round(f["stall_s"], 3),
               "reader_wait_s": round(f["wait_s"], 3), "steps_submitted_ahead": self.submitted_ahead,
               "data_wait_fraction": wait / step_s if step_s > 0 else 0.0,
               "feature_bytes_per_s": f["bytes"] / step_s if step_s > 0 else 0.0, **self.sizes}
        st = self.features.staging.stats  # regen.train.features.staging: host copies, device copies, residency
        out["staging"] = {k: st[k] for k in ("store_reads_into_slots", "host_copies", "host_bytes", "device_copies",
                                             "device_bytes", "pinned_bytes", "resident_max", "extra_device_buffers",
                                             "host_slot_bytes_max")}  # the last: `regen plan`'s host/GPU feature slots
        if self.dispatcher is not None:
            out.update(self.producer_report())
        if self.watch is not None:
            out["store_allocated_bytes_max"] = self.watch.max_allocated
            out["store_samples"] = len(self.watch.samples)
        return out

    def producer_report(self) -> dict:
        """Rank 0, at the end of the run: every producer once with its final state (`regen.train.features.roster`),
        the dispatcher's counters and the producers' rates.

        The run's work is done when this is called, so it first ends the local producers (`end_local`): each one's
        exit status is then its final state, whenever it died (before it registered, holding a lease, after the
        last step, before or after the dispatcher noticed its silence)."""
        from regen.train.features.roster import final_producers

        self.end_local()
        st = self.dispatcher.status()
        out = {"dispatcher": st["stats"]}
        local = [{"name": f"local-{i}", "pid": p.pid, "log": self.logs[i] if i < len(self.logs) else None,
                  "returncode": p.poll(), "ended_by_pool": self.ended_by_pool.get(p.pid)}
                 for i, p in enumerate(self.procs)]
        out["producers"] = final_producers(st["producers"], local, host=socket.gethostname(), now=time.time())
        # what the pool can give: each producer's rows per second of its own work, summed over those the dispatcher
        # had not declared dead (a local one that finished its work counts)
        each = [p["rows"] / p["busy_s"] for p in st["producers"] if p["busy_s"] > 0 and p["alive"]]
        out["producer_rows_per_s"] = sum(each) if each else None
        out["producer_rows_per_s_each"] = [round(x, 3) for x in each]
        rows = sum(p["rows"] for p in st["producers"])
        out["producer_cpu_s_per_row"] = sum(p["cpu_s"] for p in st["producers"]) / rows if rows else None
        out["accounted_bytes_max"] = st["stats"]["max_accounted_bytes"]
        return out

    def end_local(self) -> None:
        """Tell the dispatcher there is no more work and wait for the local producers to exit: `stop_grace_s` in
        all, then SIGTERM, 5 s more, then SIGKILL (each such end recorded in `ended_by_pool`). Idempotent."""
        if self.dispatcher is not None:
            with self.dispatcher._lock:
                self.dispatcher.stopping = True
                self.dispatcher._lock.notify_all()
        deadline = time.monotonic() + self.stop_grace_s
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
                self.ended_by_pool[p.pid] = "SIGTERM"
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                self.ended_by_pool[p.pid] = "SIGKILL"

    def close(self) -> None:
        if self.features is not None:
            self.features.stop()  # the reader thread ends at its next wait: nothing more is read from here on
        self.end_local()
        if self.watch is not None:
            self.watch.stop_event.set()
        if self.store is not None and self.dispatcher is not None:
            try:
                self.store.remove_prefix(self.dispatcher.spec.namespace + "/")
            except Exception:  # noqa: BLE001 - teardown goes on
                log.exception("removing this run's feature objects")
        if self.dispatcher is not None:
            self.dispatcher.stop()
        if self.features is not None:
            self.features.close()  # its host slots unregistered from the store before the store goes
        if self.store is not None:
            self.store.close()
        if self.master is not None:
            self.master.stop()
        self.procs, self.dispatcher, self.store, self.master = [], None, None, None


def write_report(path: Path, report: dict) -> None:
    from schemas.io import write_json_atomic

    write_json_atomic(json.loads(json.dumps(report, default=str)), path)
