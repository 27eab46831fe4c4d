"""Near-duplicate detection: batched MinHash signatures + LSH banding (datasketch's band parameters).

Shingles: character `shingle_chars`-grams of the normalized text (NFKC, lowercase, whitespace collapsed;
the first `max_chars` characters), hashed with a polynomial rolling hash mod 2^32 and MurmurHash3's fmix32.
A text shorter than one shingle is one shingle (zero padded).

Signature (uint32[num_perm]): one-permutation hashing (Li, Owen & Zhang, NIPS 2012): shingle hash h goes to
bin h mod num_perm and each bin keeps its minimum; empty bins are filled by rotation densification
(Shrivastava & Li, ICML 2014): the nearest non-empty bin to the right, plus an offset per step. Collision
probability per entry is about the Jaccard similarity, like classic MinHash, at the cost of one hash per
shingle instead of num_perm (vectorized per batch with `np.minimum.at`). The estimated Jaccard of two
prompts is the share of equal signature entries.

LSH: `num_perm` values cut into b bands of r rows, (b, r) from `datasketch.lsh._optimal_param(threshold,
num_perm, 0.5, 0.5)` (the parameters `datasketch.MinHashLSH` chooses; Leskovec et al., Mining of Massive
Datasets ch. 3.4). Prompts whose band values collide are candidates; each candidate is verified against the
first prompt of its bucket (estimated Jaccard >= threshold). A prompt with a verified earlier match is a near
duplicate; the earliest prompt of a group is kept. Buckets are found with vectorized sorting instead of
`MinHashLSH`'s Python dicts, which at 1M prompts would cost several GiB.
"""
from __future__ import annotations

import numpy as np

from filters.text import normalize_text

_MAX32 = np.uint32(0xFFFFFFFF)


def _splitmix(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3 finalizer on uint32 arrays."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


class MinHasher:
    """Batched MinHash signatures (see module docstring). `signatures(texts) -> uint32[len(texts), num_perm]`."""

    def __init__(self, num_perm: int = 128, shingle_chars: int = 5, max_chars: int = 4096):
        self.num_perm = num_perm
        self.n = shingle_chars
        self.max_chars = max_chars

    def shingles(self, texts: list[str], normalized: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(doc index int32[S], shingle hash uint32[S]) for every shingle of every text.

        `normalized`: the texts are already `normalize_text` output (skips normalizing again).
        """
        n = self.n
        norm = [(t if normalized else normalize_text(t))[: self.max_chars] or " " for t in texts]
        sep = "\x00" * (n - 1)
        cps = np.frombuffer((sep.join(norm) + sep).encode("utf-32-le"), dtype=np.uint32)
        lens = np.fromiter((len(t) for t in norm), dtype=np.int64, count=len(norm))
        total = len(cps) - (n - 1)
        h = np.zeros(total, dtype=np.uint32)
        for j in range(n):
            h *= np.uint32(1000003)
            h += cps[j : j + total]
        stride = lens + (n - 1)
        starts = np.zeros(len(norm), dtype=np.int64)
        np.cumsum(stride[:-1], out=starts[1:])
        num_windows = np.maximum(lens - n + 1, 1)
        valid = np.ones(total, dtype=bool)
        for o in range(2 * n - 2):  # window starts past each text's last window (inside the separator)
            at = starts + num_windows + o
            at = at[(at < starts + stride) & (at < total)]
            valid[at] = False
        marks = np.zeros(total, dtype=np.int32)
        marks[starts[1:]] = 1
        doc = np.cumsum(marks, dtype=np.int32)
        return doc[valid], _fmix32(h[valid])

    def signatures(self, texts: list[str], normalized: bool = False) -> np.ndarray:
        """uint32[len(texts), num_perm] signatures (one-permutation hashing with rotation densification)."""
        k = self.num_perm
        d = len(texts)
        if d == 0:
            return np.zeros((0, k), dtype=np.uint32)
        doc, hv = self.shingles(texts, normalized)
        flat = np.full(d * k, _MAX32, dtype=np.uint32)
        np.minimum.at(flat, doc.astype(np.int64) * k + (hv % np.uint32(k)), hv)
        sig = flat.reshape(d, k)
        empty = sig == _MAX32
        if empty.any():
            twice = np.concatenate([sig, sig], axis=1)
            idx = np.where(np.concatenate([~empty, ~empty], axis=1), np.arange(2 * k)[None, :], 4 * k)
            nxt = np.minimum.accumulate(idx[:, ::-1], axis=1)[:, ::-1][:, :k]
            dist = (nxt - np.arange(k)[None, :]).astype(np.uint32)
            borrowed = np.take_along_axis(twice, nxt, axis=1) + dist * np.uint32(0x9E3779B1)
            sig = np.where(empty, borrowed, sig)
        return sig


def lsh_params(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows) minimizing false positives + negatives at `threshold` (datasketch's optimizer)."""
    from datasketch.lsh import _optimal_param

    return _optimal_param(threshold, num_perm, 0.5, 0.5)


def estimated_jaccard(sig: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Share of equal signature entries for pairs (i, j): float64[len(i)]."""
    out = np.empty(len(i), dtype=np.float64)
    for s in range(0, len(i), 65536):
        out[s : s + 65536] = (sig[i[s : s + 65536]] == sig[j[s : s + 65536]]).mean(axis=1)
    return out


def near_duplicates(sig: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Near duplicates among signatures in stream order.

    Returns `(dup_index, match_index, jaccard)`: each prompt `dup_index[k]` has a verified earlier match
    `match_index[k]` (the earliest verified one) with estimated Jaccard `jaccard[k]` >= threshold.
    """
    n, k = sig.shape
    if n < 2:
        e = np.zeros(0, dtype=np.int64)
        return e, e, np.zeros(0)
    bands, rows = lsh_params(threshold, k)
    rng = np.random.default_rng(7)
    mult = rng.integers(1, 2**63, rows, dtype=np.uint64) | np.uint64(1)
    cand_i, cand_j = [], []
    for band in range(bands):
        block = sig[:, band * rows : (band + 1) * rows].astype(np.uint64)
        key = _splitmix((block * mult[None, :]).sum(axis=1) + np.uint64(band))
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        rep = first[inverse.ravel()]
        m = rep != np.arange(n)
        cand_i.append(np.nonzero(m)[0])
        cand_j.append(rep[m])
    ci = np.concatenate(cand_i)
    cj = np.concatenate(cand_j)
    if not len(ci):
        e = np.zeros(0, dtype=np.int64)
        return e, e, np.zeros(0)
    pairs = np.unique(np.stack([ci, cj], axis=1), axis=0)
    jac = estimated_jaccard(sig, pairs[:, 0], pairs[:, 1])
    ok = jac >= threshold
    pairs, jac = pairs[ok], jac[ok]
    # earliest verified match per duplicate: pairs are sorted by (i, j), so the first row of each i
    if not len(pairs):
        e = np.zeros(0, dtype=np.int64)
        return e, e, np.zeros(0)
    firsts = np.ones(len(pairs), dtype=bool)
    firsts[1:] = pairs[1:, 0] != pairs[:-1, 0]
    return pairs[firsts, 0], pairs[firsts, 1], jac[firsts]
