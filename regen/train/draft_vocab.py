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

from typing import Iterable

import numpy as np


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
