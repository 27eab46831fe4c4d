"""The run directory: everything one run produces, one folder per stage, each with its manifest.

    runs/<name>/
      prompts/      part-*.parquet + manifest.json      (regen select)
      generations/  part-*.parquet + manifest.json      (regen generate)
      shards/       shard-*.parquet + manifest.json     (regen render)
      rejected/<stage>/part-*.parquet                   (every stage's drops, with filter and reason)
      train/ eval.json report.html views.sql
      originals/ shards-original/ rejected/render-original/ train-original/ eval-original.json
                    the same stages on the source's own answers (`regen render --responses original`)

A RunDir is a view of one response set: `RunDir.at(path)` is the regenerated one; `run.with_responses("original")`
gives the same run whose `generations`, `shards`, `rejected("render")`, `train` and `eval_json` are the original
set's (`originals/` holds generation rows made from the prompts' `original_answers`), so the render, train and
eval stages run unchanged on either set.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from schemas.io import read_json, write_json_atomic


RESPONSES = ("regenerated", "original")


@dataclass(frozen=True)
class RunDir:
    root: Path
    responses: str = "regenerated"  # one of RESPONSES: which answers the render/train/eval paths hold

    @classmethod
    def at(cls, path: str | Path, responses: str = "regenerated") -> "RunDir":
        root = Path(path).resolve()
        root.mkdir(parents=True, exist_ok=True)
        return cls(root).with_responses(responses)

    def with_responses(self, responses: str) -> "RunDir":
        """This run viewed on one response set. Raises ValueError for a name outside RESPONSES."""
        if responses not in RESPONSES:
            raise ValueError(f"responses {responses!r}: choose one of {list(RESPONSES)}")
        return RunDir(self.root, responses)

    @property
    def _suffix(self) -> str:
        return "" if self.responses == "regenerated" else "-original"

    @property
    def prompts(self) -> Path:
        return self.root / "prompts"

    @property
    def generations(self) -> Path:
        """The answers to render: `generations/`, or `originals/` for the original set."""
        return self.root / ("generations" if self.responses == "regenerated" else "originals")

    @property
    def shards(self) -> Path:
        return self.root / f"shards{self._suffix}"

    @property
    def train(self) -> Path:
        return self.root / f"train{self._suffix}"

    @property
    def eval_json(self) -> Path:
        return self.root / f"eval{self._suffix}.json"

    def rejected(self, stage: str) -> Path:
        return self.root / "rejected" / (f"{stage}{self._suffix}" if stage == "render" else stage)

    def manifest(self, stage_dir: Path) -> dict | None:
        return read_json(stage_dir / "manifest.json")

    def write_manifest(self, stage_dir: Path, manifest: dict) -> None:
        write_json_atomic(manifest, stage_dir / "manifest.json")
