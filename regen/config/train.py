"""Sub-config of `regen train` / `regen eval` (owned by the trainer)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    target: str | None = None  # local path of the target model
    target_layer_ids: list[int] = Field(default_factory=list)
    block_size: int = 7
    num_draft_layers: int = 5
    markov_rank: int = 256
