"""The held-out split a draft was trained with, and the fraction `regen eval` may use (issue 27, point 4).

The trainer records `train.heldout_fraction` and the rule in `<training dir>/heldout.json` and in each checkpoint's
training.json (`heldout`); `regen eval` keeps to it: the buckets of `regen.train.eval.is_heldout` are nested (a
smaller fraction's prompts are held out by every larger one), so evaluating at a fraction above the trained one
would measure prompts the draft trained on.
"""
from __future__ import annotations

from pathlib import Path

HELDOUT_RULE = "sha256(prompt_id) mod 10^6 < round(heldout_fraction * 10^6) (regen.train.eval.is_heldout)"


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


def eval_heldout_fraction(asked: float, drafts: dict) -> tuple[float, dict]:
    """(the fraction to evaluate on, how it was chosen) for `asked` (the profile's train.heldout_fraction) and the
    trained drafts {name: step folder}. The split recorded at training time wins; InputError when `asked` is larger
    than a draft's recorded fraction (it would put that draft's training prompts into the evaluation: the
    held-out buckets are nested, `is_heldout`), naming both and the fix."""
    from regen.errors import InputError

    records = {name: recorded_heldout(d) for name, d in drafts.items()}
    known = {name: r for name, r in records.items() if r is not None}
    if not known:
        return asked, {"fraction": asked, "rule": HELDOUT_RULE, "chosen_by": "the profile's train.heldout_fraction "
                       "(no draft records its training split)"}
    fraction = min(r["fraction"] for r in known.values())  # held out from every trained draft
    if asked > fraction:
        name = min(known, key=lambda n: known[n]["fraction"])
        raise InputError(f"train.heldout_fraction={asked} asks to evaluate on prompts the draft {name!r} was trained "
                         f"on: it was trained with heldout_fraction={fraction} ({known[name]['source']}); evaluate "
                         f"with --set train.heldout_fraction={fraction} (or less), or retrain with a larger one")
    return fraction, {"fraction": fraction, "rule": HELDOUT_RULE, "asked": asked,
                      "chosen_by": "the split recorded at training time",
                      "sources": {name: r["source"] for name, r in known.items()},
                      **({"unrecorded": sorted(set(records) - set(known))} if len(known) < len(records) else {})}
