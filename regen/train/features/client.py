"""The trainer rank's side: the features of its micro-batches, read from the store and checked before use.

`RemoteFeatures.fetch(microbatches)` waits (long-poll on the dispatcher) for each of a step's micro-batches, reads
its object from the store, checks the header against the rank's own batch (`contract.check_header`: token ids,
taps, stream, norm, dtype, sizes, target revision), applies the target's final norm when the producer declared
its last hidden state pre-norm, and tells the dispatcher it was consumed (the object is removed). Then
`features_of(batch)` hands the loss exactly what `TargetFeatures.features` would: (taps [B, S, T·Ht],
last_hidden [B, S, Ht]) in the feature dtype, on the rank's device (`regen.train.features.staging`: one host copy
into reused pinned memory, an asynchronous copy to the GPU).

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
from regen.train.features.contract import FeatureSpec, check_header, check_values, read_header
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
                 startup_timeout_s: float = 600.0, poll_s: float = 2.0):
        self.url, self.store, self.spec, self.head, self.device = url, store, spec, head, device
        self.no_producer_timeout_s, self.startup_timeout_s, self.poll_s = no_producer_timeout_s, startup_timeout_s, poll_s
        self._cache: dict[tuple[int, int], tuple] = {}
        from regen.train.features.staging import Staging

        self.staging = Staging(device)  # reused pinned slots, asynchronous copies to the GPU
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
        """Fetch, check and cache the features of `microbatches` (feed MicroBatch objects). Returns the failures.
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
            if r["status"] == "failed":
                failures.append(FeatureFailure(mb.epoch, mb.index, list(mb.sample_ids), r["reason"]))
                self.stats["failed"] += 1
                B, S = mb.input_ids.shape
                H, T = self.spec.target_hidden_size, self.spec.num_taps
                dt = getattr(torch, self.spec.dtype)
                self._cache[(mb.epoch, mb.index)] = (torch.zeros(B, S, T * H, dtype=dt, device=self.device),
                                                     torch.zeros(B, S, H, dtype=dt, device=self.device))
                post(self.url, "/consumed", {"epoch": mb.epoch, "index": mb.index})
                continue
            view, handle = self.store.get(r["key"])
            try:
                header = read_header(view)
                check_header(header, self.spec, epoch=mb.epoch, index=mb.index, input_ids=mb.input_ids,
                             attention_mask=mb.attention_mask)
                taps, last = self.staging.to_device(view, header)  # on self.device
                check_values(header, taps, last, epoch=mb.epoch, index=mb.index)  # non-finite: a contract breach
            finally:
                del view, handle
            if header["last_hidden_norm"] == "pre_final_norm":
                last = self.head.final_norm(last.to(self.head.device)).to(last.dtype)
                self.stats["pre_norm_applied"] += 1
            self._cache[(mb.epoch, mb.index)] = (taps, last)
            post(self.url, "/consumed", {"epoch": mb.epoch, "index": mb.index})
            self.stats["objects"] += 1
            self.stats["bytes"] += int(r["nbytes"])
            self.stats["read_s"] += time.perf_counter() - t1
        return failures

    def features_of(self, batch: dict):
        """(taps, last_hidden) of a batch prepared from a fetched micro-batch (`batch["key"]` = (epoch, index))."""
        try:
            return self._cache.pop(tuple(batch["key"]))
        except KeyError:
            raise RuntimeError(f"features of micro-batch {batch.get('key')} were not fetched") from None

    def close(self) -> None:
        self._cache.clear()
