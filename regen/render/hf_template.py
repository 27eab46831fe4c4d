"""Render any target that has a Hugging Face chat template, turn by turn, with an assistant mask over exactly the
tokens the target generated.

Loaded offline from a local directory with `tokenizer.json`/`tokenizer_config.json` (and optionally
`chat_template.jinja`) through `transformers.AutoTokenizer`.

Turn by turn, so the prompt ids are the ones the target read. For each assistant message at index k, `pre` =
`messages[:k]` rendered with `add_generation_prompt=True` (the prompt the target read) and `messages[:k+1]` without it
must each be a prefix of the next and of the whole conversation; the answer is the text from `len(pre)` to its end. A
template that rewrites history (e.g. drops earlier reasoning) is not prefix-stable: `TemplateNotPrefixStable` names the
message and the first differing character. Where the answer ends (two ways):

- `prefix` (every prefix-stable template): up to and including the answer's last special token (the end-of-turn
  marker the model emits, e.g. `<end_of_turn>`, `<|im_end|>`); trailing decoration after it (a newline) is not
  supervised.
- `markers` (templates with `{% generation %}` blocks): the end of the message's block, from the same Jinja
  rendering `apply_chat_template(return_assistant_tokens_mask=True)` uses (`render_jinja_template`); a block that
  starts inside the generation prompt is clipped to it (the target did not generate the prompt).

Ids: the text is tokenized piece by piece at the cuts (prompt, answer, tail + next prompt, answer, ...), never in
one pass, so no token straddles a prompt/answer boundary: with Gemma's template, an answer "\nHello" after
"...<start_of_turn>model\n" is ids(prompt) + ids("\nHello<end_of_turn>"), not a merged "\n\n" token. Hence
`render(messages[:k], add_generation_prompt=True).input_ids == render(messages).input_ids[:start_k]` for every k,
and with `last_only=True` the prompt before the last answer is one piece: the generation prompt tokenized alone, as
an OpenAI-compatible server tokenizes it.

`mask="auto"` uses the markers when the template has them, else prefixes.
Source: transformers `apply_chat_template` (chat templating docs, "assistant_masks").
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
    version = "2"  # 2: prompt and answer tokenized apart at the generation prompt

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
        # the strings this tokenizer turns into control tokens wherever they stand in message text (it splits every
        # special token out of the text it encodes: transformers #29279); `regen.render.guards` rejects them
        self.text_control_tokens = tuple(self.special_tokens)

    # -- the Renderer protocol -------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Text -> ids as the template path tokenizes it (special-token strings become their ids, no BOS added)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def render(self, messages: list[dict], tools: list[dict] | None = None, *, last_only: bool = False,
               **template_kwargs) -> Rendered:
        """Render `messages` (+ `tools`) with the chat template; one span per assistant message.

        `add_generation_prompt=True` appends the generation prompt after the last message (no span for it).
        `last_only=True`: only the last assistant message gets a span and only its prefixes are checked, so a
        template that rewrites earlier turns (e.g. drops their reasoning) still renders a row whose history is "as
        the template renders it"; ids = the generation prompt tokenized alone + the answer tokenized alone + the
        tail tokenized alone (the training sample of that turn).
        Raises TemplateNotPrefixStable or InputError (marker path: blocks != assistant messages).
        """
        gen_prompt = bool(template_kwargs.pop("add_generation_prompt", False))
        template_kwargs.pop("tokenize", None)
        full = self._text(messages, tools, gen_prompt, template_kwargs)
        blocks = (self._generation_blocks(messages, tools, gen_prompt, template_kwargs, full)
                  if self.mask == "markers" else None)
        return self._render_turns(messages, tools, template_kwargs, full, last_only, blocks)

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

    def _generation_blocks(self, messages, tools, gen_prompt: bool, kwargs: dict, full: str) -> list[tuple[int, int]]:
        """Char spans of the template's `{% generation %}` blocks in `full` (one per assistant message), from the
        same Jinja rendering `apply_chat_template(return_assistant_tokens_mask=True)` uses. Raises InputError when
        that rendering differs from `full` or the block count differs from the assistant count."""
        from transformers.utils.chat_template_utils import render_jinja_template

        chat = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]
        texts, blocks = render_jinja_template(
            conversations=[chat], tools=tools or None, chat_template=self.tokenizer.get_chat_template(None, tools),
            return_assistant_tokens_mask=True, add_generation_prompt=gen_prompt,
            **{**self.tokenizer.special_tokens_map, **kwargs},
        )
        num_assistant = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
        if texts[0] != full or len(blocks[0]) != num_assistant:
            raise InputError(
                f"chat template of {self.tokenizer_name}: {{% generation %}} marked {len(blocks[0])} blocks for "
                f"{num_assistant} assistant messages; use render.hf_mask=prefix for this template"
            )
        return list(blocks[0])

    def _render_turns(self, messages, tools, kwargs: dict, full: str, last_only: bool,
                      blocks: list[tuple[int, int]] | None) -> Rendered:
        """Turn by turn: for each assistant message k, `pre` = messages[:k] rendered alone
        with the generation prompt (what the target read) must be a prefix of the conversation; the answer
        starts at `len(pre)` and ends at its `{% generation %}` block's end (`blocks`) or its last special token.
        Ids: the text tokenized piece by piece at those cuts, so no token straddles a prompt/answer boundary."""
        assistant = [k for k, m in enumerate(messages) if m.get("role") == "assistant"]
        chosen = assistant[-1:] if last_only else assistant
        cuts = [0]
        span_cuts: list[tuple[int, int]] = []
        last_end = 0
        for k in chosen:
            pre = self._text(messages[:k], tools, True, kwargs) if k else ""
            post = self._text(messages[: k + 1], tools, False, kwargs)
            for a, b, what in ((pre, post, f"messages[:{k}] + generation prompt is not a prefix of messages[:{k + 1}]"),
                               (post, full, f"messages[:{k + 1}] is not a prefix of the whole conversation")):
                if not b.startswith(a):
                    i = _first_difference(a, b)
                    raise TemplateNotPrefixStable(
                        f"chat template of {self.tokenizer_name} is not prefix-stable at message {k}: {what}; "
                        f"first difference at char {i}: {a[max(0, i - 40):i + 40]!r} vs {b[max(0, i - 40):i + 40]!r}. "
                        f"The prompt the target read must be a prefix of the row: use a template that keeps history "
                        f"as rendered"
                    )
            if len(pre) < last_end:
                raise TemplateNotPrefixStable(
                    f"chat template of {self.tokenizer_name}: the prompt for message {k} ends before the previous "
                    f"assistant turn does (char {len(pre)} < {last_end})"
                )
            if blocks is not None:
                b_start, b_end = blocks[assistant.index(k)]
                start, end = max(b_start, len(pre)), max(b_end, len(pre))
            else:
                start, end = len(pre), len(pre) + self.answer_end(post[len(pre):])
            cuts += [len(pre), start, end]
            span_cuts.append((start, end))
            last_end = end
        cuts.append(len(full))
        bounds = sorted(set(cuts))
        pieces = [full[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]
        encoded = self.tokenizer(pieces, add_special_tokens=False)["input_ids"] if pieces else []
        ids: list[int] = []
        at: dict[int, int] = {0: 0}  # char cut -> token index
        for b, piece_ids in zip(bounds[1:], encoded):
            ids.extend(piece_ids)
            at[b] = len(ids)
        return Rendered(full, ids, [(at[s], at[e]) for s, e in span_cuts])
