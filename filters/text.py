"""Text helpers shared by the prompt filters: message text, normalization, token estimate.

Token estimate (no tokenizer is available offline for the target): ASCII characters count 1/4 token each
(the usual ~4 characters per token of BPE vocabularies on English and code), every non-ASCII character
counts as one token (CJK runs about 1-1.5 characters per token, so this over-counts accented Latin text
mildly, which is the safe side for a budget). Tools count by their canonical JSON.
"""
from __future__ import annotations

import hashlib
import re
import unicodedata

_WS = re.compile(r"\s+")


def message_text(messages: list[dict], roles=("system", "user")) -> str:
    """Concatenated text of the messages with `roles` (content parts' text included), newline-joined."""
    out = []
    for m in messages:
        if m.get("role") not in roles:
            continue
        c = m.get("content")
        if isinstance(c, str):
            out.append(c)
        elif isinstance(c, list):
            out.extend(p.get("text") or "" for p in c if isinstance(p, dict) and p.get("type") == "text")
    return "\n".join(out)


def normalize_text(text: str) -> str:
    """NFKC, lowercase, whitespace runs -> one space, stripped: the form exact dedup compares."""
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


def text_hash(text: str) -> int:
    """64-bit blake2b of the UTF-8 text (stable across processes, unlike hash())."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def estimate_tokens(text: str) -> int:
    """Estimated token count: ceil(ascii_chars / 4) + non_ascii_chars (see module docstring)."""
    n = len(text)
    if text.isascii():
        return (n + 3) // 4
    non_ascii = n - len(text.encode("ascii", "ignore"))
    return (n - non_ascii + 3) // 4 + non_ascii
