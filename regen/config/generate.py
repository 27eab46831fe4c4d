"""Sub-config of `regen generate` (owned by the regeneration client)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class GenerateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = "moonshotai/Kimi-K3"
    endpoints: list[str] = Field(default_factory=list)  # base URLs ending in /v1; may use ${ENV_VARS}
    api_key_env: str | None = None  # name of the environment variable holding the API key
    max_in_flight: int = 4096
    stream: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 32_768
    seed: int | None = None
    extra_body: dict = Field(default_factory=dict)
    return_token_ids: bool = False
    policies: dict[str, str] = Field(default_factory=dict)  # quality class -> retry|retry_larger|keep_flagged|drop
