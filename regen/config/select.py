"""Sub-config of `regen select` (owned by the selection stage)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SourceConfig(BaseModel):
    """One prompt pool: a file, a glob or a Hugging Face dataset directory.

    `fields` maps the record's fields to the source's columns when its shape is not recognized, e.g.
    `{"prompt": "question"}` or `{"conversations": "dialog", "role": "speaker", "content": "text"}`.
    """

    model_config = ConfigDict(extra="forbid")

    name: str
    path: str
    category: str | None = None  # a fixed category for every row of this source
    language: str | None = None  # a fixed language code
    category_map: dict[str, str] = Field(default_factory=dict)  # the source's own label -> our category
    fields: dict[str, str] = Field(default_factory=dict)
    max_rows: int | None = None  # cap on rows read (pool sampling is done by the mix, not here)


class SelectConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sources: list[SourceConfig] = Field(default_factory=list)
    total: int = 150_000
    mix: dict[str, float] = Field(default_factory=dict)  # category -> share; shares sum to 1
    max_per_source: dict[str, int] = Field(default_factory=dict)
    max_per_language: dict[str, int] = Field(default_factory=dict)
    shortfall_policy: str = "redistribute"  # redistribute | report_only
    max_prompt_tokens: int = 16_384
    near_dup_threshold: float = 0.8
    num_perm: int = 128
    contamination_files: list[str] = Field(default_factory=list)
    filters: list[str] = Field(
        default_factory=lambda: [
            "empty", "image_only", "tool_schema", "token_budget", "contamination", "exact_dedup", "near_dedup"
        ]
    )
