"""Sub-config of the embedded target server (`regen serve-target`)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = False  # start the embedded target before `generate` when true
    model_dir: str = "data/models/gemma3-270m"
    host: str = "127.0.0.1"
    port: int = 8431
