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
