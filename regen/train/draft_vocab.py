"""The reduced draft vocabulary: the most frequent supervised tokens of the training shards.

EAGLE-3 (Li et al. 2025, arXiv 2503.01840) trains its draft's output layer over a reduced vocabulary, the
`draft_vocab_size` most frequent tokens of the training data (SpecForge `generate_vocab_mapping`), and maps
draft indices back to target ids with `d2t`; FR-Spec (arXiv 2502.14856) measures that a frequency-ranked
subset keeps most of the acceptance at a fraction of the LM-head cost. Here it serves CPU training on a
262K-vocabulary target: the vocabulary-wide CE + L1 terms (spec §5) cost O(Vd) per slot instead of O(V).

    counts = feed.supervised_token_counts(V)                    # regen.train.feed.ShardFeed, training rows only
    ids, report = select_draft_vocab(counts, 4096, always=eos)  # int64[Vd] ascending
    draft.set_draft_vocab(ids)                                   # regen.train.model.DSparkDraft (d2t/t2d buffers)
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable

import numpy as np

from regen.errors import InputError

log = logging.getLogger(__name__)


def select_draft_vocab(counts: np.ndarray, size: int, always: Iterable[int] = ()) -> tuple[np.ndarray, dict]:
    """The `size` target ids the draft may propose: `always` (e.g. stop tokens) first, then the most frequent
    supervised tokens (ties broken by the lower id), then, when fewer than `size` tokens were seen, the lowest
    unseen ids as filler (as SpecForge fills its mapping).

    counts: int64[V] supervised-token counts (`ShardFeed.supervised_token_counts`). Returns (int64[size]
    ascending, report {size, distinct_seen, supervised_tokens, coverage}) where coverage is the share of the
    supervised tokens inside the vocabulary. Raises ValueError when size is not in [1, V] or `always` has
    more ids than size or an id outside [0, V).
    """
    counts = np.asarray(counts, dtype=np.int64)
    V = counts.shape[0]
    forced = sorted({int(t) for t in always})
    if not 1 <= size <= V:
        raise ValueError(f"draft vocabulary size {size} must be in [1, {V}]")
    if forced and (forced[0] < 0 or forced[-1] >= V or len(forced) > size):
        raise ValueError(f"always-included ids {forced[:8]} must be < {V} and at most {size} of them")
    order = np.lexsort((np.arange(V), -counts))  # by count descending, then id ascending
    chosen = np.zeros(V, dtype=bool)
    chosen[forced] = True
    need = size - int(chosen.sum())
    ranked = order[~chosen[order]]
    chosen[ranked[:need]] = True  # zero-count ids come last in `ranked`, lowest id first: the filler
    ids = np.flatnonzero(chosen).astype(np.int64)
    total = int(counts.sum())
    report = {"size": size, "distinct_seen": int((counts > 0).sum()), "supervised_tokens": total,
              "coverage": float(counts[chosen].sum()) / total if total else 0.0}
    return ids, report


def draft_vocabulary(draft_cfg, feed, resume_from, *, follow: bool = False):
    """(target ids int64[Vd] or None, report dict or None) of the reduced draft vocabulary (`regen.train.draft_vocab`).

    A resumed run keeps its checkpoint's vocabulary (the `d2t` weight); a new one takes the Vd most frequent
    supervised tokens of the feed's training rows, stop tokens always included, chosen on rank 0 and broadcast
    (ranks may read the manifest at different moments). With `follow`, it waits for the first shard and uses
    the shards listed then: rows rendered later keep only their supervised tokens inside it. Raises InputError
    for a checkpoint of another vocabulary size or an impossible size.
    """
    import torch
    import torch.distributed as dist

    V, Vd = draft_cfg.vocab_size, draft_cfg.draft_vocab_size
    if not Vd:
        return None, None
    if resume_from is not None:
        from safetensors import safe_open

        from regen.train.model import CONFIG_NAME, WEIGHTS_NAME

        saved = json.loads((Path(resume_from) / CONFIG_NAME).read_text()).get("draft_vocab_size", 0)
        if saved != Vd:
            raise InputError(f"{resume_from}: the checkpoint has draft_vocab_size={saved}, the profile gives {Vd}; "
                             "resume with the same train.* settings or use a new run directory (or --out)")
        with safe_open(str(Path(resume_from) / WEIGHTS_NAME), framework="pt") as f:
            d2t = f.get_tensor("d2t")
        return d2t + torch.arange(d2t.numel()), {"size": int(d2t.numel()), "from": str(resume_from)}
    ids, report = torch.zeros(Vd, dtype=torch.long), None
    if dist.get_rank() == 0:
        if follow:
            feed.wait_for_first_shard()
        counts = feed.supervised_token_counts(V)
        try:
            chosen, report = select_draft_vocab(counts, Vd, always=draft_cfg.eos_token_id)
        except ValueError as exc:
            raise InputError(f"train.draft_vocab_size={Vd}: {exc}") from None
        report["shards_counted"] = feed.listed_shards()
        ids = torch.from_numpy(chosen)
        log.info("draft vocabulary: %d ids, %d distinct supervised tokens seen, coverage %.4f", report["size"],
                 report["distinct_seen"], report["coverage"])
    if dist.get_world_size() > 1:
        from regen.train.collectives import control_broadcast, control_broadcast_object_list

        box = [report]
        control_broadcast_object_list(box, src=0)
        report = box[0]
        control_broadcast(ids, 0, "the draft vocabulary's target ids")
    return ids, report
