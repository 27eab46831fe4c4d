"""Prompt pools -> batches of raw rows, then normalized prompt drafts (or parse rejects).

A source (`SourceConfig.path`) is a file, a glob, a directory of data files (a Hugging Face Hub snapshot:
parquet / JSON / JSON-lines / TSV files, searched recursively, hidden folders skipped), or a dataset
directory written by `datasets.Dataset.save_to_disk` (each split of a DatasetDict is its own source file).

File formats: Parquet (pyarrow, streamed in batches), JSON (a list of rows, or an object with one list of
row objects such as BBH's `examples`), JSON lines (also under a `.json` name, as BFCL ships them), TSV
without header (MGSM: question, answer; the first column is the prompt), `save_to_disk` directories
(Arrow, via `datasets.load_from_disk`). Rows are read in `batch_rows` batches.

Errors: a missing path or an unrecognized shape raises `InputError` naming the file, the fields seen and
the `fields:` mapping to add; a malformed row becomes a `Draft` with `error` set (filter `parse`).
"""
from __future__ import annotations

import csv
import glob
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from regen.select.classify import apply_language_policy, heuristic_category, identify_language, label_category, normalize_language
from regen.config.select import SelectConfig, SourceConfig
from regen.errors import InputError
from regen.select.shapes import RowError, detect_shape, normalize_row
from filters.text import message_text
from schemas.prompt import prompt_id_of

DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".tsv", ".ndjson")
SKIP_NAMES = {"dataset_info.json", "dataset_infos.json", "state.json", "dataset_dict.json"}


@dataclass
class BadJSON:
    """A JSON-lines row that does not parse; normalization turns it into a `parse` reject."""

    message: str
    text: str


@dataclass
class Draft:
    """One row after normalization: a prompt (messages, tools, category, language) or a parse error."""

    source: str
    source_file: str
    source_row: int
    raw: object = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    category: str | None = None
    language: str | None = None
    prompt_id: str | None = None
    text: str = ""  # user + system text (content parts' text included), for filters and classifiers
    error: str | None = None  # "field: reason" when the row is malformed
    filter: str = "parse"  # the reject's filter name when `error` is set
    extra: dict = field(default_factory=dict)


def source_files(src: SourceConfig) -> list[tuple[str, str]]:
    """`(path, kind)` for every data file of a source, sorted; kind: parquet|json|jsonl|tsv|hf.

    Raises InputError when the path does not exist or holds no data files.
    """
    from regen.config import resolve_path

    raw = src.path
    path = Path(os.path.abspath(resolve_path(raw)))
    if "$" in str(path):
        raise InputError(f"source {src.name!r}: path {raw!r} uses an unset environment variable; "
                         f"export it or pass --source PATH")
    if any(ch in str(path) for ch in "*?["):
        files = sorted(glob.glob(str(path), recursive=True))
        out = [f for p in files for f in _expand(Path(p))]
    elif path.is_dir():
        out = _expand(path)
    elif path.is_file():
        out = [(str(path), _kind(path))]
    else:
        raise InputError(f"source {src.name!r}: {path} does not exist (path {raw!r} in the profile's select.sources)")
    if not out:
        raise InputError(f"source {src.name!r}: no data files ({', '.join(DATA_SUFFIXES)}) under {path}")
    return out


def _kind(path: Path) -> str:
    name = path.name.lower()
    for suffix, kind in ((".parquet", "parquet"), (".jsonl", "jsonl"), (".ndjson", "jsonl"), (".tsv", "tsv")):
        if name.endswith(suffix):
            return kind
    return "json"


def _expand(path: Path) -> list[tuple[str, str]]:
    if path.is_file():
        return [(str(path), _kind(path))] if path.name.lower().endswith(DATA_SUFFIXES) else []
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        return [(str(path), "hf")]
    out = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        r = Path(root)
        if (r / "state.json").exists() and r != path:
            out.append((str(r), "hf"))
            dirs[:] = []
            continue
        for name in sorted(files):
            if name in SKIP_NAMES or name.startswith(".") or not name.lower().endswith(DATA_SUFFIXES):
                continue
            out.append((str(r / name), _kind(r / name)))
    return sorted(out)


def _json_rows(path: str) -> list:
    """Rows of a `.json` file: a list, an object with one list of rows, or JSON lines under a .json name."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":
            return list(_jsonl_lines(text.splitlines()))
        raise InputError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}): fix the file or drop it "
                         f"from the source") from None
    if isinstance(obj, list):
        return obj
    if isinstance(obj, dict):
        lists = [(k, v) for k, v in obj.items() if isinstance(v, list) and v and isinstance(v[0], dict)]
        if lists:
            return max(lists, key=lambda kv: len(kv[1]))[1]
        return [obj]
    return [obj]


def _jsonl_lines(lines) -> Iterator:
    for line in lines:
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as exc:
            yield BadJSON(f"{exc.msg} at char {exc.pos}", line[:200])


def iter_raw_batches(path: str, kind: str, batch_rows: int, fields: dict, max_rows: int | None = None):
    """Yield `(source_file, start_row, rows)` batches of raw rows (dicts, strings or BadJSON)."""
    limit = max_rows if max_rows is not None else sys.maxsize
    if kind == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        start = 0
        for rb in pf.iter_batches(batch_size=batch_rows):
            rows = rb.to_pylist()[: max(0, limit - start)]
            if not rows:
                break
            yield path, start, rows
            start += len(rows)
        return
    if kind == "hf":
        import datasets

        ds = datasets.load_from_disk(path)
        splits = ds.items() if isinstance(ds, datasets.DatasetDict) else [(None, ds)]
        for split, d in splits:
            name = f"{path}#{split}" if split else path
            start = 0
            for table in d.with_format("arrow").iter(batch_size=batch_rows):
                rows = table.to_pylist()[: max(0, limit - start)]
                if not rows:
                    break
                yield name, start, rows
                start += len(rows)
        return
    if kind == "tsv":
        rows = _tsv_rows(path, fields)
    elif kind == "jsonl":
        with open(path, encoding="utf-8") as fh:
            rows = list(_jsonl_lines(fh))
    else:
        rows = _json_rows(path)
    rows = rows[:limit]
    for start in range(0, len(rows), batch_rows):
        yield path, start, rows[start : start + batch_rows]


def _tsv_rows(path: str, fields: dict) -> list[dict]:
    with open(path, encoding="utf-8", newline="") as fh:
        table = list(csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))
    table = [r for r in table if r]
    if fields.get("prompt") and table and fields["prompt"] in table[0]:
        header, body = table[0], table[1:]
        return [dict(zip(header, r)) for r in body]
    return [{"prompt": r[0], **({"answer": r[1]} if len(r) > 1 else {})} for r in table]


def shape_of(path: str, rows: list, fields: dict) -> tuple[str, dict]:
    """The file's shape from its first well-formed row; raises InputError for an unrecognized shape."""
    first = next((r for r in rows if not isinstance(r, BadJSON)), None)
    if first is None:
        return "prompt", {"prompt": "prompt", **fields}
    shape, fmap = detect_shape(first, fields)
    if shape is None:
        seen = sorted(first) if isinstance(first, dict) else [type(first).__name__]
        raise InputError(
            f"{path}: unrecognized row shape; fields seen: {seen}. Map them in the profile's source entry, e.g. "
            f"`fields: {{prompt: {seen[0]!s}}}` for one text field, `fields: {{conversations: COL, role: KEY, "
            f"content: KEY}}` for a chat, `fields: {{messages: COL}}`, `fields: {{turns: COL}}` or "
            f"`fields: {{instruction: COL, input: COL}}` (SourceConfig.fields)"
        )
    return shape, fmap


def benchmark_texts(path: str, batch_rows: int = 20_000) -> list[str]:
    """User-message texts of every prompt in a file or directory (any recognized shape): the contamination
    list. Malformed rows are skipped here (they are benchmark rows, not pool rows)."""
    src = SourceConfig(name="contamination", path=path)
    texts: list[str] = []
    for fpath, kind in source_files(src):
        shape = fmap = None
        cache: dict = {}
        for sfile, _, rows in iter_raw_batches(fpath, kind, batch_rows, {}):
            if shape is None:
                shape, fmap = shape_of(sfile, rows, {})
            if shape == "tool_doc":
                break
            for row in rows:
                try:
                    messages, _, _ = normalize_row(row, shape, fmap, Path(fpath).parent, cache)
                except RowError:
                    continue
                texts.extend(m["content"] for m in messages if m["role"] == "user" and isinstance(m["content"], str))
    return texts


def make_drafts(src: SourceConfig, cfg: SelectConfig, source_file: str, start: int, rows: list, shape: str,
                fmap: dict, cache: dict) -> list[Draft]:
    """Normalize and label one batch of raw rows (see `regen.select.shapes`, `regen.select.classify`)."""
    base_dir = Path(source_file.split("#")[0]).parent
    fixed_lang = normalize_language(src.language)
    drafts = []
    for i, row in enumerate(rows):
        d = Draft(src.name, source_file, start + i, raw=row)
        try:
            if isinstance(row, BadJSON):
                raise RowError("row", f"bad JSON ({row.message})")
            if shape == "tool_doc":
                d.error, d.filter = "row is a tool definition (BFCL multi_turn_func_doc), not a prompt", "not_a_prompt"
                drafts.append(d)
                continue
            messages, tools, labels = normalize_row(row, shape, fmap, base_dir, cache)
        except RowError as exc:
            d.error = f"{exc.field}: {exc.reason}"
            drafts.append(d)
            continue
        d.messages, d.tools = messages, tools
        d.text = message_text(messages)
        user_text = message_text(messages, roles=("user",))
        lang = normalize_language(labels.get("language")) or fixed_lang or identify_language(user_text)
        cat = label_category([labels.get("category"), labels.get("source_label")], src.category_map)
        if cat is None:
            cat = src.category or heuristic_category(d.text, bool(tools))
        if tools and cat != "tool_use" and src.category is None and not labels.get("category"):
            cat = "tool_use"
        if cfg.language_overrides_category:
            cat = apply_language_policy(cat, lang, cfg.language_exempt_categories)
        d.category, d.language = cat, lang
        d.prompt_id = prompt_id_of(messages, tools)
        drafts.append(d)
    return drafts
