"""Render's guards: text that must not become supervised tokens. Used by `regen.render.rows`.

* Text after the end of the turn (SGLang #31599, vLLM PR #47616): the generated answer holds the renderer's
  end-of-turn text (hf: the answer's closing special token and EOS, e.g. `<|im_end|>`) with more text after it.
  Rendered, the literal becomes the real control token and the text after it is supervised: the draft would
  learn to continue past the end of a turn. Such a row is a reject (`text_after_end`); one marker echoed at the
  very end, with nothing after it, is stripped and counted (`end_marker_stripped`). Kimi-K3 encodes such text as
  text, so there only ids count: with server token ids, an end-of-turn id (hf: the closing token, EOS; kimi-k3:
  `<|end_of_msg|>`, `[EOS]`, or the whole `<|close|>message<|sep|>`) before the end of `completion_token_ids` is
  the same fault, for every renderer.
* Control-token strings in text (transformers #29279): where the renderer's tokenizer would read a string of the
  conversation as a control token (`Renderer.text_control_tokens`: hf), a row holding one in any place
  (system, user, assistant history, reasoning, tool arguments, tool results, tool declarations, the generated
  answer) is a reject (`control_tokens`) under `render.control_tokens: reject` (the default); the select stage
  rejects such prompts before any request (`regen.render.stage.prompt_control_tokens`). Kimi-K3 has none.

Each check returns `(filter, reason)` for a reject, or None.
"""
from __future__ import annotations

from filters.control_tokens import ControlTokenFinder, first_in_conversation, strip_echoed_end, text_after_end


class TextGuard:
    """The guards of one renderer: `closing` (ids ending every generated span), `enders` (end ids a server may
    append), `policy` (render.control_tokens)."""

    def __init__(self, renderer, closing: list[int], enders: set[int], policy: str = "reject"):
        self.closing = list(closing)
        self.end_ids = set(enders) | (set(closing) if len(closing) == 1 else set())
        parsed = tuple(getattr(renderer, "text_control_tokens", ()))
        texts = [renderer.decode(self.closing)] if self.closing else []
        texts += [renderer.decode([i]) for i in sorted(enders)]
        # end-of-turn text matters where the tokenizer reads it as the end token (hf); kimi-k3 keeps it as text
        self.end_texts = sorted({t for t in texts if t and t.strip() and t in parsed}, key=len, reverse=True)
        self.finder = ControlTokenFinder(parsed if policy == "reject" else ())
        self.renderer_name = renderer.name

    def answer(self, msg: dict) -> tuple[tuple[str, str] | None, bool]:
        """Check (and fix) the generated assistant message in place: `(reject or None, echoed marker stripped)`."""
        args = [c.get("function", {}).get("arguments") for c in msg.get("tool_calls") or []]
        others = [msg.get("reasoning_content") or ""] + [a for a in args if isinstance(a, str)]
        stripped = False
        if not msg.get("tool_calls") and msg.get("content"):
            msg["content"], marker = strip_echoed_end(msg["content"], others, self.end_texts)
            stripped = marker is not None
        texts = [("reasoning_content", msg.get("reasoning_content") or ""), ("content", msg.get("content") or "")]
        texts += [(f"tool_calls[{j}].function.arguments", a) for j, a in enumerate(args) if isinstance(a, str)]
        after = text_after_end(texts, self.end_texts)
        if after:
            return ("text_after_end", f"the generated answer: {after}"), stripped
        hit = first_in_conversation(self.finder, [msg], None)
        if hit:
            token, place, at = hit
            return ("control_tokens", f"control-token string {token!r} in the generated answer "
                                      f"({place.split(' ', 2)[-1]}) at char {at}: the {self.renderer_name} "
                                      "renderer's tokenizer would read it as a control token"), stripped
        return None, stripped

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> tuple[str, str] | None:
        """The conversation before the generated turn (and the tools): a control-token string anywhere in it."""
        hit = first_in_conversation(self.finder, messages, tools)
        if not hit:
            return None
        token, place, at = hit
        return ("control_tokens", f"control-token string {token!r} in {place} at char {at}: the "
                                  f"{self.renderer_name} renderer's tokenizer would read it as a control token "
                                  "(forged turn boundaries, transformers #29279); set render.control_tokens: keep "
                                  "to render it so")

    def completion_ids(self, ids: list[int]) -> tuple[str, str] | None:
        """Server completion ids holding an end-of-turn id (or the closing sequence) before their end."""
        body = list(ids)
        while body and body[-1] in self.end_ids:
            body.pop()
        n = len(self.closing)
        if n > 1:  # the closing sequence (or its first ids: a trimmed stop) ends the answer: the end of the turn
            for j in range(n, 0, -1):
                if len(body) >= j and body[-j:] == self.closing[:j]:
                    del body[-j:]
                    break
        for k, t in enumerate(body):
            if t in self.end_ids:
                return ("text_after_end", f"end-of-turn id {t} at position {k} of {len(ids)} completion_token_ids: "
                                          "tokens past the end of the turn (SGLang #31599)")
        if n > 1:
            for k in range(len(body) - n + 1):
                if body[k:k + n] == self.closing:
                    return ("text_after_end", f"the closing ids {self.closing} at position {k} of {len(ids)} "
                                              "completion_token_ids: tokens past the end of the turn (SGLang #31599)")
        return None
