"""Render any target that has a Hugging Face chat template, with an assistant mask that needs no template markers.

Loaded offline from a local directory with `tokenizer.json`/`tokenizer_config.json` (and optionally
`chat_template.jinja`) through `transformers.AutoTokenizer`. Two ways to find what the target generated:

- `prefix` (works for every prefix-stable template): for each assistant message at index k, render
  `messages[:k]` with `add_generation_prompt=True` (the prompt the target read) and `messages[:k+1]` without it
  (the prompt plus the answer), and check each is a prefix of the next and of the whole conversation. The text
  between them is the assistant's turn; it is supervised up to and including its last special token (the
  end-of-turn marker the model emits, e.g. `<end_of_turn>`, `<|im_end|>`), and trailing template decoration
  after that (a newline) is not. A template that rewrites history (e.g. drops earlier reasoning) is not
  prefix-stable: `TemplateNotPrefixStable` names the message and the first differing character.
  Ids are the text tokenized piece by piece at span boundaries (prompt, answer, gap, answer, ...), so the
  mask covers exactly the answer's tokens, as a server that tokenizes the prompt and samples the answer sees it.
- `markers` (templates with `{% generation %}` blocks): `apply_chat_template(return_assistant_tokens_mask=True)`.

`mask="auto"` uses the markers when the template has them, else prefixes.
Source: transformers `apply_chat_template` (chat templating docs, "assistant_masks"); issue #4 point 3.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from regen.errors import InputError
from regen.render.renderer import Rendered

GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json", "special_tokens_map.json",
    "tokenizer.model", "tiktoken.model", "vocab.json", "merges.txt", "added_tokens.json",
)


class TemplateNotPrefixStable(InputError):
    """The chat template renders a conversation's prefix differently from the conversation (history rewritten)."""


def tokenizer_files_hash(path: str | os.PathLike) -> str:
    """sha256 over the tokenizer files present in `path` (name + content, in `TOKENIZER_FILES` order)."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = Path(path) / name
        if f.is_file():
            h.update(name.encode() + b"\0")
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class HFTemplateRenderer:
    """`regen.render.renderer.Renderer` for a local Hugging Face tokenizer directory with a chat template.

    path: directory holding `tokenizer.json` + `tokenizer_config.json` (chat_template inside or in
        `chat_template.jinja`). Raises InputError when it does not load or has no chat template.
    mask: "auto" | "markers" | "prefix" (see the module docstring).
    """

    name = "hf"
    version = "1"

    def __init__(self, path: str | os.PathLike, mask: str = "auto"):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoTokenizer

        path = Path(path)
        if not path.is_dir():
            raise InputError(f"tokenizer directory {path} does not exist: set render.tokenizer to a local directory")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # transformers raises many types for a bad directory
            raise InputError(f"tokenizer directory {path} does not load with AutoTokenizer: {exc}") from None
        template = self.tokenizer.chat_template
        if not template or not isinstance(template, str):
            raise InputError(
                f"tokenizer directory {path} has no chat template: add chat_template.jinja or a "
                f"chat_template entry in tokenizer_config.json"
            )
        if mask not in ("auto", "markers", "prefix"):
            raise InputError(f"hf mask {mask!r}: use auto, markers or prefix")
        self.has_markers = bool(GENERATION_TAG.search(template))
        if mask == "markers" and not self.has_markers:
            raise InputError(f"render.hf_mask=markers but the chat template in {path} has no {{% generation %}} block")
        self.mask = "markers" if (mask == "markers" or (mask == "auto" and self.has_markers)) else "prefix"
        self.tokenizer_name = path.name
        self.tokenizer_hash = tokenizer_files_hash(path)
        self.mask_policy = f"hf-{self.mask}"
        specials = set(self.tokenizer.all_special_tokens)
        for tok in getattr(self.tokenizer, "added_tokens_decoder", {}).values():
            if getattr(tok, "special", False):
                specials.add(str(tok))
        self.special_tokens = sorted((s for s in specials if s), key=len, reverse=True)

    # -- the Renderer protocol -------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Text -> ids as the template path tokenizes it (special-token strings become their ids, no BOS added)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def render(self, messages: list[dict], tools: list[dict] | None = None, *, last_only: bool = False,
               with_text: bool = True, **template_kwargs) -> Rendered:
        """Render `messages` (+ `tools`) with the chat template; one span per assistant message.

        `add_generation_prompt=True` appends the generation prompt after the last message (no span for it).
        `last_only=True` (prefix path): only the last assistant message gets a span and only its prefixes are
        checked, so a template that rewrites earlier turns (e.g. drops their reasoning) still renders a row
        whose history is "as the template renders it" and whose answer is what the target generated last.
        `with_text=False` (marker path) skips the second template pass that only produces `Rendered.text` ("").
        Raises TemplateNotPrefixStable (prefix path) or InputError (marker path: runs != assistant messages).
        """
        gen_prompt = bool(template_kwargs.pop("add_generation_prompt", False))
        template_kwargs.pop("tokenize", None)
        if self.mask == "markers":
            return self._render_markers(messages, tools, gen_prompt, template_kwargs, with_text)
        return self._render_prefix(messages, tools, gen_prompt, template_kwargs, last_only)

    # -- helpers ---------------------------------------------------------------------------------------------

    def _text(self, messages, tools, gen_prompt: bool, kwargs: dict) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=gen_prompt, **kwargs
        )

    def answer_end(self, answer: str) -> int:
        """Chars of an assistant turn's text that the target generated: through its last special token, else all."""
        best = -1
        for s in self.special_tokens:
            i = answer.rfind(s)
            if i >= 0:
                best = max(best, i + len(s))
        return best if best >= 0 else len(answer)

    def _render_prefix(self, messages, tools, gen_prompt: bool, kwargs: dict, last_only: bool = False) -> Rendered:
        full = self._text(messages, tools, gen_prompt, kwargs)
        char_spans: list[tuple[int, int]] = []
        last_end = 0
        assistant = [k for k, m in enumerate(messages) if m.get("role") == "assistant"]
        for k in assistant[-1:] if last_only else assistant:
            pre = self._text(messages[:k], tools, True, kwargs) if k else ""
            post = self._text(messages[: k + 1], tools, False, kwargs)
            for a, b, what in ((pre, post, f"messages[:{k}] + generation prompt is not a prefix of messages[:{k + 1}]"),
                               (post, full, f"messages[:{k + 1}] is not a prefix of the whole conversation")):
                if not b.startswith(a):
                    i = _first_difference(a, b)
                    raise TemplateNotPrefixStable(
                        f"chat template of {self.tokenizer_name} is not prefix-stable at message {k}: {what}; "
                        f"first difference at char {i}: {a[max(0, i - 40):i + 40]!r} vs {b[max(0, i - 40):i + 40]!r}. "
                        f"Use a template that keeps history as rendered (or one with {{% generation %}} markers)"
                    )
            if len(pre) < last_end:
                raise TemplateNotPrefixStable(
                    f"chat template of {self.tokenizer_name}: the prompt for message {k} ends before the previous "
                    f"assistant turn does (char {len(pre)} < {last_end})"
                )
            end = len(pre) + self.answer_end(post[len(pre):])
            char_spans.append((len(pre), end))
            last_end = end
        cuts = [0]
        for s, e in char_spans:
            cuts += [s, e]
        cuts.append(len(full))
        pieces = [full[cuts[i]:cuts[i + 1]] for i in range(len(cuts) - 1)]
        encoded = self.tokenizer(pieces, add_special_tokens=False)["input_ids"] if pieces else []
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        for i, piece_ids in enumerate(encoded):
            start = len(ids)
            ids.extend(piece_ids)
            if i % 2 == 1:  # odd pieces are assistant answers
                spans.append((start, len(ids)))
        return Rendered(full, ids, spans)

    def _render_markers(self, messages, tools, gen_prompt: bool, kwargs: dict, with_text: bool = True) -> Rendered:
        out = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
            add_generation_prompt=gen_prompt, **kwargs,
        )
        ids = list(out["input_ids"])
        mask = list(out["assistant_masks"])
        spans: list[tuple[int, int]] = []
        start = None
        for i, m in enumerate(mask + [0]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                spans.append((start, i))
                start = None
        num_assistant = sum(1 for m in messages if m.get("role") == "assistant")
        if len(spans) != num_assistant:
            raise InputError(
                f"chat template of {self.tokenizer_name}: {{% generation %}} marked {len(spans)} runs for "
                f"{num_assistant} assistant messages; use render.hf_mask=prefix for this template"
            )
        return Rendered(self._text(messages, tools, gen_prompt, kwargs) if with_text else "", ids, spans)
