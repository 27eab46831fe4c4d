"""The filter contract (after NeMo Curator's DocumentFilter and datatrove's BaseFilter with its exclusion writer).

A filter has a `name`, `score(record) -> float` and `keep(score) -> bool`; `reason(record, score)` explains a drop.
Thresholds come from config. Scores can be stored as columns and plotted.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    """The outcome of one filter on one record: `keep` is False for a drop, with `reason` saying why."""

    filter: str
    keep: bool
    score: float | None = None
    reason: str = ""


class Filter:
    """Base class: subclasses set `name` and implement `score` and `keep` (and usually `reason`)."""

    name: str = "filter"

    def score(self, record) -> float:
        raise NotImplementedError

    def keep(self, score: float) -> bool:
        raise NotImplementedError

    def reason(self, record, score: float) -> str:
        return f"{self.name}: score {score:g} failed the threshold"

    def __call__(self, record) -> Decision:
        s = self.score(record)
        if self.keep(s):
            return Decision(self.name, True, s)
        return Decision(self.name, False, s, self.reason(record, s))
