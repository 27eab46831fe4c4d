"""Trainer feed: micro-batches of token shards for `regen train`, deterministic, per rank, resumable.

Reads the shards listed in `<run>/shards/manifest.json` (written by `regen render`; rows in
`schemas.shard.SHARD_SCHEMA`) in the order they are listed. Each shard's bytes are hashed and compared with the
manifest's `sha256` before anything in it is parsed: a shard that does not match is never read (policy
`on_bad_shard`: `"error"` raises InputError, `"skip"` logs it and leaves it out on every rank alike).

The global sample stream (identical on every rank, independent of world size and accumulation):

    manifest order -> rows -> drop held-out prompts (regen.train.heldout.is_heldout) and rows with fewer than
    min_loss_tokens supervised tokens after truncation to max_len -> seeded shuffle buffer -> windows of
    bucket_window samples sorted by length and cut into padded micro-batches of at most max_tokens
    (batch x longest) and max_batch rows -> the window's micro-batches in seeded order.

Global micro-batch `g` of an epoch belongs to optimizer step `g // (W*A)` and to rank `(g % (W*A)) % W`
(W = world_size, A = grad_accum), so W=2, A=1 and W=1, A=2 train on the same global batch. A trailing partial
step of an epoch is dropped (at most W*A-1 micro-batches) so ranks stay in lockstep without a collective.

Follow mode (`follow=True`): epoch 0 waits for shards to be appended to the manifest and ends when the manifest
says the producing run is finished: `"complete": true`, or `"status"` in {"complete", "finished", "done"}.
Waiting never changes the stream: the shuffle buffer and windows emit only when full or when the input is
finished, so a followed run sees the same samples in the same order as a run over the finished manifest.

Every rank reads (and checksums) every shard: the stream is computed identically on all ranks from metadata,
and each rank materializes only its own micro-batches; verified shard tables stay in a small LRU cache.

Position: `state_dict()` = {epoch, number of global micro-batches consumed in it, signature of the settings
that shape the stream}. `load_state_dict` fast-forwards over metadata only (lengths, spans, prompt ids), so a
resumed run sees exactly the samples it has not seen, even with another world size or accumulation.

Tensors (one MicroBatch): input_ids int64[B, S] (right-padded with pad_id), loss_mask bool[B, S],
attention_mask bool[B, S]; S = the longest row of the micro-batch (<= max_len).
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from regen.errors import InputError
from regen.train.heldout import is_heldout

log = logging.getLogger(__name__)

FINISHED_STATUSES = {"complete", "completed", "finished", "done"}
_META_COLUMNS = ["sample_id", "prompt_id", "num_tokens", "loss_spans"]


@dataclass(frozen=True)
class FeedConfig:
    """Settings of the feed. Those in `stream_fields()` shape the sample stream and are checked on resume."""

    seed: int = 0
    max_len: int = 256  # rows longer than this are truncated to max_len tokens
    truncate: str = "right"  # right: keep the first max_len tokens (DS); left: keep the last max_len
    max_tokens: int = 2048  # padded tokens per micro-batch (rows x longest row); must be >= max_len
    max_batch: int = 8  # rows per micro-batch at most
    shuffle_buffer: int = 256  # samples; 1 = manifest order
    bucket_window: int = 64  # samples sorted by length together; 1 = no bucketing
    min_loss_tokens: int = 14  # spec §5: rows with fewer supervised tokens are dropped
    heldout_fraction: float = 0.0  # prompts with regen.train.heldout.is_heldout(prompt_id, f) are never trained on
    heldout_picks: str = ""  # sha256 of the per-cell held-out picks (regen.train.heldout.HeldoutSplit); "" = none
    pad_id: int = 0
    on_bad_shard: str = "error"  # error | skip
    poll_s: float = 2.0  # follow mode: manifest polling interval
    follow_timeout_s: float = 0.0  # follow mode: give up after this long without a new shard (0 = never)
    cache_shards: int = 8  # verified shard tables kept in memory

    @classmethod
    def from_train(cls, cfg) -> "FeedConfig":
        """The feed's settings from a `TrainConfig` (`train.max_len`, `train.max_tokens`, ...; `train.follow_poll_s`
        is `poll_s`). A bare TrainConfig's seed null reads as 0 (a profile fills it with its own seed)."""
        return cls(seed=cfg.seed or 0, max_len=cfg.max_len, truncate=cfg.truncate, max_tokens=cfg.max_tokens,
                   max_batch=cfg.max_batch, shuffle_buffer=cfg.shuffle_buffer, bucket_window=cfg.bucket_window,
                   min_loss_tokens=cfg.min_loss_tokens, heldout_fraction=cfg.heldout_fraction,
                   on_bad_shard=cfg.on_bad_shard, poll_s=cfg.follow_poll_s, follow_timeout_s=cfg.follow_timeout_s)

    def stream_fields(self) -> dict:
        keys = ("seed", "max_len", "truncate", "max_tokens", "max_batch", "shuffle_buffer", "bucket_window",
                "min_loss_tokens", "heldout_fraction")
        d = asdict(self)
        # the picks enter the signature only when there are some: a checkpoint written before them resumes as it did
        return {k: d[k] for k in keys} | ({"heldout_picks": self.heldout_picks} if self.heldout_picks else {})

    def signature(self) -> str:
        return hashlib.sha256(json.dumps(self.stream_fields(), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class SampleRef:
    """One row of one shard, known from metadata only. `shard` is its index in manifest order."""

    shard: int
    row: int
    sample_id: str
    num_tokens: int  # after truncation to max_len
    start: int = 0  # first kept token of the row (> 0 when truncated on the left)


@dataclass
class MicroBatch:
    """A padded micro-batch for one rank. `index` is its global micro-batch index within `epoch`."""

    epoch: int
    index: int
    sample_ids: list[str]
    input_ids: object  # torch.LongTensor [B, S]
    loss_mask: object  # torch.BoolTensor [B, S]
    attention_mask: object  # torch.BoolTensor [B, S]

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


@dataclass
class Step:
    """One optimizer step's share for this rank: `grad_accum` micro-batches."""

    epoch: int
    index: int  # step index within the epoch
    microbatches: list[MicroBatch] = field(default_factory=list)


def window_spans(spans: list[dict], start: int, length: int) -> list[tuple[int, int]]:
    """Loss spans [{start, end}] (absolute token positions) cut to the window [start, start + length), as
    (lo, hi) positions relative to the window; empty cuts are dropped."""
    cut = ((max(sp["start"], start) - start, min(sp["end"], start + length) - start) for sp in spans)
    return [(lo, hi) for lo, hi in cut if hi > lo]


def stable_hash(*parts) -> int:
    h = hashlib.blake2b(":".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little")


def manifest_entries(manifest: dict) -> list[dict]:
    """The shard list of a shards manifest: `manifest["shards"]` (or `"files"`), each with a path and sha256."""
    entries = manifest.get("shards", manifest.get("files"))
    if not isinstance(entries, list):
        raise InputError("shards/manifest.json: no 'shards' list; re-run `regen render` to write the manifest")
    out = []
    for i, e in enumerate(entries):
        path = e.get("path") or e.get("file") or e.get("name")
        if not path or not e.get("sha256"):
            raise InputError(f"shards/manifest.json: shards[{i}] lacks 'path' or 'sha256'; re-run `regen render`")
        out.append({"path": path, "sha256": e["sha256"], "rows": e.get("rows")})
    return out


def manifest_finished(manifest: dict) -> bool:
    """True when the producing run says it is done: `complete: true` or a finished `status`."""
    if manifest.get("complete") is True or manifest.get("finished") is True:
        return True
    return str(manifest.get("status", "")).lower() in FINISHED_STATUSES


class ShardFeed:
    """Iterate optimizer steps of padded micro-batches over a shards directory (see the module docstring).

    `heldout(prompt_id) -> bool` defaults to `regen.train.heldout.is_heldout(prompt_id, cfg.heldout_fraction)` when the
    fraction is > 0. Raises InputError for a missing manifest (unless following), a shard whose checksum does
    not match (policy "error"), a manifest whose listed prefix changed, or a resume with other stream settings.
    """

    def __init__(self, shards_dir: str | Path, cfg: FeedConfig, *, rank: int = 0, world_size: int = 1,
                 grad_accum: int = 1, follow: bool = False, heldout: Callable[[str], bool] | None = None):
        if cfg.max_tokens < cfg.max_len:
            raise InputError(f"train.max_tokens ({cfg.max_tokens}) must be >= train.max_len ({cfg.max_len})")
        if cfg.truncate not in ("right", "left"):
            raise InputError(f"train.truncate={cfg.truncate!r}: allowed values are 'right' and 'left'")
        if cfg.on_bad_shard not in ("error", "skip"):
            raise InputError(f"train.on_bad_shard={cfg.on_bad_shard!r}: allowed values are 'error' and 'skip'")
        if not 0 <= rank < world_size or grad_accum < 1:
            raise ValueError(f"bad rank/world_size/grad_accum {rank}/{world_size}/{grad_accum}")
        self.dir = Path(shards_dir)
        self.cfg = cfg
        self.rank, self.world_size, self.grad_accum = rank, world_size, grad_accum
        self.follow = follow
        if heldout is None and cfg.heldout_fraction > 0:
            frac = cfg.heldout_fraction
            heldout = lambda pid: is_heldout(pid, frac)  # noqa: E731
        self.heldout = heldout
        self.epoch = 0
        self.consumed = 0  # global micro-batches of self.epoch already handed out (all ranks)
        self.stats = {"shards_read": 0, "shards_skipped": [], "rows_heldout": 0, "rows_short": 0,
                      "rows_truncated": 0, "microbatches_dropped": 0}
        self._entries: list[dict] = []  # manifest prefix seen so far (append-only)
        self._tables: OrderedDict[int, pa.Table] = OrderedDict()
        self._bad: set[int] = set()

    # -- position ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"version": 1, "epoch": self.epoch, "consumed": self.consumed, "signature": self.cfg.signature(),
                "stream": self.cfg.stream_fields()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("signature") != self.cfg.signature():
            raise InputError(
                f"feed position was saved with stream settings {state.get('stream')} but the profile now gives "
                f"{self.cfg.stream_fields()}; restore those train.* values to resume exactly, or start a new run dir")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])

    # -- manifest and shards ----------------------------------------------------------------------------------
    def _read_manifest(self) -> tuple[list[dict], bool] | None:
        path = self.dir / "manifest.json"
        if not path.exists():
            return None
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        entries = manifest_entries(manifest)
        for i, (old, new) in enumerate(zip(self._entries, entries)):
            if old["path"] != new["path"] or old["sha256"] != new["sha256"]:
                raise InputError(f"{path}: shards[{i}] changed from {old['path']} to {new['path']} "
                                 f"(sha256 {new['sha256'][:12]}); shards may only be appended while training")
        if len(entries) < len(self._entries):
            raise InputError(f"{path}: lists {len(entries)} shards, fewer than the {len(self._entries)} seen")
        self._entries = entries
        return entries, manifest_finished(manifest)

    def _table(self, i: int, columns: list[str] | None = None) -> pa.Table | None:
        """Shard i's table after its checksum matched; None if it was skipped for a bad checksum."""
        if i in self._bad:
            return None
        if i in self._tables:
            self._tables.move_to_end(i)
            t = self._tables[i]
            return t.select(columns) if columns else t
        entry = self._entries[i]
        path = self.dir / entry["path"]
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise InputError(f"{path}: listed in shards/manifest.json but missing; re-run `regen render`") from None
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry["sha256"]:
            msg = (f"{path}: sha256 {digest[:16]}... does not match the manifest's {entry['sha256'][:16]}...; "
                   "the shard was changed or corrupted after it was listed: re-render it or set train.on_bad_shard=skip")
            if self.cfg.on_bad_shard == "error":
                raise InputError(msg)
            log.warning("skipping shard: %s", msg)
            self._bad.add(i)
            self.stats["shards_skipped"].append(entry["path"])
            return None
        table = pq.read_table(pa.BufferReader(data), columns=_META_COLUMNS + ["input_ids"])
        self.stats["shards_read"] += 1
        self._tables[i] = table
        while len(self._tables) > self.cfg.cache_shards:
            self._tables.popitem(last=False)
        return table.select(columns) if columns else table

    def _shard_refs(self, i: int) -> list[SampleRef]:
        table = self._table(i, _META_COLUMNS)
        if table is None:
            return []
        refs = []
        cfg = self.cfg
        cols = table.to_pydict()
        for row, (sid, pid, n, spans) in enumerate(zip(cols["sample_id"], cols["prompt_id"], cols["num_tokens"],
                                                        cols["loss_spans"])):
            if self.heldout is not None and self.heldout(pid):
                self.stats["rows_heldout"] += 1
                continue
            n_kept = min(int(n), cfg.max_len)
            start = int(n) - n_kept if cfg.truncate == "left" else 0
            if n_kept < n:
                self.stats["rows_truncated"] += 1
            num_loss = sum(hi - lo for lo, hi in window_spans(spans, start, n_kept))
            if num_loss < cfg.min_loss_tokens:
                self.stats["rows_short"] += 1
                continue
            refs.append(SampleRef(i, row, sid, n_kept, start))
        return refs

    def _refs(self, epoch: int) -> Iterator[SampleRef]:
        """Rows in manifest order; in follow mode epoch 0 waits for more shards until the run is finished."""
        i = 0
        waited_since = time.monotonic()
        for k in ("rows_heldout", "rows_short", "rows_truncated"):
            self.stats[k] = 0
        while True:
            got = self._read_manifest()
            if got is None and not (self.follow and epoch == 0):
                raise InputError(f"{self.dir / 'manifest.json'} not found: run `regen render` first "
                                 "(or train with --follow while it runs)")
            entries, finished = got if got is not None else ([], False)
            while i < len(entries):
                yield from self._shard_refs(i)
                i += 1
                waited_since = time.monotonic()
            if finished or not (self.follow and epoch == 0):
                if not finished and epoch == 0:
                    log.warning("shards/manifest.json is not marked complete; training on the %d shards listed", i)
                return
            if self.cfg.follow_timeout_s and time.monotonic() - waited_since > self.cfg.follow_timeout_s:
                raise InputError(f"{self.dir / 'manifest.json'}: no new shard for {self.cfg.follow_timeout_s:.0f} s "
                                 "and not marked complete; is `regen render` still running?")
            time.sleep(self.cfg.poll_s)

    # -- the stream -------------------------------------------------------------------------------------------
    def _shuffled(self, refs: Iterator[SampleRef], epoch: int) -> Iterator[SampleRef]:
        buf: list[SampleRef] = []
        n = 0

        def pop() -> SampleRef:
            nonlocal n
            j = stable_hash(self.cfg.seed, epoch, "shuffle", n) % len(buf)
            n += 1
            buf[j], buf[-1] = buf[-1], buf[j]
            return buf.pop()

        for r in refs:
            buf.append(r)
            if len(buf) >= self.cfg.shuffle_buffer:
                yield pop()
        while buf:
            yield pop()

    def _pack(self, window: list[SampleRef], epoch: int, w: int) -> list[list[SampleRef]]:
        cfg = self.cfg
        rows = sorted(window, key=lambda r: (-r.num_tokens, r.sample_id))
        batches, cur = [], []
        for r in rows:  # longest first: the first row of a batch is its longest
            if cur and ((len(cur) + 1) * cur[0].num_tokens > cfg.max_tokens or len(cur) >= cfg.max_batch):
                batches.append(cur)
                cur = []
            cur.append(r)
        if cur:
            batches.append(cur)
        for k in range(len(batches) - 1, 0, -1):  # seeded Fisher-Yates over the window's batches
            j = stable_hash(cfg.seed, epoch, "window", w, k) % (k + 1)
            batches[k], batches[j] = batches[j], batches[k]
        return batches

    def _global_microbatches(self, epoch: int) -> Iterator[list[SampleRef]]:
        window, w = [], 0
        for r in self._shuffled(self._refs(epoch), epoch):
            window.append(r)
            if len(window) >= self.cfg.bucket_window:
                yield from self._pack(window, epoch, w)
                window, w = [], w + 1
        if window:
            yield from self._pack(window, epoch, w)

    def _materialize(self, refs: list[SampleRef], epoch: int, index: int) -> MicroBatch:
        import torch

        width = max(r.num_tokens for r in refs)
        input_ids = torch.full((len(refs), width), self.cfg.pad_id, dtype=torch.long)
        loss_mask = torch.zeros((len(refs), width), dtype=torch.bool)
        attention_mask = torch.zeros((len(refs), width), dtype=torch.bool)
        for b, r in enumerate(refs):
            table = self._table(r.shard)
            if table is None:  # verified earlier; changed on disk since and now skipped
                raise InputError(f"shard {self._entries[r.shard]['path']} changed on disk while training")
            n, o = r.num_tokens, r.start
            ids = table.column("input_ids")[r.row].values.to_numpy(zero_copy_only=False)[o:o + n]
            input_ids[b, :n] = torch.from_numpy(ids.astype("int64"))
            attention_mask[b, :n] = True
            for lo, hi in window_spans(table.column("loss_spans")[r.row].as_py(), o, n):
                loss_mask[b, lo:hi] = True
        return MicroBatch(epoch, index, [r.sample_id for r in refs], input_ids, loss_mask, attention_mask)

    def steps(self, num_epochs: int | None = 1) -> Iterator[Step]:
        """Yield this rank's steps from the saved position on; `num_epochs=None` repeats without end.

        The position advances when a step is yielded: `state_dict()` taken after training on it resumes after it.
        """
        group = self.world_size * self.grad_accum
        while num_epochs is None or self.epoch < num_epochs:
            epoch, pending, start = self.epoch, [], self.consumed
            for g, refs in enumerate(self._global_microbatches(epoch)):
                if g < start:
                    continue
                pending.append((g, refs))
                if len(pending) == group:
                    mine = [self._materialize(refs, epoch, g) for k, (g, refs) in enumerate(pending)
                            if k % self.world_size == self.rank]
                    self.consumed = pending[-1][0] + 1
                    yield Step(epoch, pending[0][0] // group, mine)
                    pending = []
            self.stats["microbatches_dropped"] += len(pending)
            self.epoch, self.consumed = epoch + 1, 0

    def plan(self, num_epochs: int | None, num_steps: int, drop: Callable[[int, range], None]):
        """Every rank's micro-batches of the next `num_steps` optimizer steps from the saved position, in global
        order: (epoch, global index, MicroBatch, consuming rank), the rank being the one `steps()` gives it to.

        Yields each micro-batch as soon as the stream has it (follow mode may wait for shards in between), so a
        feature producer can start before its step is complete; the micro-batches of an epoch's trailing partial
        step, which `steps()` drops, are announced with `drop(epoch, range)` when the epoch ends. Advances this
        feed's position like `steps()` (a dispatcher's own feed, never the training one)."""
        group = self.world_size * self.grad_accum
        remaining = num_steps * group
        while remaining > 0 and (num_epochs is None or self.epoch < num_epochs):
            epoch, start, end = self.epoch, self.consumed, self.consumed
            for g, refs in enumerate(self._global_microbatches(epoch)):
                if g < start:
                    continue
                if remaining <= 0:
                    return
                yield epoch, g, self._materialize(refs, epoch, g), (g % group) % self.world_size
                remaining -= 1
                end = g + 1
            tail = (end - start) % group
            if tail:
                drop(epoch, range(end - tail, end))
                remaining += tail
            self.epoch, self.consumed = epoch + 1, 0

    def supervised_token_counts(self, vocab_size: int):
        """int64[vocab_size]: how often each token id is a supervised (loss-masked) token in this feed's training
        rows, i.e. the shards listed now, held-out and short rows dropped, each row cut to its `max_len` window
        as training sees it. Reads (and checksums) every listed shard; does not move the feed position.
        Raises InputError when no shard is listed yet or a row has an id >= vocab_size."""
        import numpy as np

        got = self._read_manifest()
        if not got or not got[0]:
            raise InputError(f"{self.dir / 'manifest.json'}: no shard listed yet to count supervised tokens in")
        saved = {k: (list(v) if isinstance(v, list) else v) for k, v in self.stats.items()}
        counts = np.zeros(vocab_size, dtype=np.int64)
        for i in range(len(got[0])):
            table, spans = self._table(i), []
            if table is None:  # a bad shard under on_bad_shard=skip: training skips it too
                continue
            for r in self._shard_refs(i):
                ids = table.column("input_ids")[r.row].values.to_numpy(zero_copy_only=False)[r.start:]
                spans += [ids[lo:hi] for lo, hi in window_spans(table.column("loss_spans")[r.row].as_py(),
                                                                 r.start, r.num_tokens)]
            if not spans:
                continue
            tokens = np.concatenate(spans).astype(np.int64)
            if int(tokens.max()) >= vocab_size:
                raise InputError(f"{self.dir / self._entries[i]['path']}: token id {int(tokens.max())} >= the "
                                 f"target's vocab_size {vocab_size}; the shards were rendered with another "
                                 "tokenizer than the target's")
            counts += np.bincount(tokens, minlength=vocab_size)
        self.stats = saved
        return counts

    def listed_shards(self) -> int:
        """Shards listed in the manifest as last read."""
        return len(self._entries)

    def wait_for_first_shard(self) -> None:
        """Poll the manifest (every `poll_s`) until it lists a shard; InputError after `follow_timeout_s` (0 = no
        limit) without one."""
        t0 = time.monotonic()
        while True:
            got = self._read_manifest()
            if got and got[0]:
                return
            if self.cfg.follow_timeout_s and time.monotonic() - t0 > self.cfg.follow_timeout_s:
                raise InputError(f"{self.dir / 'manifest.json'}: no shard listed after {self.cfg.follow_timeout_s:.0f} "
                                 "s; is `regen render` running?")
            time.sleep(self.cfg.poll_s)

    def count_steps(self, num_epochs: int = 1) -> int:
        """Optimizer steps in `num_epochs` full epochs over the listed shards (metadata only, no position change)."""
        total = 0
        group = self.world_size * self.grad_accum
        for epoch in range(num_epochs):
            total += sum(1 for _ in self._global_microbatches(epoch)) // group
        return total
