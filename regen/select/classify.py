"""Language and category of a prompt: the source's labels first, then config, then a classifier.

Language: the source's label (normalized to ISO 639-1), else the source's fixed `language`, else
identification on the first 600 characters of the user text: a script fast path (Han without kana -> zh,
kana -> ja, Hangul -> ko, Thai, Devanagari -> hi, ...) and otherwise `py3langid` (langid.py's model,
shipped in the package; Lui & Baldwin 2012). Very short ASCII text (< 4 words) is "en": identification on
a few words is noise.

Category (one of `schemas.prompt.CATEGORIES`): the row's own label (a category name, or mapped by the
source's `category_map`; the row's `source` column is tried the same way), else the source's fixed
`category`, else a heuristic: tools -> tool_use, code fences/keywords -> coding, math/logic cues ->
reasoning, else general. Then the language policy (profile: `language_overrides_category`): Chinese
prompts -> "chinese", other non-English -> "multilingual", except categories listed in
`language_exempt_categories` (tool_use by default).
"""
from __future__ import annotations

import re

from schemas.prompt import CATEGORIES

LANGUAGE_NAMES = {
    "english": "en", "chinese": "zh", "german": "de", "french": "fr", "spanish": "es", "italian": "it",
    "japanese": "ja", "jp": "ja", "dutch": "nl", "portuguese": "pt", "russian": "ru", "korean": "ko",
    "bengali": "bn", "gujarati": "gu", "hindi": "hi", "tamil": "ta", "telugu": "te", "thai": "th",
    "urdu": "ur", "swahili": "sw", "arabic": "ar", "turkish": "tr", "vietnamese": "vi", "polish": "pl",
    "indonesian": "id", "persian": "fa", "ukrainian": "uk", "czech": "cs", "greek": "el", "hebrew": "he",
    "zh-cn": "zh", "zh-tw": "zh", "zh_cn": "zh", "zh-hans": "zh", "zh-hant": "zh", "cn": "zh",
}
# (regex, code) checked in order on the text; the first script with enough characters decides.
SCRIPTS = [
    (re.compile(r"[\u3040-\u30ff]"), "ja"),
    (re.compile(r"[\uac00-\ud7af\u1100-\u11ff]"), "ko"),
    (re.compile(r"[\u4e00-\u9fff\u3400-\u4dbf]"), "zh"),
    (re.compile(r"[\u0e00-\u0e7f]"), "th"),
    (re.compile(r"[\u0980-\u09ff]"), "bn"),
    (re.compile(r"[\u0a80-\u0aff]"), "gu"),
    (re.compile(r"[\u0b80-\u0bff]"), "ta"),
    (re.compile(r"[\u0c00-\u0c7f]"), "te"),
    (re.compile(r"[\u0900-\u097f]"), "hi"),
]
CODE_CUES = re.compile(
    r"```|\bdef \w+\(|\bclass \w+[:(]|#include|\bfunction\s*\w*\(|\bimport \w+|\bSELECT\b.+\bFROM\b|"
    r"\b(python|javascript|typescript|java|c\+\+|rust|golang|sql|regex|bash|html|css|api|compile|bug|"
    r"code|function|script|program|algorithm)\b",
    re.I,
)
MATH_CUES = re.compile(
    r"\$[^$]+\$|\\frac|\\sqrt|\d+\s*[-+*/^=]\s*\d+|\b(solve|prove|calculate|compute|how many|how much|"
    r"probability|equation|integer|sum of|percent|logic|puzzle|deduce|true or false|riddle)\b",
    re.I,
)
_MATH = re.compile(r"\$[^$]*\$|\\[A-Za-z]+")
_NON_LATIN = re.compile(r"[\u0900-\u0e7f\u1100-\u11ff\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")
_LETTER = re.compile(r"[^\W\d_]")
EN_WORDS = frozenset(
    "the a an and or of to in on at for with is are was were be been it this that these those what which who how "
    "why when where can could would should will do does did you your i we they he she his her their my me not no "
    "if then than from by as about into please write give find".split()
)
_identifier = None


def normalize_language(label: str | None) -> str | None:
    """A language label ("German", "de", "zh-CN", "jp") -> ISO 639-1 code, or None when not recognizable."""
    if not label or not isinstance(label, str):
        return None
    s = label.strip().lower()
    if s in LANGUAGE_NAMES:
        return LANGUAGE_NAMES[s]
    s = s.split("-")[0].split("_")[0]
    return s if len(s) == 2 and s.isalpha() else None


def _langid(text: str) -> str:
    global _identifier
    if _identifier is None:
        import py3langid

        py3langid.classify("warm up")
        _identifier = py3langid.classify
    return _identifier(text)[0]


def identify_language(text: str) -> str:
    """ISO 639-1 code of `text` (the first 600 characters are used). Empty text -> "en".

    Fast paths before `py3langid` (which costs ~0.1-1 ms per text): ASCII text with under 4 words, or with at
    least 20% English function words, is "en"; scripts decide CJK and Indic text (see module docstring).
    """
    s = text[:600]
    if not s.strip():
        return "en"
    if not s.isascii() and _NON_LATIN.search(s):
        s = _MATH.sub(" ", s)  # LaTeX letters would outnumber the words of a Chinese exam question
        letters = len(_LETTER.findall(s)) or 1
        for pattern, code in SCRIPTS:
            n = len(pattern.findall(s))
            if n and n / letters >= (0.05 if code in ("ja", "ko") else 0.2):
                return code
    words = s.lower().split()
    if len(words) < 4 and s.isascii():
        return "en"
    if sum(1 for w in words if w in EN_WORDS) >= 0.2 * len(words):
        return "en"
    code = _langid(s[:240])
    return normalize_language(code) or "en"


def heuristic_category(text: str, has_tools: bool) -> str:
    """tools -> tool_use; code cues -> coding; math/logic cues -> reasoning; else general."""
    if has_tools:
        return "tool_use"
    head = text[:4000]
    if CODE_CUES.search(head):
        return "coding"
    if MATH_CUES.search(head):
        return "reasoning"
    return "general"


def label_category(labels: list[str | None], category_map: dict[str, str]) -> str | None:
    """The first label that is a category name or is mapped by `category_map` (exact, then lowercase)."""
    lower = {k.lower(): v for k, v in category_map.items()}
    for label in labels:
        if not isinstance(label, str):
            continue
        if label in category_map:
            return category_map[label]
        if label.lower() in lower:
            return lower[label.lower()]
        if label in CATEGORIES:
            return label
    return None


def apply_language_policy(category: str, language: str, exempt: list[str]) -> str:
    """zh -> chinese, other non-English -> multilingual, unless `category` is exempt."""
    if category in exempt:
        return category
    if language == "zh":
        return "chinese"
    if language != "en":
        return "multilingual"
    return category
