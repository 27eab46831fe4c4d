"""Prompt pools -> batches of raw rows, then normalized prompt drafts (or parse rejects).

A source (`SourceConfig.path`) is a file, a glob, a directory of data files (a Hugging Face Hub snapshot:
parquet / JSON / JSON-lines / TSV files, searched recursively, hidden folders skipped), or a dataset
directory written by `datasets.Dataset.save_to_disk` (each split of a DatasetDict is its own source file).

File formats: Parquet (pyarrow, streamed in batches), JSON (a list of rows, or an object with one list of
row objects such as BBH's `examples`), JSON lines (also under a `.json` name, as BFCL ships them), CSV with a
header row (pyarrow.csv; every column a string), TSV without header (MGSM: question, answer; the first column
is the prompt), `save_to_disk` directories (Arrow, via `datasets.load_from_disk`). Rows are read in
`batch_rows` batches. Other file types given by name are refused (`BadFile`).

Input policies (docs/select.md, "Input policies"):
- file level, the same for every format: a file that cannot be read as a whole (not decodable as UTF-8 where
  the whole file is one JSON document, no row that parses, a damaged Parquet or Arrow file, an unsupported
  type, an unrecognized row shape) raises `BadFile` (an InputError naming the file and the reason); the stage
  collects every bad file, then fails or skips them (`select.on_bad_file`, `--on-bad-file`).
- row level: a row that does not decode (invalid UTF-8 in its line), does not parse (bad JSON, nested deeper
  than the parser's limit), holds a lone surrogate (`"\ud800"`, not encodable as UTF-8) or is malformed in its
  shape becomes a `Draft` with `error` set (a reject with filter `parse`, its row index and the reason).
- the shape is detected by a vote over the first `SHAPE_SAMPLE` parsed rows, so one bad row does not decide it.
- a JSON row holding a key twice, at any depth (`{"prompt": "first", "prompt": "second"}`), is a `parse` reject
  naming the key and its path (`regen.select.strict_json`), never read as the last value; a key repeated in a
  JSON document outside its rows, or a column named twice (CSV/TSV header, Parquet or Arrow schema), is a bad
  file.
- text files (JSON, JSON lines, CSV, TSV) may start with a UTF-8 byte-order mark (as Windows tools write them;
  pandas and `datasets` read such files): it is stripped and noted per file (`iter_raw_batches(notes=...)`, the
  manifest's `input_notes`); a UTF-16 or UTF-32 mark makes a bad file (the file is not UTF-8).
A missing path raises `InputError` at once (a config error, not a bad file).
"""
from __future__ import annotations

import csv
import glob
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from filters.text import message_text
from regen.config.select import SelectConfig, SourceConfig
from regen.errors import InputError
from regen.select import strict_json
from regen.select.classify import (
    apply_language_policy,
    heuristic_category,
    identify_language,
    label_category,
    normalize_language,
)
from regen.select.shapes import RowError, detect_shape, mistyped_shape, normalize_row
from schemas.prompt import prompt_id_of

DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".tsv", ".csv", ".ndjson")
SHAPE_SAMPLE = 200  # rows that vote on a file's shape
SKIP_NAMES = {"dataset_info.json", "dataset_infos.json", "state.json", "dataset_dict.json"}
UTF8_BOM = b"\xef\xbb\xbf"
BOM_NOTE = "starts with a UTF-8 byte-order mark (as Windows tools write it): stripped, the file read as UTF-8"
_OTHER_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
               (b"\xfe\xff", "UTF-16"))


class BadFile(InputError):
    """A source file that cannot be read as a whole: `path` and `reason` (the file-level policy)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


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
    tools_inferred: bool = False  # tools inferred from the calls (no declaration in the row)
    original_answers: list[dict] | None = None  # the source's own answers (regen.select.originals)
    original_missing: str | None = None  # why original_answers is None (a reason code)
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
        out = [(str(path), _kind(path) if path.name.lower().endswith(DATA_SUFFIXES) else "unsupported")]
    else:
        raise InputError(f"source {src.name!r}: {path} does not exist (path {raw!r} in the profile's select.sources)")
    if not out:
        raise InputError(f"source {src.name!r}: no data files ({', '.join(DATA_SUFFIXES)}) under {path}")
    return out


def _kind(path: Path) -> str:
    name = path.name.lower()
    for suffix, kind in ((".parquet", "parquet"), (".jsonl", "jsonl"), (".ndjson", "jsonl"), (".tsv", "tsv"),
                         (".csv", "csv")):
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


def _bom(path: str, notes: dict | None) -> int:
    """The length of a UTF-8 byte-order mark at the start of a text file (3, and `BOM_NOTE` appended to
    `notes[path]`), else 0. Raises BadFile for a UTF-16 or UTF-32 mark: the file is not UTF-8."""
    with open(path, "rb") as fh:
        head = fh.read(4)
    for mark, enc in _OTHER_BOMS:
        if head.startswith(mark):
            raise BadFile(path, f"starts with a {enc} byte-order mark: the file is {enc}, not UTF-8; re-encode it "
                                f"as UTF-8 (e.g. `iconv -f {enc} -t UTF-8`)")
    if not head.startswith(UTF8_BOM):
        return 0
    if notes is not None:
        notes.setdefault(path, []).append(BOM_NOTE)
    return len(UTF8_BOM)


def _json_rows(path: str, skip: int = 0) -> list:
    """Rows of a `.json` file (its first `skip` bytes, a byte-order mark, left out): a list, an object with one
    list of rows, or JSON lines under a .json name.

    Raises BadFile when the document is not UTF-8 or not JSON and no line of it is a JSON row either.
    """
    with open(path, "rb") as fh:
        fh.seek(skip)
        data = fh.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        rows = _jsonl_lines(data.splitlines())
        if any(not isinstance(r, BadJSON) for r in rows):
            return rows
        line = data.count(b"\n", 0, exc.start) + 1
        raise BadFile(path, f"not valid UTF-8 (byte 0x{data[exc.start]:02x} at line {line}, byte offset "
                            f"{exc.start + skip}): re-encode the file as UTF-8") from None
    try:
        obj, had_duplicates = strict_json.loads_marked(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        rows = _jsonl_lines(text.splitlines())
        if any(not isinstance(r, BadJSON) for r in rows):
            return rows  # JSON lines under a .json name: bad lines are rejected row by row
        what = (f"{exc.msg} at line {exc.lineno}" if isinstance(exc, json.JSONDecodeError)
                else "nested deeper than the JSON parser's limit")
        raise BadFile(path, f"not valid JSON ({what}), and no line of it is a JSON row: fix the file or drop it "
                            f"from the source") from None
    rows = obj if isinstance(obj, list) else [obj]
    if isinstance(obj, dict):
        lists = [(k, v) for k, v in obj.items() if isinstance(v, list) and v and isinstance(v[0], dict)]
        if lists:
            key, rows = max(lists, key=lambda kv: len(kv[1]))
            if had_duplicates:  # a key repeated outside the rows (the document's own keys) spoils the whole file
                outside = strict_json.duplicate_in({k: v for k, v in obj.items() if k != key}) \
                    or (strict_json.duplicate_in(obj) if isinstance(obj, strict_json.Marked) else None)
                if outside is not None:
                    raise BadFile(path, f"{outside}: fix the file")
    if not had_duplicates:
        return rows
    return [BadJSON(str(dup), json.dumps(r, ensure_ascii=False)[:200]) if (dup := strict_json.duplicate_in(r))
            else r for r in rows]


def _jsonl_lines(lines) -> list:
    """Parsed rows of JSON lines (str or bytes); a line that does not decode or parse is a BadJSON row."""
    out = []
    for line in lines:
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                out.append(BadJSON(f"not valid UTF-8 (byte 0x{line[exc.start]:02x} at byte {exc.start} of the line)",
                                   line[:200].decode("utf-8", "backslashreplace")))
                continue
        if not line.strip():
            continue
        try:
            out.append(strict_json.loads(line))
        except strict_json.DuplicateKey as exc:
            out.append(BadJSON(str(exc), line[:200]))
        except json.JSONDecodeError as exc:
            out.append(BadJSON(f"{exc.msg} at char {exc.pos}", line[:200]))
        except RecursionError:
            out.append(BadJSON("nested deeper than the JSON parser's limit", line[:200]))
    return out


def _jsonl_rows(path: str, skip: int = 0) -> list:
    """Rows of a JSON-lines file (its first `skip` bytes, a byte-order mark, left out); BadFile when it has lines
    and none of them is a JSON row."""
    with open(path, "rb") as fh:
        fh.seek(skip)
        rows = _jsonl_lines(fh)
    if rows and all(isinstance(r, BadJSON) for r in rows):
        raise BadFile(path, f"no line is a JSON row (first: {rows[0].message}): not JSON lines; fix the file or "
                            f"drop it from the source")
    return rows


def _csv_rows(path: str) -> list[dict]:
    """Rows of a CSV file with a header row (pyarrow.csv, every column read as a string; pyarrow skips a UTF-8
    byte-order mark itself)."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    try:
        names = pcsv.read_csv(path, read_options=pcsv.ReadOptions(block_size=1 << 20)).column_names
        _unique_columns(path, names, "header")
        table = pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(column_types={n: pa.string() for n in names}))
    except (pa.ArrowInvalid, UnicodeDecodeError) as exc:
        raise BadFile(path, f"not a readable CSV file with a header row ({exc}): fix it or convert it to JSON "
                            f"lines") from None
    return table.to_pylist()


def _unique_columns(path: str, names: list[str], what: str) -> None:
    """BadFile for a column name given twice (a row dict would keep only the last column, silently)."""
    seen: dict[str, int] = {}
    for i, n in enumerate(names):
        if n in seen:
            raise BadFile(path, f"duplicate column {n!r} in the {what} (columns {seen[n] + 1} and {i + 1}): each row "
                                "would keep only the last column's value; rename one of them")
        seen[n] = i


def _unique_fields(path: str, schema) -> None:
    """BadFile for an Arrow schema (Parquet, save_to_disk) naming a field twice, at any depth of its structs."""
    import pyarrow as pa

    stack = [("", list(schema))]
    while stack:
        where, fields = stack.pop()
        _unique_columns(path, [f.name for f in fields], f"schema{' of ' + where if where else ''}")
        for f in fields:
            t = f.type
            while pa.types.is_list(t) or pa.types.is_large_list(t):
                t = t.value_type
            if pa.types.is_struct(t):
                stack.append((f"{where}.{f.name}" if where else f.name, [t.field(i) for i in range(t.num_fields)]))


def iter_raw_batches(path: str, kind: str, batch_rows: int, fields: dict, max_rows: int | None = None,
                     notes: dict | None = None):
    """Yield `(source_file, start_row, rows)` batches of raw rows (dicts, strings or BadJSON).

    `notes`, when given, collects what reading changed, `{path: [note]}` (a stripped UTF-8 byte-order mark:
    `BOM_NOTE`). Raises BadFile for a file that cannot be read as a whole (the module's input policies)."""
    limit = max_rows if max_rows is not None else sys.maxsize
    if kind == "unsupported":
        raise BadFile(path, f"unsupported file type {Path(path).suffix or '(no suffix)'!r}: regen select reads "
                            f"{', '.join(DATA_SUFFIXES)} files and save_to_disk directories; convert it")
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        start = 0
        try:
            pf = pq.ParquetFile(path)
            _unique_fields(path, pf.schema_arrow)
            for rb in pf.iter_batches(batch_size=batch_rows):
                rows = rb.to_pylist()[: max(0, limit - start)]
                if not rows:
                    break
                yield path, start, rows
                start += len(rows)
        except (pa.ArrowException, OSError) as exc:
            raise BadFile(path, f"not a readable Parquet file after {start} rows ({exc})") from None
        return
    if kind == "hf":
        import datasets

        try:
            ds = datasets.load_from_disk(path)
        except Exception as exc:  # datasets raises several types for a damaged directory
            raise BadFile(path, f"not a readable save_to_disk directory ({type(exc).__name__}: {exc})") from None
        splits = ds.items() if isinstance(ds, datasets.DatasetDict) else [(None, ds)]
        for split, d in splits:
            name = f"{path}#{split}" if split else path
            _unique_fields(name, d.data.schema)
            start = 0
            for table in d.with_format("arrow").iter(batch_size=batch_rows):
                rows = table.to_pylist()[: max(0, limit - start)]
                if not rows:
                    break
                yield name, start, rows
                start += len(rows)
        return
    skip = _bom(path, notes)
    if kind == "tsv":
        rows = _tsv_rows(path, fields, skip)
    elif kind == "csv":
        rows = _csv_rows(path)
    elif kind == "jsonl":
        rows = _jsonl_rows(path, skip)
    else:
        rows = _json_rows(path, skip)
    rows = rows[:limit]
    for start in range(0, len(rows), batch_rows):
        yield path, start, rows[start : start + batch_rows]


def _tsv_rows(path: str, fields: dict, skip: int = 0) -> list[dict]:
    """Rows of a TSV file: `{prompt, answer}` from the first two columns, or a dict per row when the first row
    holds the column `fields["prompt"]` (a header). `skip` > 0: the file starts with a UTF-8 byte-order mark."""
    try:
        with open(path, encoding="utf-8-sig" if skip else "utf-8", newline="") as fh:
            table = list(csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))
    except UnicodeDecodeError as exc:
        raise BadFile(path, f"not valid UTF-8 (byte offset {exc.start}): re-encode the file as UTF-8") from None
    table = [r for r in table if r]
    if fields.get("prompt") and table and fields["prompt"] in table[0]:
        header, body = table[0], table[1:]
        _unique_columns(path, header, "header")
        return [dict(zip(header, r)) for r in body]
    return [{"prompt": r[0], **({"answer": r[1]} if len(r) > 1 else {})} for r in table]


def shape_of(path: str, rows: list, fields: dict) -> tuple[str, dict]:
    """The file's shape by a vote of its first `SHAPE_SAMPLE` parsed rows (the most frequent recognized shape,
    ties to the earliest): rows of another shape are then rejected one by one. When no row of the sample has a
    recognized shape, the vote is over the shapes their prompt fields of the wrong type would make
    (`mistyped_shape`: `{"prompt": 12345}` is the prompt shape), so each such row is a `parse` reject naming the
    field, the type found and the type expected. Raises BadFile when no row has either."""
    sample = [r for r in rows[: SHAPE_SAMPLE * 2] if not isinstance(r, BadJSON)][:SHAPE_SAMPLE]
    if not sample:
        return "prompt", {"prompt": "prompt", **fields}
    for detect in (detect_shape, mistyped_shape):  # a recognized shape wins; else a known field of the wrong type
        votes: dict = {}
        for r in sample:
            shape, fmap = detect(r, fields)
            if shape is not None:
                key = (shape, tuple(sorted(fmap.items())))
                votes[key] = votes.get(key, 0) + 1
        if votes:
            shape, fmap = max(votes, key=votes.get)  # dicts keep insertion order: ties go to the earliest
            return shape, dict(fmap)
    first = sample[0]
    seen = sorted(first) if isinstance(first, dict) else [type(first).__name__]
    raise BadFile(
        path,
        f"unrecognized row shape; fields seen: {seen}. Map them in the profile's source entry, e.g. "
        f"`fields: {{prompt: {seen[0]!s}}}` for one text field, `fields: {{conversations: COL, role: KEY, "
        f"content: KEY}}` for a chat, `fields: {{messages: COL}}`, `fields: {{turns: COL}}` or "
        f"`fields: {{instruction: COL, input: COL}}` (SourceConfig.fields)"
    )


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
            messages, tools, labels = normalize_row(row, shape, fmap, base_dir, cache, cfg.infer_tool_schemas)
            _check_encodable(messages, tools)
            if labels.get("original_answers") is not None:
                try:
                    _check_encodable(labels["original_answers"], None)
                except RowError:
                    labels["original_answers"], labels["original_missing"] = None, "answer_not_encodable"
        except RowError as exc:
            d.error = f"{exc.field}: {exc.reason}"
            drafts.append(d)
            continue
        except RecursionError:
            d.error, d.raw = "row: nested deeper than Python's recursion limit", "(too deeply nested to show)"
            drafts.append(d)
            continue
        d.messages, d.tools = messages, tools
        d.tools_inferred = bool(labels.get("tools_inferred"))
        d.original_answers, d.original_missing = labels.get("original_answers"), labels.get("original_missing")
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


def _check_encodable(messages: list[dict], tools) -> None:
    """Raises RowError for a lone surrogate (a JSON `"\\ud800"` escape): such text has no UTF-8 form."""
    for where, value in (("messages", messages), ("tools", tools)):
        text = json.dumps(value, ensure_ascii=False)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RowError(where, f"holds a lone surrogate U+{ord(text[exc.start]):04X} (a \\u escape with no "
                                  f"pair): not encodable as UTF-8") from None
