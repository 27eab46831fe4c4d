"""The trainer rank's side: the features of its micro-batches, read from the store and checked before use.

`RemoteFeatures.fetch(microbatches)` waits (long-poll on the dispatcher) for each of a step's micro-batches, reads
its object from the store straight into a reused host slot (Mooncake's `get_into` into slots registered with the
store: its one transfer, no copy of regen's; a store with only `get`: one copy out of its buffer), checks the
header against the rank's own batch (`contract.check_header`: token ids, taps, stream, norm, dtype, sizes, target
revision) and tells the dispatcher it was consumed (the object is removed from the store at once, so the store's
budget never has to hold a step). Every failure is known here, before the step's loss weights are computed, and
the ranks agree on it (`FeaturePool.fetch_step`). Nothing is on the device yet but the first micro-batch's copy, issued at the end.

`features_of(batch)` hands the loss exactly what `TargetFeatures.features` would: (taps [B, S, T·Ht],
last_hidden [B, S, Ht]) in the feature dtype, on the rank's device; it issues the asynchronous device copy of the
next micro-batch before it returns (`regen.train.features.staging`), applies the target's final norm when the
producer declared its last hidden state pre-norm, and checks the values: on a GPU counted on the device, queued on
the copy stream after the object's copy (`contract.value_summary`), nothing read back per micro-batch; the counts
of a step's objects are read once, in `take_breaches` (on CPU, where the device is the host, `contract.
check_values` at once). A non-finite object is not raised there, mid-step, but recorded for `take_breaches`, and
`regen.train.step.train_step` makes the step non-finite on every rank with it. `release(batch)`
(`regen.train.step.train_step`, after the micro-batch's backward) frees its device slot, so at most
`staging.DEVICE_RESIDENT_OBJECTS` (2) objects are on the device at once, whatever grad_accum.

A micro-batch whose features failed on every attempt comes back as a `FeatureFailure`: under `on_failure:
error` the loop stops naming it; under `zero_loss` the loop zeroes its loss mask and it is trained with zero
features and zero weight, so every rank still runs the same forward and backward and FSDP stays in step
(TorchSpec #138: a per-rank drop desyncs the ranks). `startup_timeout_s` (no producer registered yet: the
target is loading) and `no_producer_timeout_s` (every producer gone) bound the wait: then a clear InputError.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from regen.errors import InputError
from regen.train.features.contract import (FeatureContractError, FeatureSpec, check_header, check_values, read_header,
                                           value_breach, value_summary)
from regen.train.features.dispatcher import post

log = logging.getLogger(__name__)


@dataclass
class FeatureFailure:
    epoch: int
    index: int
    sample_ids: list[str]
    reason: str


class RemoteFeatures:
    """Features of this rank's micro-batches from producers (see the module docstring)."""

    def __init__(self, url: str, store, spec: FeatureSpec, head, device, *, no_producer_timeout_s: float = 120.0,
                 startup_timeout_s: float = 600.0, poll_s: float = 2.0, defer_value_checks: bool | None = None):
        self.url, self.store, self.spec, self.head, self.device = url, store, spec, head, device
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
                      "pre_norm_applied": 0}

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
        in the order they will be trained); each object leaves the store here. Returns the failures.
        Raises FeatureContractError (a broken contract), InputError (no producers, dispatcher gone)."""
        import torch

        failures = []
        for mb in microbatches:
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
                failures.append(FeatureFailure(mb.epoch, mb.index, list(mb.sample_ids), r["reason"]))
                self.stats["failed"] += 1
                B, S = mb.input_ids.shape
                H, T = self.spec.target_hidden_size, self.spec.num_taps
                self._queue[key] = (self.staging.zeros(key, getattr(torch, self.spec.dtype),
                                                       [(B, S, T * H), (B, S, H)]), None)
                post(self.url, "/consumed", {"epoch": mb.epoch, "index": mb.index})
                continue
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
            self._queue[key] = (staged, header)
            post(self.url, "/consumed", {"epoch": mb.epoch, "index": mb.index})
            self.stats["objects"] += 1
            self.stats["bytes"] += int(r["nbytes"])
            self.stats["read_s"] += time.perf_counter() - t1
        if self._queue:  # the first micro-batch's device copy runs while the step's loss weights are computed
            self.staging.issue(next(iter(self._queue.values()))[0])
        return failures

    def _checked_header(self, view, mb) -> dict:
        """The object's header, checked against the rank's own micro-batch `mb`. Raises FeatureContractError."""
        header = read_header(view)
        check_header(header, self.spec, epoch=mb.epoch, index=mb.index, input_ids=mb.input_ids,
                     attention_mask=mb.attention_mask)
        return header

    def features_of(self, batch: dict):
        """(taps, last_hidden) of a batch prepared from a fetched micro-batch (`batch["key"]` = (epoch, index)), on
        the device, valid until `release(batch)`; the next fetched micro-batch's device copy is issued before it
        returns, so it overlaps this one's compute. Non-finite values are recorded for `take_breaches` (the step
        is then agreed non-finite on every rank, `regen.train.step.train_step`), not raised. Raises RuntimeError
        (not fetched)."""
        key = tuple(batch["key"])
        try:
            staged, header = self._queue.pop(key)
        except KeyError:
            raise RuntimeError(f"features of micro-batch {batch.get('key')} were not fetched") from None
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
        if self._queue:  # the next micro-batch's copy runs while this one computes
            self.staging.issue(next(iter(self._queue.values()))[0])
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

    def close(self) -> None:
        for staged, _ in self._queue.values():
            self.staging.release(staged)
        for staged in self._out.values():
            self.staging.release(staged)
        self._queue.clear()
        self._out.clear()
        self.staging.close()
