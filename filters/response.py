"""Response filters: score one generation row, then decide, with a reason (the `filters.base` contract).

A record is one `schemas.generation.GENERATION_SCHEMA` row as a dict (`messages`, `content`,
`reasoning_content`, `tool_calls`, `finish_reason`, `category`, `language`, token counts). Thresholds come from
`render.filter_params` (regen/config/render.py) as plain keyword arguments; each filter reads only its own keys.
Registry: `RESPONSE_FILTERS` (a literal dict, in the default config order). Drops go to `rejected/render/`.

Sources: the duplicate n-gram fraction is Gopher's repetition filter (Rae et al. 2021, appendix A, "fraction of
characters in duplicate n-grams", here over word n-grams); the compression ratio is zlib level 6 compressed
bytes / UTF-8 bytes; language identification is py3langid (langid.py, Lui & Baldwin 2012) with normalized
probabilities.
"""
from __future__ import annotations

import json
import re
import zlib
from functools import lru_cache

from filters.base import Filter

WORD = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]|\w+|[^\w\s]", re.UNICODE)
CODE_BLOCK = re.compile(r"```.*?(```|$)", re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
TRANSLATE = re.compile(r"translat|übersetz|tradu|перевед|переве|翻译|翻譯|翻訳|번역", re.IGNORECASE)


def _text_of(message: dict | None) -> str:
    """The text of a message in OpenAI or Arrow form (string content or text parts joined by newlines)."""
    if not message:
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else message.get("content_parts") or []
    return "\n".join(p.get("text") or "" for p in parts if isinstance(p, dict) and p.get("type") == "text")


def _last_user_text(record: dict) -> str:
    for m in reversed(record.get("messages") or []):
        if m.get("role") == "user":
            return _text_of(m)
    return ""


class Truncated(Filter):
    """finish_reason "length": the answer was cut at max_tokens (score 1) and its end is not what the target would say."""

    name = "truncated"

    def score(self, record) -> float:
        return 1.0 if record.get("finish_reason") == "length" else 0.0

    def keep(self, score: float) -> bool:
        return score < 1.0

    def reason(self, record, score: float) -> str:
        return f"finish_reason is 'length': truncated after {record.get('num_completion_tokens')} completion tokens"


class EmptyAnswer(Filter):
    """No answer: content empty or whitespace and no tool calls (score 1). Reasoning alone is not an answer."""

    name = "empty_answer"

    def score(self, record) -> float:
        empty = not (record.get("content") or "").strip() and not record.get("tool_calls")
        return 1.0 if empty else 0.0

    def keep(self, score: float) -> bool:
        return score < 1.0

    def reason(self, record, score: float) -> str:
        has_reasoning = bool((record.get("reasoning_content") or "").strip())
        return f"content is empty and there are no tool_calls (reasoning_content {'present' if has_reasoning else 'empty'})"


class ReasoningLeak(Filter):
    """Think markers inside `content`: reasoning leaked into the answer (score = number of markers found)."""

    name = "reasoning_leak"

    def __init__(self, leak_markers=("<think>", "</think>")):
        self.markers = list(leak_markers)

    def score(self, record) -> float:
        content = record.get("content") or ""
        return float(sum(content.count(m) for m in self.markers))

    def keep(self, score: float) -> bool:
        return score == 0

    def reason(self, record, score: float) -> str:
        content = record.get("content") or ""
        found = [m for m in self.markers if m in content]
        return f"content contains think markers {found} ({score:g} occurrences): reasoning leaked into the answer"


class ToolArgs(Filter):
    """tool_calls whose `function.arguments` is not a JSON object (score = number of bad calls)."""

    name = "tool_args"

    @staticmethod
    def problems(record) -> list[str]:
        out = []
        for i, call in enumerate(record.get("tool_calls") or []):
            fn = call.get("function") or {}
            args = fn.get("arguments")
            if not fn.get("name"):
                out.append(f"tool_calls[{i}] has no function name")
                continue
            if args is None or (isinstance(args, str) and not args.strip()):
                continue  # no arguments
            try:
                value = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError as exc:
                out.append(f"tool_calls[{i}] ({fn.get('name')}) arguments are not JSON: {exc.msg} at char {exc.pos}")
                continue
            if not isinstance(value, dict):
                out.append(f"tool_calls[{i}] ({fn.get('name')}) arguments are JSON {type(value).__name__}, not an object")
        return out

    def score(self, record) -> float:
        return float(len(self.problems(record)))

    def keep(self, score: float) -> bool:
        return score == 0

    def reason(self, record, score: float) -> str:
        return "; ".join(self.problems(record))


def dup_ngram_fraction(text: str, n: int, words: list[str] | None = None) -> float:
    """Fraction of word n-grams of `text` that repeat an earlier n-gram (0 = none, -> 1 for a loop).

    N-grams are compared by a 64-bit polynomial hash of the words' Python hashes (numpy, wrapping uint64
    arithmetic); a collision can only make the fraction higher, with probability ~ count^2 / 2^64."""
    import numpy as np

    words = WORD.findall(text) if words is None else words
    if len(words) < n + 1:
        return 0.0
    ids = np.fromiter(map(hash, words), dtype=np.int64, count=len(words)).view(np.uint64)
    count = len(words) - n + 1
    h = np.zeros(count, dtype=np.uint64)
    base = np.uint64(1_000_003)
    with np.errstate(over="ignore"):
        for k in range(n):
            h = h * base + ids[k:k + count]
    return 1.0 - len(np.unique(h)) / count


class Repetition(Filter):
    """Degenerate loops: the duplicated word n-gram fraction of the reasoning or the answer, whichever is higher.

    Only texts of at least `repetition_min_tokens` words are scored (short answers repeat by nature)."""

    name = "repetition"

    def __init__(self, ngram_size=10, max_dup_ngram_fraction=0.5, repetition_min_tokens=64):
        self.n, self.max_fraction, self.min_tokens = ngram_size, max_dup_ngram_fraction, repetition_min_tokens

    def _scores(self, record) -> dict[str, float]:
        out = {}
        for field in ("reasoning_content", "content"):
            text = record.get(field) or ""
            words = WORD.findall(text) if len(text) >= self.min_tokens else []
            if len(words) >= self.min_tokens:
                out[field] = dup_ngram_fraction(text, self.n, words)
        return out

    def score(self, record) -> float:
        return max(self._scores(record).values(), default=0.0)

    def keep(self, score: float) -> bool:
        return score <= self.max_fraction

    def reason(self, record, score: float) -> str:
        worst = max(self._scores(record).items(), key=lambda kv: kv[1])[0]
        return f"{worst}: {score:.2f} of its {self.n}-word n-grams repeat (max {self.max_fraction}): a repetition loop"


def compression_ratio(text: str) -> float:
    raw = text.encode("utf-8")
    return len(zlib.compress(raw, 6)) / len(raw) if raw else 1.0


class Compression(Filter):
    """Degenerate loops by zlib: compressed/raw bytes of the reasoning or answer, whichever is lower.

    Only texts of at least `compression_min_chars` characters are scored."""

    name = "compression"

    def __init__(self, min_compression_ratio=0.08, compression_min_chars=1024):
        self.min_ratio, self.min_chars = min_compression_ratio, compression_min_chars

    def _scores(self, record) -> dict[str, float]:
        return {f: compression_ratio(record.get(f) or "") for f in ("reasoning_content", "content")
                if len(record.get(f) or "") >= self.min_chars}

    def score(self, record) -> float:
        return min(self._scores(record).values(), default=1.0)

    def keep(self, score: float) -> bool:
        return score >= self.min_ratio

    def reason(self, record, score: float) -> str:
        worst = min(self._scores(record).items(), key=lambda kv: kv[1])[0]
        return f"{worst} compresses to {score:.3f} of its size with zlib (min {self.min_ratio}): a repetition loop"


@lru_cache(maxsize=1)
def _identifier():
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


def _lang_code(code: str | None) -> str | None:
    return code.split("-")[0].split("_")[0].lower() if code else None


def _prose(text: str) -> str:
    return INLINE_CODE.sub(" ", CODE_BLOCK.sub(" ", text))


class Language(Filter):
    """An answer confidently in another language than the prompt's `language` (score = that probability).

    The expected language is the record's `language` or else the detected language of the last user message.
    Code is stripped first and at most `language_max_chars` characters are classified; prompts that ask for a
    translation and skipped categories are not scored; texts shorter than `language_min_chars` after stripping are not
    scored."""

    name = "language"

    def __init__(self, language_min_chars=80, language_min_prob=0.95, language_skip_categories=("code", "translation"),
                 language_max_chars=600):
        self.min_chars, self.min_prob, self.max_chars = language_min_chars, language_min_prob, language_max_chars
        self.skip = set(language_skip_categories)

    def detect(self, record) -> tuple[str | None, str | None, float]:
        """(expected, detected, probability of detected); detected None when not scored."""
        if record.get("category") in self.skip:
            return None, None, 0.0
        prompt = _last_user_text(record)
        if TRANSLATE.search(prompt):
            return None, None, 0.0
        answer = _prose(record.get("content") or "").strip()[: self.max_chars]
        if len(answer) < self.min_chars:
            return None, None, 0.0
        expected = _lang_code(record.get("language"))
        if expected is None:
            text = _prose(prompt).strip()[: self.max_chars]
            if len(text) < self.min_chars:
                return None, None, 0.0
            lang, prob = _identifier().classify(text)
            if prob < self.min_prob:
                return None, None, 0.0
            expected = lang
        lang, prob = _identifier().classify(answer)
        return expected, lang, float(prob)

    def score(self, record) -> float:
        expected, lang, prob = self.detect(record)
        return prob if lang is not None and lang != expected else 0.0

    def keep(self, score: float) -> bool:
        return score < self.min_prob

    def reason(self, record, score: float) -> str:
        expected, lang, prob = self.detect(record)
        return f"answer is in {lang!r} (p={prob:.3f}) but the prompt is in {expected!r}"


class OverLong(Filter):
    """Rows whose server token counts (prompt + completion) exceed `max_tokens` (score = that total; 0 unknown).

    Exact lengths are checked again after rendering; this drops the obvious ones before any tokenization."""

    name = "over_long"

    def __init__(self, max_tokens=32_768):
        self.max_tokens = max_tokens

    def score(self, record) -> float:
        p = record.get("prompt_token_ids")
        c = record.get("completion_token_ids")  # the render stage passes their lengths as num_*_tokens instead
        num_prompt = len(p) if p is not None else record.get("num_prompt_tokens")
        num_completion = len(c) if c is not None else record.get("num_completion_tokens")
        if num_prompt is None or num_completion is None:
            return 0.0
        return float(num_prompt + num_completion)

    def keep(self, score: float) -> bool:
        return score <= self.max_tokens

    def reason(self, record, score: float) -> str:
        return f"prompt + completion is {score:g} tokens by the server's count (max {self.max_tokens})"


RESPONSE_FILTERS: dict[str, type[Filter]] = {
    "truncated": Truncated,
    "empty_answer": EmptyAnswer,
    "reasoning_leak": ReasoningLeak,
    "tool_args": ToolArgs,
    "repetition": Repetition,
    "compression": Compression,
    "language": Language,
    "over_long": OverLong,
}


def make_response_filters(names: list[str], params: dict) -> list[Filter]:
    """Filters in `names` order, each built from the keys of `params` its constructor takes.

    Raises KeyError naming the unknown filter and the known ones."""
    import inspect

    out = []
    for name in names:
        if name not in RESPONSE_FILTERS:
            raise KeyError(f"unknown response filter {name!r}; known: {sorted(RESPONSE_FILTERS)}")
        cls = RESPONSE_FILTERS[name]
        accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
        out.append(cls(**{k: v for k, v in params.items() if k in accepted and v is not None}))
    return out
