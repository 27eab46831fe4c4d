"""`regen show-render`: stdin conversation -> JSON {text, ids, loss_mask}, --pretty, --tokens, errors."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from regen.cli import main as cli
from regen.render.kimi_k3.test_vocab import build_test_vocab
from regen.render.kimi_k3.tokenizer import load_tokenizer

ROW = {"messages": [{"role": "user", "content": "2+3?"},
                    {"role": "assistant", "reasoning_content": "Add.", "content": "5"}],
       "kwargs": {"add_generation_prompt": False, "thinking_effort": None}}
GENERATED = "Add.<|close|>think<|sep|><|open|>response<|sep|>5<|close|>response<|sep|><|close|>message<|sep|>"


def run(monkeypatch, capsys, payload, *args) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(payload if isinstance(payload, str) else json.dumps(payload)))
    rc = cli(["show-render", "--profile", "kimi-k3", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_json_output_with_the_test_vocabulary(monkeypatch, capsys):
    rc, out, err = run(monkeypatch, capsys, ROW)
    assert rc == 0 and "TEST vocabulary" in err
    got = json.loads(out)
    assert set(got) == {"text", "ids", "loss_mask"}
    assert got["text"] == ('<|open|>message role="user"<|sep|>2+3?<|close|>message<|sep|><|end_of_msg|>'
                           '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>' + GENERATED + "<|end_of_msg|>")
    tok = load_tokenizer(None)
    assert tok.decode(got["ids"]) == got["text"] and len(got["loss_mask"]) == len(got["ids"])
    supervised = [i for i, m in zip(got["ids"], got["loss_mask"]) if m]
    assert tok.decode(supervised) == GENERATED
    assert got["ids"][0] == 163587 and got["ids"][-1] == 163586


def test_kwargs_override_the_profile_template_kwargs(monkeypatch, capsys):
    payload = {"messages": [{"role": "user", "content": "hi"}], "kwargs": {"thinking": True}}
    _, out, _ = run(monkeypatch, capsys, payload, "--set", "render.template_kwargs={thinking: false}")
    assert json.loads(out)["text"].endswith("<|open|>think<|sep|>")
    _, out, _ = run(monkeypatch, capsys, {"messages": payload["messages"]}, "--set",
                    "render.template_kwargs={thinking: false}")
    assert json.loads(out)["text"].endswith("<|open|>response<|sep|>")


def test_pretty_marks_the_supervised_span(monkeypatch, capsys):
    rc, out, _ = run(monkeypatch, capsys, ROW, "--pretty")
    assert rc == 0
    assert "<|open|>think<|sep|>⟦" + GENERATED + "⟧<|end_of_msg|>" in out
    assert "1 span(s)" in out


def test_tokens_lists_every_token(monkeypatch, capsys):
    rc, out, _ = run(monkeypatch, capsys, ROW, "--tokens")
    lines = out.splitlines()
    assert rc == 0 and lines[0].split()[:3] == ["0", "163587", "0"] and json.loads(lines[0].split(None, 3)[3]) == "<|open|>"
    assert sum(int(line.split()[2]) for line in lines) > 0


def test_a_tokenizer_directory_is_used_without_the_note(monkeypatch, capsys, tmp_path):
    src = tmp_path / "c.txt"
    src.write_text("two plus three is five " * 20)
    build_test_vocab([src], tmp_path / "tok", vocab_size=300)
    rc, out, err = run(monkeypatch, capsys, ROW, "--tokenizer", str(tmp_path / "tok"))
    assert rc == 0 and "TEST vocabulary" not in err
    ids = json.loads(out)["ids"]
    assert ids[0] == 163587 and ids != json.loads(run(monkeypatch, capsys, ROW)[1])["ids"]


@pytest.mark.parametrize("payload,args,match", [
    ("not json", (), "stdin is not JSON"),
    ({"msgs": []}, (), '"messages" list'),
    ({"messages": [{"role": "tool", "content": "x"}]}, (), "tool_result_without_call"),
    ({"messages": [{"role": "user", "content": "x"}], "kwargs": {"thinking_effort": "medium"}}, (), "bad_option"),
    (ROW, ("--tokenizer", "/nonexistent/dir"), "not a directory"),
])
def test_errors_exit_2_with_a_message(monkeypatch, capsys, payload, args, match):
    rc, out, err = run(monkeypatch, capsys, payload, *args)
    assert rc == 2 and out == "" and match in err and "Traceback" not in err


@pytest.mark.integration
def test_installed_command(repo_root):
    exe = repo_root / ".venv" / "bin" / "regen"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "regen.cli"]
    proc = subprocess.run([*cmd, "show-render", "--profile", "kimi-k3"], input=json.dumps(ROW), text=True,
                          capture_output=True, timeout=120, cwd=repo_root)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["text"].endswith(GENERATED + "<|end_of_msg|>")


def test_hf_profile_delegates_to_the_hf_renderer(monkeypatch, capsys, gemma_dir):
    payload = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
               "kwargs": {"add_generation_prompt": False}}
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(payload)))
    rc = cli(["show-render", "--profile", "local", "--tokenizer", str(gemma_dir), "--pretty"])
    out = capsys.readouterr()
    assert rc == 0 and "TEST vocabulary" not in out.err
    assert "⟦" in out.out and "hello there" in out.out.split("⟦", 1)[1].split("⟧", 1)[0]


# -- hostile stdin (issue #11 points 6, 14): a clear error, exit 2, no traceback, never replacement characters --

def run_bytes(monkeypatch, capsys, data: bytes, profile: str = "kimi-k3") -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="replace"))
    rc = cli(["show-render", "--profile", profile])
    out = capsys.readouterr()
    return rc, out.out, out.err


U_OK = {"role": "user", "content": "ok"}


@pytest.mark.parametrize("data,match", [
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "byte 0xe9 at line 1, column 47"),
    (b'{"messages": [\n  {"role": "user",\n   "content": "ok \xff\xfe"}]}', "byte 0xff at line 3, column 19"),
    (b'{"messages": [{"role": "user", "content": "ok"}], "tools": [{"name": "\xc3"}]}', "byte 0xc3"),
    (b'{"messages": [], "kwargs": {"thinking_effort": "\xed\xa0\x80"}}', "byte 0xed"),  # UTF-8-encoded surrogate
    (b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', "byte 0xc3"),
])
def test_invalid_utf8_is_an_error_naming_the_place(monkeypatch, capsys, data, match):
    rc, out, err = run_bytes(monkeypatch, capsys, data)
    assert rc == 2 and out == "" and "not valid UTF-8" in err and match in err and "Traceback" not in err


@pytest.mark.parametrize("payload,match", [
    ('{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content holds a lone surrogate \\ud800"),
    ('{"messages": [{"role": "user", "content": "\\udc80"}]}', "lone surrogate \\udc80"),
    ('{"messages": [{"role": "user", "content": "ok"}], "tools": [{"type": "function", "function": {"name": '
     '"f\\udfff"}}]}', "tools[0].function.name holds a lone surrogate"),
    ('{"messages": [{"role": "user", "\\ud800": "x"}]}', "key"),
    ('{"messages": [{"role": "user", "content": "nul\\u0000here"}]}', "messages[0].content holds the control character U+0000"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "esc\\u001b[31m"}]}]}',
     "messages[0].content[0].text holds the control character U+001B"),
    ('{"messages": [{"role": "user", "content": "ok", "name": "a\\u0007"}]}', "messages[0].name holds the control"),
    ('{"messages": [{"role": "user", "content": "del\\u007fhere"}]}', "messages[0].content holds the control character U+007F"),
    ('{"messages": [], "kwargs": {"response_format": {"type": "json_schema", "json_schema": {"x": "\\u0001"}}}}',
     "kwargs.response_format.json_schema.x"),
    ('{"messages": [{"role": "user", "content": "raw\x00nul"}]}', "stdin is not JSON"),
    ('{"messages": [{"role": "user", "content": "ok"}], "kwargs": {"response_format": ' + "[" * 150 + "]" * 150 + "}}",
     "nested deeper than 100 levels"),
    ('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested"),
])
def test_hostile_text_is_an_error_naming_the_json_path(monkeypatch, capsys, payload, match):
    rc, out, err = run(monkeypatch, capsys, payload)
    assert rc == 2 and out == "" and match in err and "Traceback" not in err, err
    rc, out, err = run_bytes(monkeypatch, capsys, payload.encode("utf-8", "surrogatepass"))
    assert rc == 2 and out == "" and match in err and "Traceback" not in err, err


def test_tab_newline_cr_and_non_ascii_pass_unchanged(monkeypatch, capsys):
    content = "tab\there\nline\r\ncafé 漢字 🙂"
    rc, out, err = run_bytes(monkeypatch, capsys, json.dumps({"messages": [{"role": "user", "content": content}]},
                                                              ensure_ascii=False).encode())
    assert rc == 0 and content in json.loads(out)["text"] and "\ufffd" not in out


@pytest.mark.integration
def test_installed_command_refuses_invalid_utf8(repo_root):
    proc = subprocess.run([sys.executable, "-m", "regen.cli", "show-render", "--profile", "kimi-k3"],
                          input=b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', capture_output=True,
                          timeout=120, cwd=repo_root)
    assert proc.returncode == 2 and proc.stdout == b"" and b"not valid UTF-8: byte 0xe9" in proc.stderr
    assert b"Traceback" not in proc.stderr


def test_what_the_reference_renders_is_shown_with_the_reasons_a_row_would_be_rejected(monkeypatch, capsys):
    """Issue #11 point 5: a tool result whose tool_call_id matches no call, after a user turn, renders as the
    reference does (its own name, the next index) and stderr says why the render stage would reject it."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    payload = {"messages": [U_OK, {"role": "assistant", "content": "", "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "c1", "content": "5"}, U_OK,
                            {"role": "tool", "tool_call_id": "zz", "name": "g", "content": "6"}],
               "kwargs": {"thinking_effort": None, "add_generation_prompt": False}}
    rc, out, err = run(monkeypatch, capsys, payload)
    assert rc == 0
    assert json.loads(out)["text"].endswith('<|open|>message role="tool" tool="g" index="2"<|sep|>6<|close|>message'
                                            "<|sep|><|end_of_msg|>")
    assert "tool_result_without_call" in err and "messages[4]" in err
