"""Sub-config of `regen render` (owned by the render stage): response filters, renderer, mask and shard policy.

Every field has a default; profiles override in their `render:` section. Policies are plain strings checked here
so a bad value fails at load time naming the field and the allowed values.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from filters.response import RESPONSE_FILTERS


class ResponseFilterParams(BaseModel):
    """Thresholds of the response filters (`filters/response.py`); a filter reads only its own keys."""

    model_config = ConfigDict(extra="forbid")

    leak_markers: list[str] = Field(
        default_factory=lambda: ["<think>", "</think>", "<|open|>think", "<|close|>think", "◁think▷", "◁/think▷"],
        description="reasoning_leak: strings that must not appear in `content` (think markers of common formats)")
    ngram_size: int = Field(10, description="repetition: word n-gram size of the duplicated n-gram fraction "
                            "(Gopher-style)")
    max_dup_ngram_fraction: float = Field(0.5, description="repetition: drop above this duplicated n-gram fraction")
    repetition_min_tokens: int = Field(64, description="repetition: texts shorter than this many words are not "
                                       "checked")
    min_compression_ratio: float = Field(0.08, description="compression: drop below this zlib-compressed / raw "
                                         "bytes ratio (a loop compresses far better than prose or code)")
    compression_min_chars: int = Field(1024, description="compression: texts shorter than this are not checked")
    language_min_chars: int = Field(80, description="language: answers with less prose than this are not checked")
    language_min_prob: float = Field(0.95, description="language: drop when py3langid gives another language than "
                                     "the prompt's `language` at least this probability")
    language_skip_categories: list[str] = Field(default_factory=lambda: ["code", "translation"],
                                                description="language: categories not checked")
    language_max_chars: int = Field(600, description="language: the first this-many characters of prose (code "
                                    "blocks stripped) are classified")
    max_tokens: int | None = Field(None, description="over_long: server token counts above this drop the row early "
                                   "(only under `overlong: drop`); null = render.max_tokens")


class RenderConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    renderer: Literal["kimi-k3", "hf"] = Field("kimi-k3", description="the target's conversation format: Kimi-K3's "
                                               "own renderer, or any Hugging Face chat template")
    tokenizer: str | None = Field(None, description="local tokenizer directory; may use ${ENV}; null = the "
                                  "project's test vocabulary (kimi-k3) or the embedded target's (hf with "
                                  "serve.enabled)")
    template_kwargs: dict = Field(default_factory=dict, description="chat template arguments (e.g. `{thinking: "
                                  "true, thinking_effort: max}`); each row's request_params override them")
    mask_policy: str = Field("spec", description="kimi-k3: which tokens are supervised (`spec`: the format spec's "
                             "section 6 recommendation); hf uses `hf_mask`")
    hf_mask: Literal["auto", "markers", "prefix"] = Field("auto", description="hf: supervised spans from the "
                                                          "template's `{% generation %}` markers, from rendered "
                                                          "prefixes, or markers when present (auto)")
    turn_mode: Literal["per_turn", "conversation"] = Field("per_turn", description="one sample per generated turn, "
                                                           "or one per conversation supervising every turn")
    max_tokens: int = Field(32_768, description="tokens per sample at most (see `overlong`)")
    overlong: Literal["drop", "cut"] = Field("drop", description="a sample over max_tokens: drop it, or cut it to "
                                             "the longest prefix ending at an assistant turn")
    min_loss_tokens: int = Field(14, description="samples with fewer supervised tokens are rejects "
                                 "(`min_loss_tokens`)")
    use_server_ids: bool = Field(True, description="take the server's `completion_token_ids` verbatim when present")
    on_drift: Literal["keep", "drop"] = Field("drop", description="rows whose rendered prompt ids differ from the "
                                              "server's `prompt_token_ids`")
    require_reasoning: bool = Field(False, description="reject a generated turn whose `reasoning_content` is null "
                                    "(thinking on: its reasoning was lost); rows rendered with `thinking: false` are "
                                    "exempt")
    content_part_types: list[str] = Field(default_factory=lambda: ["text"], description="content part types a "
                                          "message may hold; others are rejects (`unknown_content_part`)")
    control_tokens: Literal["reject", "keep"] = Field("reject", description="control-token strings inside message "
                                                      "text (`<|im_end|>` in a user message) where the renderer's "
                                                      "tokenizer parses them (hf): reject the row (at select and at "
                                                      "render), or keep it and render them as the tokenizer does; "
                                                      "kimi-k3 keeps such strings as text")
    filters: list[str] = Field(
        default_factory=lambda: [
            "truncated", "empty_answer", "reasoning_leak", "tool_args", "repetition", "compression", "language",
            "over_long",
        ],
        description="response filters, in order; the first that fails drops the row to rejected/render/",
        json_schema_extra={"allowed": list(RESPONSE_FILTERS)})
    filter_params: ResponseFilterParams = Field(default_factory=ResponseFilterParams,
                                                description="thresholds of the response filters")
    shard_max_rows: int = Field(100_000, description="rows per shard file at most")
    shard_max_tokens: int = Field(50_000_000, description="tokens per shard file at most (int32 ids: about 200 MB "
                                  "before compression)")


def effective_render_config(render: RenderConfig, serve) -> RenderConfig:
    """The hf renderer without a tokenizer renders with the embedded target's own tokenizer and template
    (`serve`: the profile's ServeConfig)."""
    if serve.enabled and render.renderer == "hf" and not render.tokenizer:
        return render.model_copy(update={"tokenizer": serve.model_dir})
    return render
