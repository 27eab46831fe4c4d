"""Sub-config of `regen render` (owned by the render stage)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class RenderConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    renderer: str = "kimi-k3"  # kimi-k3 | hf
    tokenizer: str | None = None  # local directory; null = the project's test vocabulary
    max_tokens: int = 32_768
    min_loss_tokens: int = 14
    template_kwargs: dict = Field(default_factory=dict)
