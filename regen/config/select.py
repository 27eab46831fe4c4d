"""Sub-config of `regen select` (owned by the selection stage).

Every field has a default; profiles set only what differs. See `regen.select.stage` for the pipeline and the
selection policy, `regen.select.shapes` for the recognized row shapes and `filters.prompt` for the filters.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from filters.prompt import PROMPT_FILTERS
from schemas.prompt import CATEGORIES

SHORTFALL_POLICIES = ("redistribute", "report_only")
DEFAULT_MODE = "default"  # the one mode of a profile without `select.modes`


def _tokens_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def band_names(edges: list[int]) -> list[str]:
    """The input-length bands' names for upper bounds `edges` (tokens, increasing): `[2048, 8192]` ->
    `["0-2K", "2K-8K"]` (K = 1024 tokens; other bounds are written in tokens)."""
    lows = [0, *edges[:-1]]
    return [f"{_tokens_label(lo)}-{_tokens_label(hi)}" for lo, hi in zip(lows, edges)]


def band_of(num_tokens: int, edges: list[int]) -> str | None:
    """The band of a prompt of `num_tokens` input tokens: the first band whose upper bound is >= it (bounds are
    inclusive, `0-2K` holds 0..2048); `>32K` past the last bound (a band without a share); None without bands."""
    for name, hi in zip(band_names(edges), edges):
        if num_tokens <= hi:
            return name
    return f">{_tokens_label(edges[-1])}" if edges else None


class SourceConfig(BaseModel):
    """One prompt pool: a file, a glob, a directory of data files or a Hugging Face dataset directory.

    `fields` maps the record's fields to the source's columns when its shape is not recognized (or to
    override detection), e.g. `{"prompt": "question"}`,
    `{"conversations": "dialog", "role": "speaker", "content": "text"}`, `{"messages": "chat"}`,
    `{"turns": "queries"}`, `{"instruction": "task", "input": "context"}`, `{"tools": "functions"}`,
    `{"system": "sys"}`, `{"category": "label"}`, `{"language": "lang"}`.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="the source's name (the prompts' `source` column, `select.max_per_source` keys)")
    path: str = Field(description="a file, a glob, a directory of data files or a `save_to_disk` directory; "
                      "relative to the repository root; may use ${ENV}")
    category: str | None = Field(None, description="a fixed category for every row of this source (after the "
                                 "row's own label)", json_schema_extra={"allowed": list(CATEGORIES)})
    language: str | None = Field(None, description="a fixed ISO 639-1 code for every row (skips language "
                                 "identification)")
    category_map: dict[str, str] = Field(default_factory=dict, description="the source's own label -> our "
                                         "category", json_schema_extra={"allowed": list(CATEGORIES)})
    fields: dict[str, str] = Field(default_factory=dict, description="record field -> the source's column, when "
                                   "the shape is not recognized or to override detection (`{prompt: question}`)")
    max_rows: int | None = Field(None, description="rows read per file at most (pool sampling is done by the mix, "
                                 "not here)")

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

    sources: list[SourceConfig] = Field(default_factory=list, description="the prompt pools (fields below: "
                                        "`select.sources[].*`)")
    total: int = Field(150_000, description="prompts to select (>= 1)")
    mix: dict[str, float] = Field(default_factory=dict, description="category -> share; shares sum to 1 (empty: "
                                  "equal shares)", json_schema_extra={"allowed": list(CATEGORIES)})
    max_per_source: dict[str, int] = Field(default_factory=dict, description="source name -> prompts at most")
    max_per_language: dict[str, int] = Field(default_factory=dict, description="language code -> prompts at most")
    shortfall_policy: str = Field("redistribute", description="a category short of supply: give its shortfall to "
                                  "the others by share, or leave it unfilled",
                                  json_schema_extra={"allowed": list(SHORTFALL_POLICIES)})
    min_category_fill: float = Field(0.5, description="a category selected below this x its target "
                                     "(round(total x share)) is a starved quota (see on_category_shortfall); 0 = no "
                                     "check")
    on_category_shortfall: str = Field("warn", description="a starved quota: a loud warning on stderr and in the "
                                       "manifest's `warnings`, or an InputError before anything is written",
                                       json_schema_extra={"allowed": ["warn", "fail"]})
    infer_tool_schemas: bool = Field(True, description="rows with tool calls but no declared tools: tools from JSON "
                                     "schemas in the system text, else inferred from the calls (column "
                                     "`tools_inferred`); false rejects them (filter `parse`)")
    on_bad_file: str = Field("fail", description="a source file that cannot be read: stop before anything is "
                             "written, naming every bad file, or leave them out (manifest `bad_files`); "
                             "`--on-bad-file`", json_schema_extra={"allowed": ["fail", "skip"]})
    language_overrides_category: bool = Field(True, description="Chinese prompts -> `chinese`, other non-English "
                                              "-> `multilingual`, except language_exempt_categories")
    language_exempt_categories: list[str] = Field(default_factory=lambda: ["tool_use"], description="categories "
                                                  "the language policy leaves alone (tool use is scarce and its "
                                                  "format is language-neutral)")
    max_prompt_tokens: int = Field(16_384, description="filter token_budget: prompts estimated longer are rejects")
    min_prompt_chars: int = Field(1, description="filter empty: prompts with fewer non-space characters of user "
                                  "text are rejects")
    drop_prompts_with_images: bool = Field(False, description="filter image_only: also drop prompts that hold any "
                                           "image part (true for a text-only target)")
    near_dup_threshold: float = Field(0.8, description="near_dedup: estimated Jaccard similarity at or above "
                                      "which a prompt is a near duplicate, in (0, 1]")
    num_perm: int = Field(128, description="near_dedup: MinHash permutations")
    shingle_chars: int = Field(5, description="near_dedup: character n-gram size of the MinHash shingles")
    minhash_max_chars: int = Field(4096, description="near_dedup: the first this-many normalized characters are "
                                   "compared")
    length_bands: list[int] = Field(default_factory=list, description="upper bounds (prompt tokens, inclusive, "
                                    "increasing) of the input-length bands every prompt is labelled with "
                                    "(`length_band`: `[2048, 8192]` -> `0-2K`, `2K-8K`); the last must be >= "
                                    "max_prompt_tokens; [] = no bands")
    band_shares: list[float] = Field(default_factory=list, description="the share of each length band within "
                                     "each category's quota (one per `length_bands` entry, summing to 1); a band "
                                     "short of supply gives its shortfall to the category's other bands by share; "
                                     "[] = bands are labels only, the category quotas alone select")
    modes: dict[str, float] = Field(default_factory=dict, description="generation mode -> share of the prompts "
                                    "(summing to 1), assigned per category x length band cell (column `mode`); "
                                    "each mode's settings are `generate.modes.<name>`; {} = one mode, `default`")
    contamination_files: list[str] = Field(default_factory=list, description="benchmark prompt sets that must not "
                                           "be trained on (filter contamination)")
    contamination_ngram: int = Field(13, description="contamination: word n-gram size for overlap matching")
    contamination_overlap: float = Field(0.5, description="contamination: drop when this share of a prompt's "
                                         "n-grams is in the benchmark set")
    batch_rows: int = Field(20_000, description="rows per streaming batch")
    workers: int = Field(2, description="processes normalizing and filtering batches (1: in the main process); "
                         "the output is identical")
    rows_per_part: int = Field(50_000, description="prompts per output part file")
    filters: list[str] = Field(
        default_factory=lambda: [
            "empty", "control_chars", "image_only", "tool_schema", "token_budget", "contamination", "exact_dedup", "near_dedup"
        ],
        description="prompt filters, in order (the first that fails rejects the row)",
        json_schema_extra={"allowed": list(PROMPT_FILTERS)})

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
        if v not in SHORTFALL_POLICIES:
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
    def _bands_and_modes(self):
        e = self.length_bands
        if e and (any(b <= 0 for b in e) or e != sorted(set(e))):
            raise ValueError(f"length_bands {e}: upper bounds in tokens, > 0 and strictly increasing, e.g. "
                             "[2048, 8192, 32768]")
        if e and "token_budget" in self.filters and e[-1] < self.max_prompt_tokens:
            raise ValueError(f"length_bands end at {e[-1]} tokens but max_prompt_tokens is {self.max_prompt_tokens}: "
                             f"add a band up to {self.max_prompt_tokens} or lower max_prompt_tokens, so every kept "
                             "prompt has a band")
        if self.band_shares:
            if len(self.band_shares) != len(e):
                raise ValueError(f"band_shares has {len(self.band_shares)} entries for {len(e)} length_bands: give "
                                 "one share per band, or [] for bands as labels only")
            if any(s < 0 for s in self.band_shares) or abs(sum(self.band_shares) - 1.0) > 1e-6:
                raise ValueError(f"band_shares {self.band_shares}: shares >= 0 summing to 1")
        if self.modes:
            if any(s < 0 for s in self.modes.values()) or abs(sum(self.modes.values()) - 1.0) > 1e-6:
                raise ValueError(f"modes {self.modes}: shares >= 0 summing to 1")
            if any(not m or not m.replace("_", "").replace("-", "").isalnum() for m in self.modes):
                raise ValueError(f"modes {sorted(self.modes)}: names of letters, digits, '_' and '-'")
        return self

    def band_names(self) -> list[str]:
        """The names of `length_bands` (`band_names`), [] without bands."""
        return band_names(self.length_bands)

    def band_of(self, num_tokens: int) -> str | None:
        """The length band of a prompt of `num_tokens` estimated input tokens (`band_of`)."""
        return band_of(num_tokens, self.length_bands)

    def mode_shares(self) -> dict[str, float]:
        """The modes' shares ({`default`: 1.0} without `modes`)."""
        return dict(self.modes) if self.modes else {DEFAULT_MODE: 1.0}

    @model_validator(mode="after")
    def _filters_known(self):
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
