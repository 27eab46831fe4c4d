"""The held-out split: which prompts the trainer never sees and every evaluation measures.

Two parts: the sha256 bucket of the prompt id (`train.heldout_fraction`, `regen.train.eval.is_heldout`), and, with
`train.heldout_per_cell` > 0, per-cell picks: so that every category x length band x mode cell of the run's first
selection has held-out prompts (a 15% bucket of a 4-prompt cell is empty more often than not, and the loop aims at
cells), its prompts in sha256 order are added until min(per_cell, max(1, cell size // 2)) are held out
(`cell_picks`): at most half of a cell, except that a cell of one prompt gives it to the evaluation.
The first selection only (not the loop's parts): a loop round adds prompts and must not move the split.

The trainer records the split (`HeldoutSplit.record`) in `<training dir>/heldout.json` and in each checkpoint's
training.json (`heldout`); `regen eval` keeps to it (`eval_heldout_split`): the buckets are nested (a smaller
fraction's prompts are held out by every larger one), so evaluating at a fraction above the trained one would
measure prompts the draft trained on, and the per-cell picks are rebuilt from the selection and checked against
the recorded sha256.
"""
from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

HELDOUT_RULE = "sha256(prompt_id) mod 10^6 < round(heldout_fraction * 10^6) (regen.train.eval.is_heldout)"
HELDOUT_BUCKETS = 1_000_000


def is_heldout(prompt_id: str, fraction: float) -> bool:
    """True for the `fraction` of prompt ids kept out of training: sha256(prompt_id) mod 10⁶ < fraction·10⁶."""
    if fraction <= 0:
        return False
    h = int(hashlib.sha256(prompt_id.encode("utf-8")).hexdigest(), 16)
    return h % HELDOUT_BUCKETS < round(fraction * HELDOUT_BUCKETS)


def recorded_heldout(draft_dir: Path) -> dict | None:
    """The held-out split a trainer checkpoint was trained with: {"fraction", "rule", "source"} from its
    training.json (`heldout`, or the older `profile_train.heldout_fraction`), or None for a folder without one."""
    from schemas.io import read_json

    training = read_json(Path(draft_dir) / "training.json") or {}
    if isinstance(training.get("heldout"), dict):
        return {**training["heldout"], "source": str(Path(draft_dir) / "training.json")}
    frac = (training.get("profile_train") or {}).get("heldout_fraction")
    if frac is None:
        return None
    return {"fraction": float(frac), "rule": HELDOUT_RULE, "source": f"{Path(draft_dir) / 'training.json'} "
            "(profile_train)"}


def eval_heldout_split(run, asked: float, asked_per_cell: int, drafts: dict) -> tuple["HeldoutSplit", dict]:
    """(the split to evaluate on, how it was chosen) for the profile's `train.heldout_fraction` (`asked`) and
    `train.heldout_per_cell`, and the trained drafts {name: step folder}. The splits recorded at training time win:
    the prompts held out from every draft (the smallest recorded fraction's bucket, and the per-cell picks every
    draft held out). Raises InputError when `asked` is larger than a draft's recorded fraction (it would put that
    draft's training prompts into the evaluation: the buckets are nested, `is_heldout`), or when the run's first
    selection no longer gives the per-cell picks a draft recorded (another selection than it was trained on),
    naming both and the fix."""
    from regen.errors import InputError

    records = {name: recorded_heldout(d) for name, d in drafts.items()}
    known = {name: r for name, r in records.items() if r is not None}
    if not known:
        split = heldout_split(run, asked, asked_per_cell)
        return split, {**split.record(), "chosen_by": "the profile's train.heldout_fraction and heldout_per_cell "
                       "(no draft records its training split)"}
    fraction = min(r["fraction"] for r in known.values())  # held out from every trained draft
    if asked > fraction:
        name = min(known, key=lambda n: known[n]["fraction"])
        raise InputError(f"train.heldout_fraction={asked} asks to evaluate on prompts the draft {name!r} was trained "
                         f"on: it was trained with heldout_fraction={fraction} ({known[name]['source']}); evaluate "
                         f"with --set train.heldout_fraction={fraction} (or less), or retrain with a larger one")
    splits, cells = {}, first_selection_cells(run)  # the selection read once for every draft's picks
    for name, r in known.items():
        f, k = r["fraction"], int(r.get("per_cell") or 0)
        splits[name] = HeldoutSplit(float(f), k, cell_picks(cells, f, k))
        if splits[name].per_cell and splits[name].picks_sha256 != r.get("picks_sha256"):
            raise InputError(f"{r['source']}: the draft {name!r} held out {r.get('num_picks')} per-cell prompts of "
                             f"another selection than {run.prompts} gives now ({len(splits[name].picks)}): evaluate "
                             "it on the run it was trained on, or retrain on this one")
    per_cell = min(s.per_cell for s in splits.values())
    candidates = set().union(*(s.picks for s in splits.values()))
    picks = frozenset(p for p in candidates if all(s(p) for s in splits.values()))
    split = HeldoutSplit(fraction, per_cell, picks if per_cell else frozenset())
    return split, {**split.record(), "asked": asked, "chosen_by": "the split recorded at training time",
                   "sources": {name: r["source"] for name, r in known.items()},
                   **({"unrecorded": sorted(set(records) - set(known))} if len(known) < len(records) else {})}


CELL_RULE = ("per cell (category, length_band, mode) of the run's first selection (the parts prompts/manifest.json "
             "lists, not the loop's part-loop-*): the cell's prompts in sha256(prompt_id) order are held out until "
             "min(per_cell, max(1, cell size // 2)) of them are (the bucket's count toward it) "
             "(regen.train.heldout.cell_picks)")


@dataclass(frozen=True)
class HeldoutSplit:
    """The prompts kept out of training, for the trainer's feed and every evaluation: the sha256 bucket
    (`is_heldout(prompt_id, fraction)`) and `picks`, the prompts added so that every cell of the run's first
    selection has held-out prompts (`cell_picks`). Call it with a prompt id: True when held out."""

    fraction: float
    per_cell: int = 0
    picks: frozenset = frozenset()

    def __call__(self, prompt_id: str) -> bool:
        return prompt_id in self.picks or is_heldout(prompt_id, self.fraction)

    @property
    def picks_sha256(self) -> str:
        return hashlib.sha256("\n".join(sorted(self.picks)).encode("utf-8")).hexdigest()

    def record(self) -> dict:
        """What the trainer writes to heldout.json and training.json (`heldout`): enough to rebuild and check it."""
        return {"fraction": self.fraction, "rule": HELDOUT_RULE, "per_cell": self.per_cell,
                **({"cell_rule": CELL_RULE, "num_picks": len(self.picks), "picks_sha256": self.picks_sha256}
                   if self.per_cell > 0 else {})}


def as_split(heldout) -> HeldoutSplit:
    """`heldout` as a HeldoutSplit: a split as is, a float as the bucket alone (no per-cell picks)."""
    return heldout if isinstance(heldout, HeldoutSplit) else HeldoutSplit(float(heldout))


def first_selection_cells(run) -> dict[str, tuple]:
    """{prompt_id: (category, length_band, mode)} of the run's first selection: the parts `prompts/manifest.json`
    lists, without the loop's `part-loop-*` (a loop round adds prompts, it must not move the held-out split); {}
    without a selection."""
    import pyarrow.parquet as pq

    from schemas.io import read_json

    manifest = read_json(Path(run.prompts) / "manifest.json") or {}
    out: dict[str, tuple] = {}
    for part in manifest.get("parts") or []:
        f = Path(run.prompts) / part["path"]
        if f.name.startswith("part-loop-"):
            continue
        names = set(pq.ParquetFile(f).schema_arrow.names)
        cols = [c for c in ("category", "length_band", "mode") if c in names]
        t = pq.read_table(f, columns=["prompt_id", *cols]).to_pydict()
        for i, pid in enumerate(t["prompt_id"]):
            out[pid] = tuple(t[c][i] if c in t else None for c in ("category", "length_band", "mode"))
    return out


def cell_picks(cells: dict[str, tuple], fraction: float, per_cell: int) -> frozenset:
    """The prompt ids held out beyond the bucket so that each cell of `cells` ({prompt_id: cell}) has
    min(per_cell, max(1, cell size // 2)) held-out prompts: the cell's prompts not in the bucket, in
    sha256(prompt_id) order. At most half of a cell is held out, except a cell of one prompt: measuring every cell
    is worth more than one training prompt (the loop adds more where a cell is weak)."""
    if per_cell <= 0:
        return frozenset()
    members: dict[tuple, list[str]] = defaultdict(list)
    for pid, cell in cells.items():
        members[cell].append(pid)
    picks = set()
    for pids in members.values():
        want = min(per_cell, max(1, len(pids) // 2)) - sum(is_heldout(p, fraction) for p in pids)
        for pid in sorted((p for p in pids if not is_heldout(p, fraction)), key=_hash)[:max(0, want)]:
            picks.add(pid)
    return frozenset(picks)


def heldout_split(run, fraction: float, per_cell: int = 0) -> HeldoutSplit:
    """The split of `run` for `train.heldout_fraction` and `train.heldout_per_cell` (see HeldoutSplit)."""
    picks = cell_picks(first_selection_cells(run), fraction, per_cell) if per_cell > 0 else frozenset()
    return HeldoutSplit(float(fraction), int(per_cell), picks)


def eval_order(prompts: list[dict]) -> list[dict]:
    """Held-out prompts ({prompt_id, category, length_band, mode, ...}) in the order evaluations take them: round
    robin over the cells (each cell's prompts by sha256(prompt_id)), so the first N cover as many cells as N
    allows; ties by sha256."""
    rank: dict[tuple, int] = defaultdict(int)
    keyed = []
    for p in sorted(prompts, key=lambda p: _hash(p["prompt_id"])):
        cell = (p.get("category") or "unknown", p.get("length_band"), p.get("mode"))
        keyed.append((rank[cell], _hash(p["prompt_id"]), p))
        rank[cell] += 1
    return [p for _, _, p in sorted(keyed, key=lambda k: k[:2])]


def _hash(prompt_id: str) -> str:
    return hashlib.sha256(prompt_id.encode("utf-8")).hexdigest()
