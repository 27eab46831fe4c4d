"""Build `data/pool/`: the first rows of every file of the public prompt sets, in each file's own format, for the
`shared-prompts` profile (every row shape through `regen select`). Run once by a maintainer; outputs committed.

    .venv/bin/python data/pool/build.py PROMPTS_DIR

PROMPTS_DIR is the project's copy of the public prompt sets (the workspace's `shared/data/prompts`). Each data
file keeps its first rows (at most MAX_ROWS, fewer where they pass MAX_BYTES, at least MIN_ROWS; plus EXTRA_ROWS, the only
examples of a reject) at the same relative path: JSON lines stay JSON lines (lines copied byte for byte; BFCL's
`.json` files are JSON lines), headerless TSV stays TSV, JSON lists stay
lists, wrapper objects (BBH, GAOKAO) keep every key, their canary included, with the longest list cut; files of
the BFCL `multi_turn_func_doc/` folder are copied whole (every line is a tool definition the pool's rows name).
SOURCES.md beside this file lists what was kept and carries the sets' provenance and licences verbatim.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAX_ROWS, MIN_ROWS, MAX_BYTES = 20, 2, 10_000
DATA_SUFFIXES = (".jsonl", ".json", ".tsv", ".csv", ".parquet")
# Rows kept beyond the first ones: each is the whole set's only example of a reject (row index in the file).
EXTRA_ROWS = {
    "llamafactory_toolcall/glaive_toolcall_zh_demo.json": [197, 293],  # parse: tool result before any tool call
    "bfcl_v4/BFCL_v4_simple_javascript.json": [23],  # tool_schema: a property of type ''
}

HEAD = """# The prompt-pool sample (`data/pool/`)

The first rows of every data file of the public prompt sets the project was developed on, each in its own format
at its own relative path: the input of the `shared-prompts` profile (`regen select --profile shared-prompts`), which
puts every row shape of every set through the selection stage (tests/select/test_shared_pool.py). Built by
`data/pool/build.py` (its docstring says how rows are kept). **Most of these are public evaluation benchmarks**:
they are pipeline test input; do not train a model that will be scored on them on these prompts or on answers
regenerated from them. BIG-Bench Hard files keep their canary string.

| stored file | rows kept / rows in the set's file | bytes |
|---|---|---|
{TABLE}

Total: {FILES} files, {ROWS:,} rows, {BYTES:,} bytes.

The sets' provenance, licences, personal-data notes and the contamination warning follow verbatim from their
SOURCES.md ("rows kept / original" there is the copy this sample was cut from; `fastchat_vicuna_bench/` and
`oasst_prompt_lottery/` were not in that copy and are not here).

---

"""


def _first(rows: list, extra: list[int], size_of) -> list:
    """The first rows (MIN_ROWS..MAX_ROWS, within MAX_BYTES), then the rows at `extra`, in the file's order."""
    keep, size = [], 0
    for i, r in enumerate(rows):
        n = size_of(r)
        if len(keep) >= MIN_ROWS and (len(keep) >= MAX_ROWS or size + n > MAX_BYTES):
            break
        keep.append(i)
        size += n
    return [rows[i] for i in sorted(set(keep) | set(extra))]


def _cut(src: Path, dst: Path, extra: list[int]) -> tuple[int, int]:
    """Write the first rows of `src` (and those at `extra`) to `dst`; (rows kept, rows in src)."""
    text = src.read_text(encoding="utf-8")
    whole = src.parent.name == "multi_turn_func_doc"
    json_lines = text.lstrip()[:1] == "{" and "\n{" in text and not text.lstrip().startswith("{\n")
    if src.suffix in (".jsonl", ".tsv") or json_lines:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        kept = lines if whole else _first(lines, extra, lambda ln: len(ln.encode()) + 1)
        dst.write_text("\n".join(kept) + "\n", encoding="utf-8")
        return len(kept), len(lines)
    if whole or not text.strip():
        shutil.copyfile(src, dst)
        return len([ln for ln in text.splitlines() if ln.strip()]), len([ln for ln in text.splitlines() if ln.strip()])
    obj = json.loads(text)
    rows = obj if isinstance(obj, list) else obj[max((k for k, v in obj.items() if isinstance(v, list)),
                                                     key=lambda k: len(obj[k]))]
    kept = _first(rows, extra, lambda r: len(json.dumps(r, ensure_ascii=False).encode()))
    if isinstance(obj, list):
        out = kept
    else:
        out = dict(obj)
        out[next(k for k, v in obj.items() if v is rows)] = kept
    dst.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return len(kept), len(rows)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(__doc__, file=sys.stderr)
        return 2
    src_root = Path(argv[0])
    table, rows_total, bytes_total = [], 0, 0
    for src in sorted(src_root.rglob("*")):
        if not src.is_file() or not src.name.lower().endswith(DATA_SUFFIXES):
            continue
        rel = src.relative_to(src_root)
        dst = HERE / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        kept, total = _cut(src, dst, EXTRA_ROWS.get(rel.as_posix(), []))
        size = dst.stat().st_size
        table.append(f"| `{rel.as_posix()}` | {kept} / {total} | {size:,} |")
        rows_total += kept
        bytes_total += size
    sources = (src_root / "SOURCES.md").read_text(encoding="utf-8")
    (HERE / "SOURCES.md").write_text(
        HEAD.replace("{TABLE}", "\n".join(table)).replace("{FILES}", str(len(table)))
        .replace("{ROWS:,}", f"{rows_total:,}").replace("{BYTES:,}", f"{bytes_total:,}") + sources,
        encoding="utf-8")
    print(f"{len(table)} files, {rows_total} rows, {bytes_total} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
