"""The renderer contract shared by every target format (Kimi-K3 XTML, Hugging Face chat templates).

A renderer turns OpenAI-style `messages` (+ `tools` and the template's keyword arguments) into token ids and,
for each assistant message, the half-open token span the target generated for it (the supervised span under the
default policy). The loss mask is built from those spans, never by re-encoding text.

Ids are built turn by turn: for each assistant message k, the ids before its span equal
`render(messages[:k], add_generation_prompt=True).input_ids` (the prompt the target read, tokenized without the
answer), and the span holds the answer tokenized on its own, so no token straddles the boundary. With
`last_only=True` (a training row) only the last assistant message gets a span and the prompt before it is the
generation prompt of `messages[:-1]` rendered alone (Kimi-K3: its tool-choice/response-format notes included).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Rendered:
    """One rendered conversation.

    text: the rendered string (for display; ids are the truth).
    input_ids: int token ids, length num_tokens.
    assistant_spans: one (start, end) half-open token span per assistant message, in message order: the tokens
        the target generated for that message (per the renderer's mask policy).
    """

    text: str
    input_ids: list[int]
    assistant_spans: list[tuple[int, int]] = field(default_factory=list)

    def loss_mask(self, turns: str = "all") -> list[int]:
        """0/1 mask over `input_ids`: `turns="all"` supervises every assistant span, `"last"` only the last."""
        mask = [0] * len(self.input_ids)
        spans = self.assistant_spans if turns == "all" else self.assistant_spans[-1:]
        for start, end in spans:
            mask[start:end] = [1] * (end - start)
        return mask


class Renderer(Protocol):
    name: str  # e.g. "kimi-k3"
    version: str  # bumped whenever output ids can change
    tokenizer_name: str
    tokenizer_hash: str  # sha256 of the tokenizer file(s)
    # strings the tokenizer turns into control tokens wherever they stand in message text (hf: its special tokens;
    # kimi-k3: none, it encodes message text as text). Rejected by render.control_tokens: reject (regen.render.guards)
    text_control_tokens: tuple[str, ...]

    def render(self, messages: list[dict], tools: list[dict] | None = None, *, last_only: bool = False,
               **template_kwargs) -> Rendered: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...
