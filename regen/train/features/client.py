"""The trainer rank's side: the features of its micro-batches, read from the store and checked before use.

Reading one object (`_read_one`): wait (long-poll on the dispatcher) for the micro-batch, read its object from the
store straight into a reused host slot (Mooncake's `get_into` into slots registered with the store: its one
transfer, no copy of regen's; a store with only `get`: one copy out of its buffer), check the header against the
rank's own batch (`contract.check_header`: token ids, taps, stream, norm, dtype, sizes, target revision) and tell
the dispatcher it was consumed (the object is removed from the store at once, so the store's budget never has to
hold a step). Two ways to drive it, `train.producers.read_ahead` (D):

* D > 0, overlapped: `submit(microbatches)` queues a step's micro-batches (the loop submits the next step's while
  this one computes) for a reader thread, which keeps at most D objects read and not yet handed over: the store's
  reads of the next micro-batches run while the current one computes, and the host holds D + 1 slots. A failure
  the reader meets arrives after the step's loss weights were agreed: `features_of` hands that micro-batch over as
  zeros, `lost(batch)` says so, and `regen.train.step.train_step` trains it with a zeroed loss mask and takes its
  weight out of the step's afterwards (exact: see there). Under `on_failure: error`, and for any error of the
  reader (a broken contract, no producers, the dispatcher gone; the reader stops there and every later
  micro-batch comes back as zeros), the micro-batch is also a breach (`take_breaches`): the step is non-finite on
  every rank, no optimizer step, and `FeaturePool.raise_if_failed` raises the error itself on every rank
  (`take_error`), as the serial path would have before the step.
* D = 0, serial: `fetch(microbatches)` reads every object of a step before its first forward; every failure is
  known before the step's loss weights are computed, and the ranks agree on it (`FeaturePool.fetch_step`).

`features_of(batch)` hands the loss exactly what `TargetFeatures.features` would: (taps [B, S, T·Ht],
last_hidden [B, S, Ht]) in the feature dtype, on the rank's device; it issues the asynchronous device copy of the
next micro-batch before it returns (with read-ahead: the reader issues it once staged, if it was not yet)
(`regen.train.features.staging`), applies the target's final norm when the
producer declared its last hidden state pre-norm, and checks the values: on a GPU counted on the device, queued on
the copy stream after the object's copy (`contract.value_summary`), nothing read back per micro-batch; the counts
of a step's objects are read once, in `take_breaches` (on CPU, where the device is the host, `contract.
check_values` at once). A non-finite object is not raised there, mid-step, but recorded for `take_breaches`, and
`regen.train.step.train_step` makes the step non-finite on every rank with it. `release(batch)`
(`regen.train.step.train_step`, after the micro-batch's backward) frees its device slot, so at most
`staging.DEVICE_RESIDENT_OBJECTS` (2) objects are on the device at once, whatever grad_accum.

A micro-batch whose features failed on every attempt is trained with zero features and zero weight (`on_failure:
zero_loss`, counted) or stops the run naming it (`error`); either way every rank still runs the same forward and
backward and FSDP stays in step (TorchSpec #138: a per-rank drop desyncs the ranks). `startup_timeout_s` (no
producer registered yet: the target is loading) and `no_producer_timeout_s` (every producer gone) bound the wait:
then a clear InputError.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from regen.errors import InputError
from regen.train.features.contract import (
    FeatureContractError,
    FeatureSpec,
    check_header,
    check_values,
    read_header,
    value_breach,
    value_summary,
)
from regen.train.features.dispatcher import post

log = logging.getLogger(__name__)


@dataclass
class FeatureFailure:
    epoch: int
    index: int
    sample_ids: list[str]
    reason: str


FAILURE_HINT = (" — fix the producers, or set train.producers.on_failure=zero_loss to train on with that "
                "micro-batch's loss mask zeroed (counted)")


def failure_message(f: FeatureFailure) -> str:
    """What a micro-batch whose features failed on every attempt is called in the log and in the stop."""
    return (f"the features of micro-batch {f.epoch}:{f.index} (rows {', '.join(f.sample_ids)}) failed on every "
            f"attempt: {f.reason}")


class RemoteFeatures:
    """Features of this rank's micro-batches from producers (see the module docstring)."""

    def __init__(self, url: str, store, spec: FeatureSpec, head, device, *, no_producer_timeout_s: float = 120.0,
                 startup_timeout_s: float = 600.0, poll_s: float = 2.0, defer_value_checks: bool | None = None,
                 read_ahead: int = 0, on_failure: str = "error"):
        self.url, self.store, self.spec, self.head, self.device = url, store, spec, head, device
        self.read_ahead, self.on_failure = int(read_ahead), on_failure  # train.producers.read_ahead, .on_failure
        self.no_producer_timeout_s, self.startup_timeout_s, self.poll_s = no_producer_timeout_s, startup_timeout_s, poll_s
        self._queue: dict[tuple[int, int], tuple] = {}  # fetched, in training order: (Staged, header | None)
        self._out: dict[tuple[int, int], object] = {}  # handed to compute, not yet released: Staged
        from regen.train.features.staging import Staging

        # reused host slots (registered with the store when it reads into them), at most 2 objects on the device
        self._into = hasattr(store, "get_into") and hasattr(store, "register")
        self.staging = Staging(device, register=store.register if self._into else None,
                               unregister=store.unregister if self._into else None)
        self.breaches: dict[tuple[int, int], str] = {}  # non-finite values seen in features_of (take_breaches)
        # value checks counted on the device and read once per step (take_breaches): no host read per micro-batch.
        # Default off CPU only: on CPU the device is the host, and the immediate check's fast path is cheaper.
        import torch

        self.defer_value_checks = (torch.device(device).type != "cpu" if defer_value_checks is None
                                   else bool(defer_value_checks))
        self._pending_checks: list[tuple] = []  # (key, header, seq_len, value_summary on the device)
        self.stats = {"objects": 0, "bytes": 0, "wait_s": 0.0, "first_wait_s": None, "read_s": 0.0, "failed": 0,
                      "pre_norm_applied": 0, "stall_s": 0.0}
        # read-ahead (`submit`): the reader thread's work and what it hands over, under one condition
        self._cv = threading.Condition()
        self._todo: deque = deque()  # submitted, not yet taken by the reader: MicroBatch
        self._order: deque = deque()  # submitted, not yet handed over, in training order: (key, MicroBatch)
        self._ahead = 0  # objects taken by the reader (being read or staged) and not yet handed over
        self._issue_next = None  # key of the next micro-batch to compute: its device copy is issued once staged
        self._failures: dict[tuple[int, int], FeatureFailure] = {}  # staged as zeros by the reader
        self._lost: dict[tuple[int, int], str] = {}  # handed over as zeros: `lost`
        self._step_errors: list[BaseException] = []  # handed over since the last `take_error`
        self._error: BaseException | None = None  # the reader's error: it stopped there
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.zeroed: list[dict] = []  # read-ahead under on_failure zero_loss: the micro-batches trained zeroed

    def _wait(self, epoch: int, index: int) -> dict:
        while True:
            try:
                r = post(self.url, "/wait", {"epoch": epoch, "index": index, "timeout_s": self.poll_s},
                         timeout_s=self.poll_s + 30)
            except OSError as exc:
                raise InputError(f"the feature dispatcher at {self.url} is unreachable ({exc}): rank 0 has stopped; "
                                 "see its log") from None
            if r["status"] != "pending":
                return r
            if self._stopping:
                raise InputError("the feature reader was stopped")
            limit = self.no_producer_timeout_s if r.get("ever_registered") else self.startup_timeout_s
            if r.get("live_producers", 0) == 0 and r.get("no_producer_s", 0.0) > limit:
                what = ("every feature producer is gone" if r.get("ever_registered")
                        else "no feature producer registered")
                raise InputError(
                    f"{what} for {r['no_producer_s']:.0f} s (limit {limit:.0f} s, train.producers."
                    f"{'no_producer_timeout_s' if r.get('ever_registered') else 'startup_timeout_s'}) while "
                    f"micro-batch {epoch}:{index} waits: start producers against {self.url} (`regen features "
                    "produce --dispatcher URL`) and rerun the same command; training resumes from the last "
                    "checkpoint, which is intact")

    def fetch(self, microbatches) -> list[FeatureFailure]:
        """Wait for, read, check and stage into host memory the features of `microbatches` (feed MicroBatch objects,
        in the order they will be trained); each object leaves the store here. Returns the failures. The serial
        path (`read_ahead` 0); with read-ahead `submit` them instead.
        Raises FeatureContractError (a broken contract), InputError (no producers, dispatcher gone)."""
        failures = []
        for mb in microbatches:
            staged, header, failure = self._read_one(mb)
            self._queue[(mb.epoch, mb.index)] = (staged, header)
            if failure is not None:
                failures.append(failure)
        if self._queue:  # the first micro-batch's device copy runs while the step's loss weights are computed
            self.staging.issue(next(iter(self._queue.values()))[0])
        return failures

    def _read_one(self, mb):
        """Wait for `mb`'s object, read it into a host slot, check its header, tell the dispatcher it was consumed:
        (Staged, header | None, FeatureFailure | None); a failed micro-batch is staged as zeros of its shapes.
        Raises FeatureContractError, InputError, the store's errors."""
        import torch

        t0 = time.perf_counter()
        r = self._wait(mb.epoch, mb.index)
        t1 = time.perf_counter()
        self.stats["wait_s"] += t1 - t0
        if self.stats["first_wait_s"] is None:  # the producers' start-up (loading the target) is waited here
            self.stats["first_wait_s"] = t1 - t0
        if r["status"] == "error":
            raise InputError(r["reason"])
        key = (mb.epoch, mb.index)
        if r["status"] == "failed":
            self.stats["failed"] += 1
            B, S = mb.input_ids.shape
            H, T = self.spec.target_hidden_size, self.spec.num_taps
            staged = self.staging.zeros(key, getattr(torch, self.spec.dtype), [(B, S, T * H), (B, S, H)])
            post(self.url, "/consumed", {"epoch": mb.epoch, "index": mb.index})
            return staged, None, FeatureFailure(mb.epoch, mb.index, list(mb.sample_ids), r["reason"])
        if self._into:  # Mooncake: the store's transfer lands in a registered host slot, no copy after it
            n = self.store.size(r["key"])
            staged, view = self.staging.stage_into(lambda buf: self.store.get_into(r["key"], buf, n), n, key)
            try:
                header = self._checked_header(view, mb)
                self.staging.locate(staged, header)
            except BaseException:
                self.staging.discard(staged)
                raise
            finally:
                del view
        else:  # a store with only `get`: its buffer, then one host copy into a slot
            view, handle = self.store.get(r["key"])
            try:
                header = self._checked_header(view, mb)
                staged = self.staging.stage(view, header, key)  # the store's object can go after this
            finally:
                del view, handle
        post(self.url, "/consumed", {"epoch": mb.epoch, "index": mb.index})
        self.stats["objects"] += 1
        self.stats["bytes"] += int(r["nbytes"])
        self.stats["read_s"] += time.perf_counter() - t1
        return staged, header, None

    # -- read-ahead: a reader thread ----------------------------------------------------------------------------
    def submit(self, microbatches) -> None:
        """Queue `microbatches` (feed MicroBatch objects, in training order, after those submitted before) for the
        reader thread, which reads them as `read_ahead` allows; `features_of` hands each over. A micro-batch
        submitted before and not yet handed over is skipped. Does not block."""
        with self._cv:
            known = {k for k, _ in self._order}
            for mb in microbatches:
                if (mb.epoch, mb.index) in known:
                    continue
                self._todo.append(mb)
                self._order.append(((mb.epoch, mb.index), mb))
            if self._issue_next is None and self._order:
                self._issue_next = self._order[0][0]
            if self._thread is None:
                self._thread = threading.Thread(target=self._reader, name="feature-reader", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _reader(self) -> None:
        """The reader thread: the next submitted micro-batch once fewer than `read_ahead` objects are read and not
        yet handed over; its object staged (and its device copy issued when it is the next to compute). Its first
        error ends it: every micro-batch not read by then is handed over as zeros and the error as a breach."""
        import torch

        dev = self.staging.device
        if dev.type == "cuda":  # this thread's CUDA calls on the rank's device, not device 0
            torch.cuda.set_device(dev if dev.index is not None else torch.cuda.current_device())
        while True:
            with self._cv:
                while not self._stopping and (not self._todo or self._ahead >= self.read_ahead):
                    self._cv.wait()
                if self._stopping:
                    return
                mb = self._todo.popleft()
                self._ahead += 1
            key = (mb.epoch, mb.index)
            try:
                staged, header, failure = self._read_one(mb)
            except BaseException as exc:  # noqa: BLE001 - handed over as a breach (features_of), agreed per step
                with self._cv:
                    self._error = exc if not self._stopping else None
                    self._ahead -= 1
                    self._cv.notify_all()
                return
            with self._cv:
                self._queue[key] = (staged, header)
                if failure is not None:
                    self._failures[key] = failure
                if key == self._issue_next:  # the next to compute: its device copy overlaps the current one
                    self.staging.issue(staged)
                self._cv.notify_all()

    def _handed_over(self, key, batch):
        """(staged, header | None) of `key` from the reader, waiting for it (read-ahead path); the failure or the
        reader's error is recorded for `lost`, `take_breaches` and `take_error`."""
        import torch

        with self._cv:
            if not self._order or self._order[0][0] != key:
                raise RuntimeError(f"features of micro-batch {batch.get('key')} were not submitted (next: "
                                   f"{self._order[0][0] if self._order else None})")
            t0 = time.perf_counter()
            while key not in self._queue and self._error is None:
                self._cv.wait()
            self.stats["stall_s"] += time.perf_counter() - t0
            _, mb = self._order.popleft()
            if key in self._queue:
                self._ahead -= 1
                staged, header = self._queue.pop(key)
                failure = self._failures.pop(key, None)
            else:  # the reader stopped on an error before this one: zeros, and the step stops on every rank
                B, S = mb.input_ids.shape
                H, T = self.spec.target_hidden_size, self.spec.num_taps
                staged = self.staging.zeros(key, getattr(torch, self.spec.dtype), [(B, S, T * H), (B, S, H)])
                header, failure = None, None
                msg = f"micro-batch {key[0]}:{key[1]} was not read: {type(self._error).__name__}: {self._error}"
                self._lost[key] = msg
                self.breaches[key] = msg
                self._step_errors.append(self._error)
            self._issue_next = self._order[0][0] if self._order else None
            entry = self._queue.get(self._issue_next)
            nxt = entry[0] if entry is not None else None
            self._cv.notify_all()
        if failure is not None:
            what = failure_message(failure)
            self._lost[key] = what
            if self.on_failure == "error":  # not raised mid-step: the step's flags stop every rank, naming it
                self.breaches[key] = what
                self._step_errors.append(InputError(what + FAILURE_HINT))
            else:
                log.warning("%s: its loss mask is zeroed (train.producers.on_failure=zero_loss)", what)
                self.zeroed.append({"epoch": failure.epoch, "index": failure.index,
                                    "sample_ids": failure.sample_ids, "reason": failure.reason})
        return staged, header, nxt

    def lost(self, batch: dict) -> str | None:
        """Why `batch`'s features were handed over as zeros after the step's loss weights were agreed (read-ahead:
        they failed on every attempt, or the reader stopped on an error), else None; taken once. The caller
        trains it with a zeroed loss mask and takes its weight out of the step's (`regen.train.step.train_step`)."""
        return self._lost.pop(tuple(batch["key"]), None)

    def take_error(self) -> BaseException | None:
        """The first error handed over since the last call (a read error of the reader, or under `on_failure:
        error` a micro-batch that failed on every attempt), cleared; None when there was none."""
        errors, self._step_errors = self._step_errors, []
        return errors[0] if errors else None

    def _checked_header(self, view, mb) -> dict:
        """The object's header, checked against the rank's own micro-batch `mb`. Raises FeatureContractError."""
        header = read_header(view)
        check_header(header, self.spec, epoch=mb.epoch, index=mb.index, input_ids=mb.input_ids,
                     attention_mask=mb.attention_mask)
        return header

    def features_of(self, batch: dict):
        """(taps, last_hidden) of a batch prepared from a fetched or submitted micro-batch (`batch["key"]` = (epoch,
        index)), on the device, valid until `release(batch)`; the next micro-batch's device copy is issued before it
        returns (or by the reader once it is staged), so it overlaps this one's compute. With read-ahead it waits
        for the reader (`stats["stall_s"]`); features lost there come back as zeros (see `lost`). Non-finite values
        are recorded for `take_breaches` (the step is then agreed non-finite on every rank,
        `regen.train.step.train_step`), not raised. Raises RuntimeError (not fetched or submitted)."""
        key = tuple(batch["key"])
        if self.read_ahead > 0:
            staged, header, nxt = self._handed_over(key, batch)
        else:
            try:
                staged, header = self._queue.pop(key)
            except KeyError:
                raise RuntimeError(f"features of micro-batch {batch.get('key')} were not fetched") from None
            nxt = next(iter(self._queue.values()))[0] if self._queue else None
        taps, last = self.staging.ready(staged)  # issued one micro-batch ago: copied during the last compute
        self._out[key] = staged
        if header is not None and self.defer_value_checks:
            with self.staging.on_copy_stream():  # queued after this object's copy; nothing read back here
                self._pending_checks.append((key, header, taps.shape[1], value_summary(taps, last)))
        elif header is not None:
            with self.staging.on_copy_stream():  # its host read waits for this copy, not the queued compute
                try:
                    check_values(header, taps, last, epoch=key[0], index=key[1])  # non-finite: a contract breach
                except FeatureContractError as exc:
                    # not raised here, in the middle of the step: the other ranks would wait in FSDP's collectives
                    # until the NCCL watchdog. `train_step` takes it with `take_breaches` and counts the step
                    # non-finite, so every rank agrees to stop before the optimizer step and names it.
                    self.breaches[key] = str(exc)
        if nxt is not None:  # the next micro-batch's copy runs while this one computes
            self.staging.issue(nxt)
        if header is not None and header["last_hidden_norm"] == "pre_final_norm":
            last = self.head.final_norm(last.to(self.head.device)).to(last.dtype)
            self.stats["pre_norm_applied"] += 1
        return taps, last

    def take_breaches(self) -> dict[tuple[int, int], str]:
        """{(epoch, index): the contract error} of the micro-batches handed over since the last call whose values
        were not finite (checked on the device in `features_of`), cleared. With deferred checks, the counts of
        every object handed over since the last call are read here, in one host read on the copy stream
        (`regen.train.step.train_step` calls this once per step, after its finiteness flags)."""
        if self._pending_checks:
            import torch

            pending, self._pending_checks = self._pending_checks, []
            with self.staging.on_copy_stream():
                host = torch.stack([p[3] for p in pending]).cpu().tolist()
            for (key, header, seq_len, _), summary in zip(pending, host):
                msg = value_breach(header, summary, seq_len, epoch=key[0], index=key[1])
                if msg is not None:
                    self.breaches[key] = msg
        out, self.breaches = self.breaches, {}
        return out

    def release(self, batch: dict) -> None:
        """The loss is done with `batch`'s features (after its backward): its device slot may take the next object."""
        staged = self._out.pop(tuple(batch["key"]), None)
        if staged is not None:
            self.staging.release(staged)

    def stop(self) -> None:
        """Tell the reader thread to stop (it ends at its next wait; one in a store read finishes it first)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()

    def close(self) -> None:
        self.stop()
        if self._thread is not None:
            self._thread.join(self.poll_s + 60)  # a long-poll ends within poll_s; a read in progress finishes
            if self._thread.is_alive():
                log.warning("the feature reader thread did not stop; its host slots are left allocated")
                return
        for staged, _ in self._queue.values():
            self.staging.release(staged)
        for staged in self._out.values():
            self.staging.release(staged)
        self._queue.clear()
        self._out.clear()
        self.staging.close()
