"""Two bad inputs a new user meets: a prompt field of the wrong type, and a text file that starts with a UTF-8
byte-order mark. The first is a `parse` reject naming the field, the type found and the type expected (never
"unrecognized shape" for a field the row has); the second is read as pandas and `datasets` read it, with a note
in the manifest. Each is held for every source format that can carry it."""
from __future__ import annotations

import csv
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from regen.cli import main as cli_main
from regen.config.select import SelectConfig, SourceConfig
from regen.errors import InputError
from regen.report.query import query
from regen.rundir import RunDir
from regen.select.sources import BOM_NOTE
from regen.select.stage import run_select

GOOD = ["Why is the sky blue?", "Write a haiku about autumn leaves.", "How do I reverse a list in Python?"]
BOM = b"\xef\xbb\xbf"
PROMPT_TEXT = "a string (the prompt text)"
TURNS = "a list of turns ({role, content} or {from, value} objects)"
# a wrong value of each JSON type, and how the reason names it
WRONG = [(12345, "a number (12345)"), (2.5, "a number (2.5)"), (True, "a boolean (true)"),
         (["a", "b"], 'a list (["a", "b"])'), (None, "null"), ({"text": "hi"}, 'an object ({"text": "hi"})')]


def _select(tmp_path, path, name="run", **src):
    run = RunDir.at(tmp_path / name)
    cfg = SelectConfig(sources=[SourceConfig(name="s", path=str(path), **src)], total=50, workers=1)
    return run, run_select(cfg, run, seed=0, progress=False)


def _rejects(run) -> dict:
    rows = query(run.root, "SELECT source_file, source_row, filter, reason FROM rejected ORDER BY source_row")[1]
    return {r[1]: (r[0], r[2], r[3]) for r in rows}


def _prompts(run) -> list[str]:
    return [r[0] for r in query(run.root, "SELECT messages[1].content FROM prompts ORDER BY source_row")[1]]


def _write(path, rows, fmt: str, bom: bool = False) -> None:
    """`rows` (dicts) as a `fmt` file: jsonl, json (a list), json-lines (JSON lines under a .json name), csv
    (header from the first row), tsv (headerless: the first value of each row)."""
    if fmt == "jsonl" or fmt == "json-lines":
        text = "".join(json.dumps(r) + "\n" for r in rows)
    elif fmt == "json":
        text = json.dumps(rows, indent=2)
    elif fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
        text = buf.getvalue()
    else:
        text = "".join("\t".join(str(v) for v in r.values()) + "\n" for r in rows)
    path.write_bytes((BOM if bom else b"") + text.encode("utf-8"))


SUFFIX = {"jsonl": "jsonl", "json": "json", "json-lines": "json", "csv": "csv", "tsv": "tsv"}


# ------------------------------------------------------------------------------------ wrong-type prompt field


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
@pytest.mark.parametrize("value,found", WRONG, ids=[type(v).__name__ for v, _ in WRONG])
def test_a_file_of_wrong_typed_prompts_is_rejects_naming_field_and_types(tmp_path, fmt, value, found):
    # every row wrong: refused before as "unrecognized row shape ... map `fields: {prompt: prompt}`"
    path = tmp_path / f"pool.{fmt}"
    _write(path, [{"prompt": value, "id": i} for i in range(3)], fmt)
    run, m = _select(tmp_path, path)
    rej = _rejects(run)
    assert sorted(rej) == [0, 1, 2]
    for f, filt, why in rej.values():
        assert (f, filt, why) == (str(path), "parse", f"prompt: must be {PROMPT_TEXT}, got {found}")
    assert m["bad_files"] == {} and m["num_prompts"] == 0 and m["filters"]["parse"] == 3
    assert m["accounting"]["files"][str(path)]["shape"] == "prompt"
    assert m["reject_examples"]["parse"] == {"source_file": str(path), "source_row": 0,
                                            "reason": f"prompt: must be {PROMPT_TEXT}, got {found}"}


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
@pytest.mark.parametrize("value,found", WRONG, ids=[type(v).__name__ for v, _ in WRONG])
def test_a_wrong_typed_prompt_among_good_rows_is_one_reject(tmp_path, fmt, value, found):
    rows = [{"prompt": GOOD[0]}, {"prompt": value}, {"prompt": GOOD[1]}, {"prompt": GOOD[2]}]
    path = tmp_path / f"pool.{fmt}"
    _write(path, rows, fmt)
    run, m = _select(tmp_path, path)
    assert _rejects(run) == {1: (str(path), "parse", f"prompt: must be {PROMPT_TEXT}, got {found}")}
    assert sorted(_prompts(run)) == sorted(GOOD)
    t = m["accounting"]["totals"]
    assert t["input_rows"] == 4 == t["selected"] + t["rejected"] + t["not_selected"] and t["rejected"] == 1


# every prompt-carrying field the shape detector knows, with a value of the wrong type; the row alone in its file
FIELD_CASES = [
    ({"question": 7, "answer": "7"}, f"question: must be {PROMPT_TEXT}, got a number (7)"),
    ({"problem": None, "solution": "x"}, f"problem: must be {PROMPT_TEXT}, got null"),
    ({"problem_statement": ["a"]}, f'problem_statement: must be {PROMPT_TEXT}, got a list (["a"])'),
    ({"query": {"q": 1}}, f'query: must be {PROMPT_TEXT}, got an object ({{"q": 1}})'),
    ({"text": False}, f"text: must be {PROMPT_TEXT}, got a boolean (false)"),
    ({"input": 3}, f"input: must be {PROMPT_TEXT}, got a number (3)"),
    ({"content": None}, f"content: must be {PROMPT_TEXT}, got null"),
    ({"instruction": 5, "output": "x"}, f"instruction: must be {PROMPT_TEXT}, got a number (5)"),
    ({"instruction": None}, f"instruction: must be {PROMPT_TEXT}, got null"),
    ({"instruction": "Add", "input": 5}, "input: must be a string, got a number (5)"),
    ({"messages": "hello"}, f'messages: must be {TURNS}, got a string ("hello")'),
    ({"messages": None}, f"messages: must be {TURNS}, got null"),
    ({"messages": {"role": "user", "content": "hi"}}, f'messages: must be {TURNS}, got an object ({{"role": "user", '),
    ({"messages": 12345}, f"messages: must be {TURNS}, got a number (12345)"),
    ({"messages": [{"role": "user", "content": 12345}]},
     "messages[0].content: must be a string or a list of content parts, got a number (12345)"),
    ({"conversations": "hello"}, f'conversations: must be {TURNS}, got a string ("hello")'),
    ({"conversations": None}, f"conversations: must be {TURNS}, got null"),
    ({"conversations": [{"from": "human", "value": {"text": "hi"}}]},
     'conversations[0].value: must be a string or a list of content parts, got an object ({"text": "hi"})'),
    ({"turns": "hello"}, 'turns: must be a list of user turns (strings or {content: string} objects), got a string'),
    ({"turns": None}, "turns: must be a list of user turns (strings or {content: string} objects), got null"),
    ({"turns": [12345]}, "turns[0]: must be a string or {content: string}, got a number (12345)"),
    ({"turns": [{"content": None}]}, "turns[0].content: must be a string (the user turn's text), got null"),
]


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
@pytest.mark.parametrize("row,reason", FIELD_CASES, ids=[json.dumps(r)[:40] for r, _ in FIELD_CASES])
def test_each_prompt_field_of_the_wrong_type_is_named(tmp_path, fmt, row, reason):
    path = tmp_path / f"pool.{fmt}"
    _write(path, [row], fmt)
    run, m = _select(tmp_path, path)
    ((f, filt, why),) = _rejects(run).values()
    assert f == str(path) and filt == "parse" and why.startswith(reason), why
    assert m["bad_files"] == {} and m["accounting"]["totals"]["rejected"] == 1


def test_a_row_with_no_known_field_still_names_the_fields_it_has(tmp_path):
    path = tmp_path / "odd.jsonl"
    _write(path, [{"dialog_text": 12345, "speaker": 1}], "jsonl")
    with pytest.raises(InputError, match=r"unrecognized row shape; fields seen: \['dialog_text', 'speaker'\]"):
        _select(tmp_path, path)


def test_a_recognized_shape_wins_the_vote_over_wrong_types(tmp_path):
    # two rows carry `prompt` with the wrong type, three carry `text` as text: the text rows decide the shape
    rows = [{"prompt": 1}, {"prompt": 2}] + [{"text": t} for t in GOOD]
    path = tmp_path / "pool.jsonl"
    _write(path, rows, "jsonl")
    run, m = _select(tmp_path, path)
    assert sorted(_prompts(run)) == sorted(GOOD) and sorted(_rejects(run)) == [0, 1]


@pytest.mark.parametrize("value,found", [(12345, "a number (12345)"), (["a", "b"], 'a list (["a", "b"])'),
                                         (None, "null"), ({"text": "hi"}, 'an object ({"text": "hi"})')])
def test_parquet_columns_of_the_wrong_type(tmp_path, value, found):
    path = tmp_path / "pool.parquet"
    pq.write_table(pa.table({"prompt": pa.array([value, value])}), path)
    run, m = _select(tmp_path, path)
    assert _rejects(run) == {i: (str(path), "parse", f"prompt: must be {PROMPT_TEXT}, got {found}") for i in (0, 1)}


def test_csv_cells_are_text_so_a_list_column_is_named_as_a_string(tmp_path):
    # CSV has no types: a number is the prompt's text, and a JSON list written in a `messages` cell is a string
    (tmp_path / "n.csv").write_text("prompt,id\n12345,1\n")
    run, _ = _select(tmp_path, tmp_path / "n.csv")
    assert _prompts(run) == ["12345"]
    _write(tmp_path / "m.csv", [{"messages": json.dumps([{"role": "user", "content": "hi"}]), "id": 1}], "csv")
    run, m = _select(tmp_path, tmp_path / "m.csv", name="run2")
    ((_, filt, why),) = _rejects(run).values()
    assert filt == "parse" and why.startswith(f'messages: must be {TURNS}, got a string ("[{{\\"role\\"'), why


def test_tsv_cells_are_text_so_a_number_is_the_prompts_text(tmp_path):
    (tmp_path / "n.tsv").write_text("12345\t12345\n")
    run, m = _select(tmp_path, tmp_path / "n.tsv")
    assert _prompts(run) == ["12345"] and m["accounting"]["totals"]["rejected"] == 0


# -------------------------------------------------------------------------------------------- byte-order mark


@pytest.mark.parametrize("fmt", ["jsonl", "json", "json-lines", "csv", "tsv"])
def test_a_utf8_byte_order_mark_is_stripped_and_noted(tmp_path, fmt):
    rows = [{"prompt": t, "id": str(i)} for i, t in enumerate(GOOD)]
    plain, marked = tmp_path / f"plain.{SUFFIX[fmt]}", tmp_path / f"marked.{SUFFIX[fmt]}"
    _write(plain, rows, fmt)
    _write(marked, rows, fmt, bom=True)
    assert marked.read_bytes()[:3] == BOM
    run_p, m_p = _select(tmp_path, plain, name="plain")
    run_m, m_m = _select(tmp_path, marked, name="marked")
    # the same prompts, byte for byte (no U+FEFF glued to the first), the same language and category
    cols = "SELECT source_row, prompt_id, messages[1].content, language, category FROM prompts ORDER BY source_row"
    assert query(run_m.root, cols)[1] == query(run_p.root, cols)[1]
    assert _prompts(run_m) == GOOD and m_m["accounting"]["totals"]["rejected"] == 0
    assert m_m["input_notes"] == {str(marked): [BOM_NOTE]} and m_p["input_notes"] == {}


def test_a_byte_order_mark_before_a_header_keeps_the_header(tmp_path):
    # a TSV with a header row (fields: {prompt: COL}) and a CSV whose first column is the prompt
    (tmp_path / "h.tsv").write_bytes(BOM + b"question\tanswer\nWhat is 2+2?\t4\n")
    run, m = _select(tmp_path, tmp_path / "h.tsv", fields={"prompt": "question"})
    assert _prompts(run) == ["What is 2+2?"] and m["accounting"]["totals"]["input_rows"] == 1
    (tmp_path / "h.csv").write_bytes(BOM + b"question,answer\nWhat is 3+3?,6\n")
    run, m = _select(tmp_path, tmp_path / "h.csv", name="run2")
    assert _prompts(run) == ["What is 3+3?"] and m["input_notes"] == {str(tmp_path / "h.csv"): [BOM_NOTE]}


@pytest.mark.parametrize("encoding,name", [("utf-16", "UTF-16"), ("utf-32", "UTF-32")])
def test_a_utf16_or_utf32_file_is_a_bad_file_naming_its_encoding(tmp_path, encoding, name):
    path = tmp_path / "wide.jsonl"
    path.write_bytes(json.dumps({"prompt": GOOD[0]}).encode(encoding))  # Python writes the BOM first
    with pytest.raises(InputError, match=f"starts with a {name} byte-order mark: the file is {name}, not UTF-8"):
        _select(tmp_path, path)


# ------------------------------------------------------------------------------------------ as a user sees it


def _cli(tmp_path, *sources):
    args = ["select", "--profile", "local", "--run", str(tmp_path / "r"), "--no-progress", "--set",
            "select.sources=[]"]
    for s in sources:
        args += ["--source", str(s)]
    return cli_main(args)


def test_cli_names_the_first_reject_and_the_stripped_mark(tmp_path, capsys):
    _write(tmp_path / "types.jsonl", [{"prompt": 12345}, {"prompt": ["a", "b"]}], "jsonl")
    _write(tmp_path / "win.csv", [{"prompt": t} for t in GOOD], "csv", bom=True)
    assert _cli(tmp_path, tmp_path / "types.jsonl", tmp_path / "win.csv") == 0
    cap = capsys.readouterr()
    assert "Traceback" not in cap.out + cap.err and "unrecognized row shape" not in cap.out + cap.err
    assert (f"parse, first of 2: {tmp_path / 'types.jsonl'} row 0: prompt: must be {PROMPT_TEXT}, "
            "got a number (12345)") in cap.out
    assert f"regen query --run {tmp_path / 'r'} \"SELECT source_file, source_row, filter, reason FROM rejected\"" \
        in cap.out
    assert f"note: {tmp_path / 'win.csv'}: {BOM_NOTE}" in cap.out
    assert "input rows 5 = selected 3 + rejected 2 + not selected 0" in cap.out


def test_cli_refuses_a_utf16_file_without_a_traceback(tmp_path, capsys):
    (tmp_path / "wide.json").write_bytes(json.dumps([{"prompt": GOOD[0]}]).encode("utf-16"))
    assert _cli(tmp_path, tmp_path / "wide.json") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{tmp_path / 'wide.json'}: starts with a UTF-16 byte-order mark" in err
    assert "iconv -f UTF-16 -t UTF-8" in err
