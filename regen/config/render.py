"""Sub-config of `regen render` (owned by the render stage): response filters, renderer, mask and shard policy.

Every field has a default; profiles override in their `render:` section. Policies are plain strings checked here
so a bad value fails at load time naming the field and the allowed values.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ResponseFilterParams(BaseModel):
    """Thresholds of the response filters (`filters/response.py`); a filter reads only its own keys."""

    model_config = ConfigDict(extra="forbid")

    # reasoning_leak: strings that must not appear in `content` (think markers of common formats).
    leak_markers: list[str] = Field(
        default_factory=lambda: ["<think>", "</think>", "<|open|>think", "<|close|>think", "◁think▷", "◁/think▷"]
    )
    # repetition: duplicated word n-grams (Gopher-style "duplicate n-gram fraction") on texts of >= min tokens.
    ngram_size: int = 10
    max_dup_ngram_fraction: float = 0.5
    repetition_min_tokens: int = 64
    # compression: zlib-compressed bytes / raw bytes; a loop compresses far better than prose or code.
    min_compression_ratio: float = 0.08
    compression_min_chars: int = 1024
    # language: the answer's language (py3langid, code blocks stripped) vs the prompt's `language`.
    language_min_chars: int = 80
    language_min_prob: float = 0.95
    language_skip_categories: list[str] = Field(default_factory=lambda: ["code", "translation"])
    language_max_chars: int = 600  # the first N characters of prose are classified
    # over_long: server token counts above this drop the row early (only under `overlong: drop`); null = max_tokens.
    max_tokens: int | None = None


class RenderConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    renderer: Literal["kimi-k3", "hf"] = "kimi-k3"
    tokenizer: str | None = None  # local directory; null = the project's test vocabulary (kimi-k3 only)
    template_kwargs: dict = Field(default_factory=dict)  # e.g. {thinking: true, thinking_effort: max}
    mask_policy: str = "spec"  # kimi-k3: the spec's §6 recommendation; hf: "auto" (markers when present, else prefixes)
    hf_mask: Literal["auto", "markers", "prefix"] = "auto"
    turn_mode: Literal["per_turn", "conversation"] = "per_turn"
    max_tokens: int = 32_768
    overlong: Literal["drop", "cut"] = "drop"  # cut: keep the longest prefix ending at an assistant turn
    min_loss_tokens: int = 14
    use_server_ids: bool = True  # completion_token_ids verbatim when present
    on_drift: Literal["keep", "drop"] = "drop"  # rows whose rendered prompt ids differ from prompt_token_ids
    require_reasoning: bool = False  # reject a generated turn whose reasoning_content is None
    content_part_types: list[str] = Field(default_factory=lambda: ["text"])
    # control-token strings inside message text (`<|im_end|>` in a user message) where the renderer's tokenizer would
    # parse them as control tokens (hf): `reject` the row (at select, before any request, and at render), or `keep`
    # it and render them as the tokenizer does. The kimi-k3 renderer keeps such strings as text: nothing to reject.
    control_tokens: Literal["reject", "keep"] = "reject"
    filters: list[str] = Field(
        default_factory=lambda: [
            "truncated", "empty_answer", "reasoning_leak", "tool_args", "repetition", "compression", "language",
            "over_long",
        ]
    )
    filter_params: ResponseFilterParams = Field(default_factory=ResponseFilterParams)
    shard_max_rows: int = 100_000
    shard_max_tokens: int = 50_000_000  # int32 ids: about 200 MB before compression


def effective_render_config(render: RenderConfig, serve) -> RenderConfig:
    """The hf renderer without a tokenizer renders with the embedded target's own tokenizer and template
    (`serve`: the profile's ServeConfig)."""
    if serve.enabled and render.renderer == "hf" and not render.tokenizer:
        return render.model_copy(update={"tokenizer": serve.model_dir})
    return render
