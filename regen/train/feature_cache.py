"""The in-process target's features, computed once per row and kept on the host (`train.feature_cache_gib`).

A frozen target gives a row the same tap states every time it sees it, so a small target trained over many epochs
(the `local` profile: about 16 passes over a few hundred rows) runs its forward once per row instead of once per
epoch. The offline mode of EAGLE and SpecForge stores every row's hidden states on disk before training for the same
reason; here they stay in memory, bounded, and are filled by the online trainer's first pass.

The data path, per micro-batch (`CachedFeatures.features_of`, the call `regen.train.step.train_step` makes):

    rows of batch["input_ids"] [B, S] (valid prefix: attention_mask)
      -> key = blake2b(the row's token ids)            a row is its tokens: identity is content (docs/style.md)
      -> hit: the kept (taps [n, T·Ht], last_hidden [n, Ht]), its token ids compared in full
         miss: `TargetFeatures.features` on the row alone [1, n], kept while the budget allows
      -> padded on the device: taps [B, S, T·Ht], last_hidden [B, S, Ht] (zeros past each row's length)

Every row's features are computed on that row alone, never in a padded batch, so a row's values do not depend on
which rows it was batched with, on which rank it is, or whether it was kept: a run with the cache equals bit for bit
a run whose budget keeps nothing, and a resumed run an unbroken one. Against a run without the cache the features
differ by the rounding of a batched against an unbatched forward (about 1e-6 relative in fp32;
tests/train/test_feature_cache.py). Positions past a row's length are zeros, where the batched forward computes the
padding's states: the draft's loss and attention read neither (the loss and attention masks end at the row's length;
held by a test). Each rank keeps its own rows, so a job's host memory is up to world size x the budget.

The keys and lengths come from the micro-batch's host copies (`host_input_ids`, `host_attention_mask`, set by
`regen.train.step.prepare_microbatch`): no device read on a hit; a miss runs the target and copies its features to
the host once.
"""
from __future__ import annotations

import hashlib
import logging

log = logging.getLogger(__name__)

GIB = 1 << 30


def feature_cache_bytes(gib: float) -> int:
    """`train.feature_cache_gib` in bytes; a positive budget is at least one byte (a tiny one keeps no row but still
    reports its counts); 0 = off."""
    return max(1, int(gib * GIB)) if gib > 0 else 0


class CachedFeatures:
    """`features_of(batch)` -> (taps float[B, S, T·Ht], last_hidden float[B, S, Ht]) on the batch's device, in the
    target's dtype, as `TargetFeatures.features_of` returns them; each row's are read from the host cache or
    computed on the row alone and kept while `capacity_bytes` allows (a row past the budget is computed every time;
    nothing is evicted). `stats(reduce)` -> {rows, bytes, hits, misses, uncached, capacity_bytes_per_rank}: what
    the run summary reports.

    target: a `regen.train.target.TargetFeatures` (the whole frozen target in this process).
    capacity_bytes: host bytes for the kept features (taps + last hidden states; the token ids beside them are not
    counted); > 0.
    """

    def __init__(self, target, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes {capacity_bytes}: give a positive byte budget")
        self.target = target
        self.capacity_bytes = int(capacity_bytes)
        self._rows: dict[bytes, tuple] = {}  # key -> (token ids int64[n] host, taps [n, T·Ht] host, last [n, Ht] host)
        self.bytes = 0
        self.hits = self.misses = self.uncached = 0
        self._full_logged = False

    def features_of(self, batch: dict):
        import torch

        ids = batch["input_ids"]
        # the host copies of prepare_microbatch; a batch without them is read from the device
        host = batch["host_input_ids"] if "host_input_ids" in batch else ids.cpu()
        mask = batch["host_attention_mask"] if "host_attention_mask" in batch else batch["attention_mask"].cpu()
        lengths = mask.sum(dim=1).tolist()
        rows = {b: self._row(ids[b, :n], host[b, :n]) for b, n in enumerate(lengths) if n > 0}
        if not rows:  # every row empty: nothing to key, the target's own batch path
            return self.target.features_of(batch)
        t0, h0 = next(iter(rows.values()))
        taps = torch.zeros((*ids.shape, t0.shape[-1]), dtype=t0.dtype, device=ids.device)
        last = torch.zeros((*ids.shape, h0.shape[-1]), dtype=h0.dtype, device=ids.device)
        for b, (t, h) in rows.items():  # an empty row stays zeros
            taps[b, :t.shape[0]] = t.to(ids.device)
            last[b, :h.shape[0]] = h.to(ids.device)
        return taps, last

    def _row(self, ids, host_ids):
        """(taps [n, T·Ht], last_hidden [n, Ht]) of one row's valid tokens `ids` int64[n] (on the device; `host_ids`
        their host copy), from the cache or the target."""
        import torch

        key = hashlib.blake2b(host_ids.numpy().tobytes(), digest_size=16).digest()
        kept = self._rows.get(key)
        if kept is not None and torch.equal(kept[0], host_ids):
            self.hits += 1
            return kept[1], kept[2]
        self.misses += 1
        taps, last = self.target.features(ids[None])
        taps, last = taps[0], last[0]
        size = taps.numel() * taps.element_size() + last.numel() * last.element_size()
        if kept is None and self.bytes + size <= self.capacity_bytes:
            on_host = (lambda x: x.clone()) if taps.device.type == "cpu" else (lambda x: x.cpu())
            self._rows[key] = (host_ids.clone(), on_host(taps), on_host(last))
            self.bytes += size
        else:
            self.uncached += 1
            if not self._full_logged and kept is None:
                self._full_logged = True
                log.warning("train.feature_cache_gib %.3g GiB: a row of %d tokens does not fit beside the %d rows "
                            "kept; a row that does not fit runs the target every time", self.capacity_bytes / GIB,
                            host_ids.numel(), len(self._rows))
        return taps, last

    def stats(self, reduce=None) -> dict:
        """{rows kept, bytes kept, hits, misses (target forwards), uncached (misses not kept: the budget full or a key
        collision), capacity_bytes_per_rank}. `reduce(float64 tensor[5]) -> tensor[5]`: sums the five counts over
        ranks (a collective every rank calls; the trainer's control plane), None = this rank's."""
        import torch

        counts = torch.tensor([len(self._rows), self.bytes, self.hits, self.misses, self.uncached],
                              dtype=torch.float64)
        counts = counts if reduce is None else reduce(counts)
        rows, kept, hits, misses, uncached = (int(x) for x in counts.tolist())
        return {"rows": rows, "bytes": kept, "hits": hits, "misses": misses, "uncached": uncached,
                "capacity_bytes_per_rank": self.capacity_bytes}
