"""Prompt filters of `regen select`: each scores a prompt draft, decides with a threshold, and says why.

A record is any object with `messages` (OpenAI dicts), `tools` (OpenAI tools or None), `text`
(system + user text) and `prompt_id` (`regen.select.sources.Draft`). Filters are built from the select config
with `from_config(cfg)`; the pipeline runs them in the config's `filters` order and writes every drop to
`rejected/select/` with the filter's name and reason. Registry: `PROMPT_FILTERS` (a literal dict).

  empty          score: non-space characters of user text; keep >= min_prompt_chars
  control_chars  score: C0 control characters (U+0000-U+001F but tab, newline, carriage return) and DEL in
                 any message's text or the tools; keep when 0 (they are corruption in prompt pools: a NUL cuts
                 C strings in servers and tokenizers; drop the filter from `select.filters` to keep them)
  image_only     score: 1 when a user message holds images and no text (with drop_prompts_with_images: any
                 image); keep when 0
  tool_schema    score: number of problems in the tools / tool calls (OpenAI function-tool format,
                 JSON Schema types); keep when 0
  token_budget   score: estimated prompt tokens (`filters.text.estimate_tokens`); keep <= max_prompt_tokens
  contamination  score: share of the prompt's word n-grams found in the benchmark files (1.0 for an exact
                 normalized-text match); keep < contamination_overlap
  exact_dedup    score: 1 when the normalized conversation + tool names was seen before; keep when 0
  near_dedup     score: estimated Jaccard with an earlier prompt (MinHash LSH, `filters.dedup`);
                 keep < near_dup_threshold
"""
from __future__ import annotations

import json
import re

from filters.base import Filter
from filters.text import estimate_tokens, message_text, normalize_text, text_hash

JSON_TYPES = {"string", "number", "integer", "boolean", "array", "object", "null"}
TOOL_NAME = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
_WORD = re.compile(r"\w+")


class EmptyFilter(Filter):
    name = "empty"

    def __init__(self, min_chars: int = 1):
        self.min_chars = min_chars

    @classmethod
    def from_config(cls, cfg):
        return cls(cfg.min_prompt_chars)

    def score(self, record) -> float:
        """Non-space characters of user text, plus 1 per image part (an image prompt is not empty)."""
        images = sum(1 for m in record.messages if m.get("role") == "user" and isinstance(m.get("content"), list)
                     for p in m["content"] if p.get("type") == "image_url")
        return float(len("".join(message_text(record.messages, roles=("user",)).split())) + images)

    def keep(self, score: float) -> bool:
        return score >= self.min_chars

    def reason(self, record, score: float) -> str:
        return f"user text has {int(score)} non-space characters (minimum {self.min_chars}): empty or whitespace prompt"


CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _strings(messages, tools):
    """(where, text) for every string the prompt sends: message contents, parts, reasoning, calls, tools."""
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, str):
            yield f"messages[{i}].content", content
        elif isinstance(content, list):
            for j, p in enumerate(content):
                if isinstance(p.get("text"), str):
                    yield f"messages[{i}].content[{j}]", p["text"]
        if isinstance(m.get("reasoning_content"), str):
            yield f"messages[{i}].reasoning_content", m["reasoning_content"]
        for j, c in enumerate(m.get("tool_calls") or []):
            yield f"messages[{i}].tool_calls[{j}]", json.dumps(c, ensure_ascii=False)
    if tools:
        yield "tools", json.dumps(tools, ensure_ascii=False)


class ControlCharsFilter(Filter):
    name = "control_chars"

    @classmethod
    def from_config(cls, cfg):
        return cls()

    def score(self, record) -> float:
        return float(sum(len(CONTROL_CHARS.findall(t)) for _, t in _strings(record.messages, record.tools)))

    def keep(self, score: float) -> bool:
        return score == 0

    def reason(self, record, score: float) -> str:
        where, text = next((w, t) for w, t in _strings(record.messages, record.tools) if CONTROL_CHARS.search(t))
        m = CONTROL_CHARS.search(text)
        return (f"{int(score)} control character(s), first U+{ord(m.group()):04X} in {where} at char {m.start()}: "
                f"C0 controls other than tab/newline/CR are not prompt text (remove control_chars from select.filters "
                f"to keep them)")


class ImageOnlyFilter(Filter):
    name = "image_only"

    def __init__(self, drop_any_image: bool = False):
        self.drop_any_image = drop_any_image

    @classmethod
    def from_config(cls, cfg):
        return cls(cfg.drop_prompts_with_images)

    @staticmethod
    def _parts(m):
        c = m.get("content")
        return c if isinstance(c, list) else []

    def score(self, record) -> float:
        for m in record.messages:
            if m.get("role") != "user":
                continue
            images = [p for p in self._parts(m) if p.get("type") == "image_url"]
            if not images:
                continue
            texts = [p for p in self._parts(m) if p.get("type") == "text" and (p.get("text") or "").strip()]
            if self.drop_any_image or not texts:
                return 1.0
        return 0.0

    def keep(self, score: float) -> bool:
        return score == 0

    def reason(self, record, score: float) -> str:
        if self.drop_any_image:
            return "prompt holds images and the profile sets drop_prompts_with_images (text-only target)"
        return "a user message holds only images (no text): the target cannot be asked to answer it"


def tool_problems(tools, messages) -> list[str]:
    """Problems in OpenAI function tools and in the tool calls that use them (empty list when valid)."""
    problems: list[str] = []
    names = set()
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            problems.append(f"tools[{i}] is not {{type: function, function: {{...}}}}")
            continue
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            problems.append(f"tools[{i}].function.name {name!r} must match [A-Za-z0-9_-]{{1,64}}")
        elif name in names:
            problems.append(f"tools[{i}].function.name {name!r} is declared twice")
        names.add(name)
        if "description" in fn and not isinstance(fn["description"], (str, type(None))):
            problems.append(f"tools[{i}].function.description must be a string")
        params = fn.get("parameters")
        if params is None:
            continue
        if not isinstance(params, dict):
            problems.append(f"tools[{i}].function.parameters must be a JSON Schema object")
            continue
        if params.get("type", "object") != "object":
            problems.append(f"tools[{i}].function.parameters.type is {params.get('type')!r}, expected 'object'")
        problems.extend(_schema_problems(params, f"tools[{i}].function.parameters"))
    for m in messages:
        for c in m.get("tool_calls") or []:
            fname = c["function"]["name"]
            if tools and fname not in names:
                problems.append(f"tool call to {fname!r} which is not among the declared tools")
            args = c["function"].get("arguments")
            try:
                if not isinstance(json.loads(args or "{}"), dict):
                    problems.append(f"tool call {fname!r} arguments are not a JSON object")
            except (json.JSONDecodeError, TypeError):
                problems.append(f"tool call {fname!r} arguments are not valid JSON")
    return problems


def _schema_problems(node, where: str, depth: int = 0) -> list[str]:
    if depth > 32 or not isinstance(node, dict):
        return [] if isinstance(node, dict) else [f"{where} is not an object"]
    out = []
    t = node.get("type")
    types = t if isinstance(t, list) else [t] if t is not None else []
    for x in types:
        if x not in JSON_TYPES:
            out.append(f"{where}.type {x!r} is not a JSON Schema type")
    props = node.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            out.append(f"{where}.properties must be an object")
        else:
            for k, v in props.items():
                out.extend(_schema_problems(v, f"{where}.properties.{k}", depth + 1))
    if "required" in node:
        req = node["required"]
        if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
            out.append(f"{where}.required must be a list of names")
        elif isinstance(props, dict):
            missing = [r for r in req if r not in props]
            if missing:
                out.append(f"{where}.required names {missing} not in properties")
    if isinstance(node.get("items"), dict):
        out.extend(_schema_problems(node["items"], f"{where}.items", depth + 1))
    return out


class ToolSchemaFilter(Filter):
    name = "tool_schema"

    @classmethod
    def from_config(cls, cfg):
        return cls()

    def score(self, record) -> float:
        if not record.tools and not any(m.get("tool_calls") for m in record.messages):
            return 0.0
        return float(len(tool_problems(record.tools, record.messages)))

    def keep(self, score: float) -> bool:
        return score == 0

    def reason(self, record, score: float) -> str:
        problems = tool_problems(record.tools, record.messages)
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return f"malformed tool schema: {problems[0]}{more}"


def prompt_tokens(record) -> int:
    """Estimated tokens of all message text plus the tools' JSON (see `filters.text.estimate_tokens`)."""
    text = message_text(record.messages, roles=("system", "user", "assistant", "tool"))
    n = estimate_tokens(text)
    if record.tools:
        n += estimate_tokens(json.dumps(record.tools, ensure_ascii=False))
    return n


class TokenBudgetFilter(Filter):
    name = "token_budget"

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens

    @classmethod
    def from_config(cls, cfg):
        return cls(cfg.max_prompt_tokens)

    def score(self, record) -> float:
        n = getattr(record, "num_prompt_tokens", None)
        return float(n if n is not None else prompt_tokens(record))

    def keep(self, score: float) -> bool:
        return score <= self.max_tokens

    def reason(self, record, score: float) -> str:
        return f"prompt is about {int(score)} tokens (estimate), over the budget of {self.max_tokens}"


class ContaminationIndex:
    """Benchmark prompts as normalized-text hashes and word n-gram hashes (n = `ngram`)."""

    def __init__(self, texts: list[str], ngram: int = 13):
        self.ngram = ngram
        self.exact: set[int] = set()
        self.grams: set[int] = set()
        for t in texts:
            norm = normalize_text(t)
            if norm:
                self.exact.add(text_hash(norm))
                self.grams.update(self._grams(norm))

    def _grams(self, norm: str) -> set[int]:
        words = _WORD.findall(norm)
        n = self.ngram
        return {text_hash(" ".join(words[i : i + n])) for i in range(len(words) - n + 1)}

    def overlap(self, user_texts: list[str]) -> float:
        """1.0 when a user message equals a benchmark prompt (normalized); else the n-gram overlap share."""
        grams: set[int] = set()
        for t in user_texts:
            norm = normalize_text(t)
            if norm and text_hash(norm) in self.exact:
                return 1.0
            grams |= self._grams(norm)
        if not grams:
            return 0.0
        return len(grams & self.grams) / len(grams)


class ContaminationFilter(Filter):
    name = "contamination"

    def __init__(self, index: ContaminationIndex | None, max_overlap: float = 0.5):
        self.index = index
        self.max_overlap = max_overlap

    @classmethod
    def from_config(cls, cfg, index: ContaminationIndex | None = None):
        return cls(index, cfg.contamination_overlap)

    def score(self, record) -> float:
        if self.index is None:
            return 0.0
        texts = [m["content"] for m in record.messages if m.get("role") == "user" and isinstance(m.get("content"), str)]
        return self.index.overlap(texts)

    def keep(self, score: float) -> bool:
        return score < self.max_overlap

    def reason(self, record, score: float) -> str:
        if score >= 1.0:
            return "prompt matches a benchmark prompt of the contamination list (normalized text)"
        return (f"{score:.0%} of the prompt's {self.index.ngram}-word n-grams occur in the contamination list "
                f"(limit {self.max_overlap:.0%})")


def conversation_text(record) -> str:
    """Normalized role-tagged text of every message (image URLs included) plus the tool names, one line per
    message: what exact and near dedup compare. Cached in `record.extra["norm"]` when the record has `extra`."""
    cache = getattr(record, "extra", None)
    if cache is not None and "norm" in cache:
        return cache["norm"]
    parts = []
    for m in record.messages:
        c = m.get("content")
        images = [p.get("image_url", {}).get("url", "") for p in c if p.get("type") == "image_url"] if isinstance(c, list) else []
        text = normalize_text(message_text([m], roles=(m.get("role"),)) + " " + " ".join(images))
        parts.append(f"{m.get('role')}:{text}")
    names = sorted(t["function"].get("name") or "" for t in record.tools or [] if isinstance(t.get("function"), dict))
    out = "\n".join(parts) + ("\ntools:" + ",".join(names) if names else "")
    if cache is not None:
        cache["norm"] = out
    return out


def dedup_key(record) -> int:
    """64-bit hash of `conversation_text(record)`."""
    return text_hash(conversation_text(record))


class ExactDedupFilter(Filter):
    """Stateful: the first prompt with a key is kept, later ones are dropped naming it (stream order)."""

    name = "exact_dedup"

    def __init__(self):
        self.seen: dict[int, str] = {}
        self._last: str | None = None

    @classmethod
    def from_config(cls, cfg):
        return cls()

    def score(self, record) -> float:
        key = dedup_key(record)
        first = self.seen.get(key)
        if first is None:
            self.seen[key] = record.prompt_id
            return 0.0
        self._last = first
        return 1.0

    def keep(self, score: float) -> bool:
        return score == 0

    def reason(self, record, score: float) -> str:
        return f"exact duplicate (normalized text) of prompt {self._last}"


class NearDedupFilter(Filter):
    """Decisions precomputed over the whole pool by `filters.dedup.near_duplicates`; looked up by prompt_id."""

    name = "near_dedup"

    def __init__(self, threshold: float = 0.8):
        self.threshold = threshold
        self.matches: dict[str, tuple[str, float]] = {}

    @classmethod
    def from_config(cls, cfg):
        return cls(cfg.near_dup_threshold)

    def score(self, record) -> float:
        m = self.matches.get(record.prompt_id)
        return m[1] if m else 0.0

    def keep(self, score: float) -> bool:
        return score < self.threshold

    def reason(self, record, score: float) -> str:
        other = self.matches[record.prompt_id][0]
        return f"near duplicate of prompt {other} (estimated Jaccard {score:.2f} >= {self.threshold:.2f}, MinHash LSH)"


PROMPT_FILTERS: dict[str, type[Filter]] = {
    "empty": EmptyFilter,
    "control_chars": ControlCharsFilter,
    "image_only": ImageOnlyFilter,
    "tool_schema": ToolSchemaFilter,
    "token_budget": TokenBudgetFilter,
    "contamination": ContaminationFilter,
    "exact_dedup": ExactDedupFilter,
    "near_dedup": NearDedupFilter,
}
