"""The run directory: everything one run produces, one folder per stage, each with its manifest.

    runs/<name>/
      prompts/      part-*.parquet + manifest.json      (regen select)
      generations/  part-*.parquet + manifest.json      (regen generate)
      shards/       shard-*.parquet + manifest.json     (regen render)
      rejected/<stage>/part-*.parquet                   (every stage's drops, with filter and reason)
      train/ eval.json report.html views.sql
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from schemas.io import read_json, write_json_atomic


@dataclass(frozen=True)
class RunDir:
    root: Path

    @classmethod
    def at(cls, path: str | Path) -> "RunDir":
        root = Path(path).resolve()
        root.mkdir(parents=True, exist_ok=True)
        return cls(root)

    @property
    def prompts(self) -> Path:
        return self.root / "prompts"

    @property
    def generations(self) -> Path:
        return self.root / "generations"

    @property
    def shards(self) -> Path:
        return self.root / "shards"

    @property
    def train(self) -> Path:
        return self.root / "train"

    def rejected(self, stage: str) -> Path:
        return self.root / "rejected" / stage

    def manifest(self, stage_dir: Path) -> dict | None:
        return read_json(stage_dir / "manifest.json")

    def write_manifest(self, stage_dir: Path, manifest: dict) -> None:
        write_json_atomic(manifest, stage_dir / "manifest.json")
