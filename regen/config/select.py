"""Sub-config of `regen select` (owned by the selection stage).

Every field has a default; profiles set only what differs. See `regen.select.stage` for the pipeline and the
selection policy, `regen.select.shapes` for the recognized row shapes and `filters.prompt` for the filters.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.prompt import CATEGORIES


class SourceConfig(BaseModel):
    """One prompt pool: a file, a glob, a directory of data files or a Hugging Face dataset directory.

    `fields` maps the record's fields to the source's columns when its shape is not recognized (or to
    override detection), e.g. `{"prompt": "question"}`,
    `{"conversations": "dialog", "role": "speaker", "content": "text"}`, `{"messages": "chat"}`,
    `{"turns": "queries"}`, `{"instruction": "task", "input": "context"}`, `{"tools": "functions"}`,
    `{"system": "sys"}`, `{"category": "label"}`, `{"language": "lang"}`.
    """

    model_config = ConfigDict(extra="forbid")

    name: str
    path: str
    category: str | None = None  # a fixed category for every row of this source (after the row's own label)
    language: str | None = None  # a fixed ISO 639-1 code for every row (skips language identification)
    category_map: dict[str, str] = Field(default_factory=dict)  # the source's own label -> our category
    fields: dict[str, str] = Field(default_factory=dict)
    max_rows: int | None = None  # cap on rows read per file (pool sampling is done by the mix, not here)

    @field_validator("category")
    @classmethod
    def _known_category(cls, v):
        if v is not None and v not in CATEGORIES:
            raise ValueError(f"category {v!r} is not one of {list(CATEGORIES)}")
        return v

    @field_validator("category_map")
    @classmethod
    def _known_mapped(cls, v):
        bad = {k: c for k, c in v.items() if c not in CATEGORIES}
        if bad:
            raise ValueError(f"category_map values {bad} are not in {list(CATEGORIES)}")
        return v


class SelectConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sources: list[SourceConfig] = Field(default_factory=list)
    total: int = 150_000
    mix: dict[str, float] = Field(default_factory=dict)  # category -> share; shares sum to 1 (empty: equal)
    max_per_source: dict[str, int] = Field(default_factory=dict)
    max_per_language: dict[str, int] = Field(default_factory=dict)
    shortfall_policy: str = "redistribute"  # redistribute | report_only
    # A category selected below `min_category_fill` x its target (round(total * share)) is a starved quota:
    # a loud warning on stderr and in the manifest's `warnings` (`warn`), or an InputError before anything is
    # written (`fail`). 0 turns the check off.
    min_category_fill: float = 0.5
    on_category_shortfall: str = "warn"  # warn | fail
    # Rows with tool calls but no declared tools: tools from JSON schemas in the system text, else inferred from
    # the calls (prompts column `tools_inferred`); False rejects such rows (filter `parse`, "declares no tools").
    infer_tool_schemas: bool = True
    # A source file that cannot be read (not decodable, not JSON, unsupported format): `fail` stops before
    # anything is written, naming every bad file; `skip` leaves them out (listed in the manifest's `bad_files`).
    on_bad_file: str = "fail"  # fail | skip
    # Category policy: Chinese prompts -> "chinese", other non-English -> "multilingual", except categories
    # listed in `language_exempt_categories` (tool use is scarce and its format is language-neutral).
    language_overrides_category: bool = True
    language_exempt_categories: list[str] = Field(default_factory=lambda: ["tool_use"])
    max_prompt_tokens: int = 16_384
    min_prompt_chars: int = 1
    drop_prompts_with_images: bool = False  # True for a text-only target
    near_dup_threshold: float = 0.8
    num_perm: int = 128
    shingle_chars: int = 5  # character n-gram size of the MinHash shingles
    minhash_max_chars: int = 4096  # near dedup compares the first this-many normalized characters
    contamination_files: list[str] = Field(default_factory=list)
    contamination_ngram: int = 13  # word n-gram size for overlap matching
    contamination_overlap: float = 0.5  # drop when this share of a prompt's n-grams is in the benchmark set
    batch_rows: int = 20_000  # rows per streaming batch
    workers: int = 2  # processes normalizing and filtering batches (1: in the main process); output is identical
    rows_per_part: int = 50_000  # prompts per output part file
    filters: list[str] = Field(
        default_factory=lambda: [
            "empty", "control_chars", "image_only", "tool_schema", "token_budget", "contamination", "exact_dedup", "near_dedup"
        ]
    )

    @field_validator("total")
    @classmethod
    def _total(cls, v):
        if v < 1:
            raise ValueError(f"total {v}: the number of prompts to select must be >= 1")
        return v

    @field_validator("on_category_shortfall", "on_bad_file")
    @classmethod
    def _warn_or_fail(cls, v, info):
        allowed = ("warn", "fail") if info.field_name == "on_category_shortfall" else ("fail", "skip")
        if v not in allowed:
            raise ValueError(f"{info.field_name} {v!r}: use {' or '.join(repr(a) for a in allowed)}")
        return v

    @field_validator("min_category_fill")
    @classmethod
    def _fill(cls, v):
        if not 0 <= v <= 1:
            raise ValueError(f"min_category_fill {v}: a fraction of the category's target in [0, 1]")
        return v

    @field_validator("shortfall_policy")
    @classmethod
    def _policy(cls, v):
        if v not in ("redistribute", "report_only"):
            raise ValueError(f"shortfall_policy {v!r}: use 'redistribute' or 'report_only'")
        return v

    @field_validator("mix")
    @classmethod
    def _mix(cls, v):
        bad = [k for k in v if k not in CATEGORIES]
        if bad:
            raise ValueError(f"mix categories {bad} are not in {list(CATEGORIES)}")
        if any(s < 0 for s in v.values()):
            raise ValueError("mix shares must be >= 0")
        if v and abs(sum(v.values()) - 1.0) > 1e-6:
            raise ValueError(f"mix shares sum to {sum(v.values()):.6f}, they must sum to 1")
        return v

    @model_validator(mode="after")
    def _filters_known(self):
        from filters.prompt import PROMPT_FILTERS

        bad = [f for f in self.filters if f not in PROMPT_FILTERS]
        if bad:
            raise ValueError(f"filters {bad} unknown: choose from {sorted(PROMPT_FILTERS)}")
        if not 0 < self.near_dup_threshold <= 1:
            raise ValueError("near_dup_threshold must be in (0, 1]")
        return self

    def shares(self) -> dict[str, float]:
        """The mix as a full dict over CATEGORIES (equal shares when `mix` is empty)."""
        if not self.mix:
            return {c: 1.0 / len(CATEGORIES) for c in CATEGORIES}
        return {c: float(self.mix.get(c, 0.0)) for c in CATEGORIES}
