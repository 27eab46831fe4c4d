"""The Kimi-K3 renderer: segments (`regen.render.kimi_k3.format`) -> token ids + per-assistant-message supervised spans.

Spec: `shared/docs/kimi-k3-format.md`. Ids come from encoding each segment on its own (§3); the spans come from
the segment labels, never from re-encoding text (§6).

Mask policies (which tokens of an assistant message are supervised; every span is contiguous):
- `spec` (default, §6 recommendation; alias `generated`): what the target generates after the generation prompt: the
  reasoning, `<|close|>think<|sep|><|open|>response<|sep|>`, the content, `<|close|>response<|sep|>`, any tools
  section and `<|close|>message<|sep|>`; in non-thinking mode from the content on. The message opener, the
  channel opener and `<|end_of_msg|>` are not supervised.
- `include_channel_opener` (TSR-like): also the channel opener (`<|open|>think<|sep|>` or `<|open|>response<|sep|>`).
- `include_end_of_msg`: also the `<|end_of_msg|>` after the message (SF/TorchSpec drafts stop on 163586, §5).
- `include_channel_opener_and_end_of_msg`: both.
"""
from __future__ import annotations

from regen.render.kimi_k3.format import (  # noqa: F401  (re-exported: the format's public names live here too)
    ASSISTANT_OPEN,
    CHANNEL_OPEN,
    END,
    GENERATED,
    PROMPT,
    RenderError,
    Segment,
    build_segments,
)
from regen.render.kimi_k3.tokenizer import KimiTokenizer, load_tokenizer
from regen.render.renderer import Rendered

RENDERER_NAME = "kimi-k3"
RENDERER_VERSION = "2"  # bump whenever output ids or spans can change (2: notes in the prompt of a sample)

MASK_POLICIES: dict[str, frozenset[str]] = {
    "spec": frozenset({GENERATED}),
    "generated": frozenset({GENERATED}),
    "include_channel_opener": frozenset({CHANNEL_OPEN, GENERATED}),
    "include_end_of_msg": frozenset({GENERATED, END}),
    "include_channel_opener_and_end_of_msg": frozenset({CHANNEL_OPEN, GENERATED, END}),
}
DEFAULT_MASK_POLICY = "spec"
TEMPLATE_KWARGS = ("thinking", "thinking_effort", "add_generation_prompt", "tool_choice", "response_format")


class KimiK3Renderer:
    """`regen.render.renderer.Renderer` for Kimi-K3.

    tokenizer: a KimiTokenizer, a checkpoint directory path, or None (the project's test vocabulary).
    mask_policy: a key of MASK_POLICIES. effort_aliases: see `build_segments`. The renderer raises only where the
        reference (ENC) raises; `regen.render.kimi_k3.messages.row_problems` says what makes a bad training row.
    template_defaults: default template kwargs (e.g. from the profile), overridden per `render` call.
    Raises RenderError (ValueError) for an unknown mask policy; InputError for a bad tokenizer directory.
    """

    name = RENDERER_NAME
    version = RENDERER_VERSION
    text_control_tokens: tuple[str, ...] = ()  # message text is encoded as plain text: no string in it is a control token

    def __init__(self, tokenizer: KimiTokenizer | str | None = None, *, mask_policy: str = DEFAULT_MASK_POLICY,
                 effort_aliases: dict[str, str] | None = None,
                 template_defaults: dict | None = None):
        if mask_policy not in MASK_POLICIES:
            raise RenderError("bad_option", f"mask_policy={mask_policy!r}; give one of {list(MASK_POLICIES)}")
        self.tokenizer = tokenizer if isinstance(tokenizer, KimiTokenizer) else load_tokenizer(tokenizer)
        self.mask_policy = mask_policy
        self._supervised = MASK_POLICIES[mask_policy]
        self.options = {"effort_aliases": effort_aliases}
        self.template_defaults = dict(template_defaults or {})
        self._check_kwargs(self.template_defaults)
        self.tokenizer_name = self.tokenizer.name
        self.tokenizer_hash = self.tokenizer.hash

    @staticmethod
    def _check_kwargs(kwargs: dict) -> None:
        unknown = sorted(set(kwargs) - set(TEMPLATE_KWARGS))
        if unknown:
            raise RenderError("bad_option", f"unknown Kimi-K3 template kwargs {unknown}; allowed: {list(TEMPLATE_KWARGS)}")

    def segments(self, messages: list[dict], tools: list[dict] | None = None, **template_kwargs) -> list[Segment]:
        """The labelled segments of one conversation (template kwargs over `template_defaults`)."""
        self._check_kwargs(template_kwargs)
        kwargs = {**self.template_defaults, **template_kwargs}
        return build_segments(messages, tools, **kwargs, **self.options)

    def encode_segments(self, segments: list[Segment]) -> tuple[list[int], list[tuple[int, int]]]:
        """(input_ids, assistant_spans): ids by §3 segment encoding; one half-open span per assistant message
        (in message order) over the segments whose kind the mask policy supervises."""
        tok = self.tokenizer
        ids: list[int] = []
        spans: dict[int, list[int]] = {}
        supervised = self._supervised
        for seg in segments:
            start = len(ids)
            if seg.parts is not None:
                ids.extend(tok.encode_parts(seg.parts))
            elif seg.special:
                ids.extend(tok.encode_special(seg.text))
            else:
                ids.extend(tok.encode_text(seg.text))
            if seg.message is not None:
                span = spans.setdefault(seg.message, [-1, -1])
                if seg.kind in supervised:
                    if span[0] < 0:
                        span[0] = start
                    span[1] = len(ids)
        return ids, [(s, e) for s, e in spans.values()]

    def render(self, messages: list[dict], tools: list[dict] | None = None, *, last_only: bool = False,
               **template_kwargs) -> Rendered:
        """Rendered(text, input_ids, assistant_spans) for one conversation, as the reference renders it (ENC).
        Raises RenderError only where ENC raises (or for an unknown option).

        `last_only=True` with a conversation that ends in an assistant message: the training sample of that turn,
        one span: `messages[:-1]` rendered with the generation prompt (the notes of `tool_choice` /
        `response_format` included: the prompt the target read) followed by the answer's segments. The reference
        places those notes after the whole conversation, i.e. after the answer, where the target never saw them.
        """
        if last_only and self._ends_in_answer(messages, template_kwargs):
            segs = self._turn_segments(messages, tools, template_kwargs)
            ids, spans = self.encode_segments(segs)
            return Rendered("".join(s.text for s in segs), ids, spans[-1:])
        segs = self.segments(messages, tools, **template_kwargs)
        ids, spans = self.encode_segments(segs)
        return Rendered("".join(s.text for s in segs), ids, spans[-1:] if last_only else spans)

    def _ends_in_answer(self, messages, kwargs: dict) -> bool:
        gen_prompt = {**self.template_defaults, **kwargs}.get("add_generation_prompt", True)
        return (not gen_prompt and isinstance(messages, list) and len(messages) > 1
                and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant")

    def _turn_segments(self, messages: list[dict], tools, kwargs: dict) -> list[Segment]:
        """The prompt of the last turn as the target read it (generation prompt = the assistant and channel
        openers, §2.6) + the last assistant message. Segments are encoded one by one (§3), so no token can straddle
        the prompt/answer boundary: the generation prompt ends in `<|sep|>`, a control segment."""
        last = len(messages) - 1
        prompt = self.segments(messages[:-1], tools, **{**kwargs, "add_generation_prompt": False})
        full = self.segments(messages, tools, **{**kwargs, "add_generation_prompt": False, "tool_choice": None,
                                                 "response_format": None})
        return prompt + [seg for seg in full if seg.message == last]

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids, control strings as ordinary BPE."""
        return self.tokenizer.encode_text(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def describe(self) -> dict:
        """The training-contract fields of this renderer for a shard manifest."""
        return {"renderer": self.name, "renderer_version": self.version, "mask_policy": self.mask_policy,
                "tokenizer_name": self.tokenizer_name, "tokenizer_hash": self.tokenizer_hash,
                "test_vocabulary": self.tokenizer.is_test_vocab, "template_defaults": self.template_defaults}
