"""JSON that refuses duplicate keys, at any depth (a plain parser keeps only the last value, silently).

RFC 8259 §4 leaves duplicate names undefined and Python's `json` keeps the last value: `{"prompt": "first",
"prompt": "second"}` becomes "second" and "first" disappears without a word. A prompt pool row holding one is a
reject naming the key and where it stood (the input policy of docs/select.md, "Input policies"); the same check applies to
JSON documents inside a row (tool-call arguments, a function_call value, content parts, tool schemas).

    loads(text) -> the value; raises DuplicateKey (a ValueError) naming the first duplicated key and its path
    loads_marked(text) -> (value, had_duplicates); duplicate_in(part of value) -> DuplicateKey or None (a
                           whole-file document whose rows are checked one by one)
"""
from __future__ import annotations

import json


class DuplicateKey(ValueError):
    """A JSON object holding the same key twice: `key`, `path` (e.g. `messages[1]`, "" for the top level), and
    the first and last values (the last is what a plain parser keeps)."""

    def __init__(self, key: str, path: str, first, last):
        self.key, self.path, self.first, self.last = key, path, first, last
        where = f"in {path}" if path else "at the top level"
        super().__init__(f"duplicate key {key!r} {where} (values {_short(first)} and {_short(last)}): a JSON parser "
                         "keeps only the last one and the first is lost; keep one key per object")


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


class Marked(dict):
    """A dict parsed from an object that held a duplicate key: `dups` = [(key, first value, last value)]."""

    dups: list


def _hook(found: list):
    def hook(pairs):
        out = {}
        dups = []
        for k, v in pairs:
            if k in out:
                dups.append((k, out[k], v))
            out[k] = v
        if not dups:
            return out
        found.append(True)
        marked = Marked(out)
        marked.dups = dups
        return marked

    return hook


def loads_marked(text: str):
    """`(value, had_duplicates)`: `text` parsed (json.loads errors as usual); objects with duplicate keys come
    back as marked dicts that `duplicate_in` finds."""
    found: list = []
    return json.loads(text, object_pairs_hook=_hook(found)), bool(found)


def duplicate_in(value, path: str = "") -> DuplicateKey | None:
    """The first duplicate key inside a value parsed by `loads_marked` (depth first, in document order), or None."""
    stack = [(value, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, Marked):
            key, first, last = node.dups[0]
            return DuplicateKey(key, where, first, last)
        if isinstance(node, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in reversed(list(node.items())))
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(node))))
    return None


def loads(text: str):
    """`json.loads` that raises DuplicateKey for an object holding a key twice, at any depth."""
    value, had = loads_marked(text)
    if had:
        raise duplicate_in(value)
    return value
