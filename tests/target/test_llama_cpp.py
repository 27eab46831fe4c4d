"""The llama.cpp engine of the embedded target (regen.target.llama_cpp): identity, fallback, and one real server on
loopback whose prompt token ids equal the renderer's."""
from __future__ import annotations

import json
import re

import httpx
import psutil
import pytest

from regen.config.generate import GenerateConfig
from regen.config.serve import ServeConfig
from regen.errors import InputError
from regen.generate.conversation import request_config, request_key
from regen.generate.stage import check_identity, config_hash
from regen.target import llama_cpp, server
from regen.target.server import EmbeddedTarget, engine_identity, resolve_engine, served_generate, server_command

LLAMA = ServeConfig(engine="llama.cpp", parallel=4, ctx_per_slot=2048)


def test_identity_names_engine_version_and_weights():
    ident = engine_identity(LLAMA)
    assert ident["engine"] == "llama.cpp" and ident["weights"] == "engine-q8_0.gguf"
    assert ident["version"] == f"xllamacpp {llama_cpp.version()}"
    hf = engine_identity(ServeConfig(engine="transformers"))
    assert hf["engine"] == "transformers serve" and hf["weights"] == "model.safetensors"


def test_the_engine_is_part_of_the_request_config_and_key():
    g = GenerateConfig(temperature=0.7, top_p=0.9, max_tokens=512)
    a, b = served_generate(g, LLAMA), served_generate(g, ServeConfig(engine="transformers"))
    assert a.model == b.model == "smollm2-135m"
    assert request_config(a)["served_by"]["engine"] == "llama.cpp"
    assert config_hash(a) != config_hash(b)
    msgs = [{"role": "user", "content": "hi"}]
    assert request_key("p", 0, a, msgs, None) != request_key("p", 0, b, msgs, None)
    assert "served_by" not in request_config(g)  # remote endpoints: hashes as before


def test_a_run_generated_by_one_engine_is_refused_by_the_other(tmp_path):
    g = GenerateConfig(temperature=0.7, top_p=0.9, max_tokens=512)
    a, b = served_generate(g, LLAMA), served_generate(g, ServeConfig(engine="transformers"))
    (tmp_path / "request_config.json").write_text(json.dumps({"config_hash": config_hash(a),
                                                              "request_config": request_config(a)}))
    assert check_identity(a, tmp_path)
    with pytest.raises(InputError, match="another request config"):
        check_identity(b, tmp_path)


def test_without_the_package_it_falls_back_to_transformers_and_says_so(monkeypatch):
    monkeypatch.setattr(llama_cpp, "version", lambda: None)
    monkeypatch.setattr(server, "_FALLBACK_SAID", set())
    said = []
    assert resolve_engine(LLAMA, said.append) == "transformers"
    assert resolve_engine(LLAMA, said.append) == "transformers"
    assert len(said) == 1 and "xllamacpp" in said[0] and "falling back to transformers serve" in said[0]
    assert engine_identity(LLAMA, said.append)["engine"] == "transformers serve"
    assert resolve_engine(ServeConfig(engine="transformers"), said.append) == "transformers"


@pytest.mark.integration
def test_a_missing_gguf_names_the_fix(tmp_path, model_dir):
    d = tmp_path / "smollm2-135m"
    d.mkdir()
    (d / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(InputError, match="prepare_model --gguf-types q8_0"):
        EmbeddedTarget(LLAMA.model_copy(update={"model_dir": str(d)})).start()


def test_command_line_is_loopback_and_names_the_gguf(tmp_path):
    cmd = server_command(LLAMA, "smollm2-135m", 1234, "llama.cpp", tmp_path / "t.jinja")
    assert cmd[1:3] == ["-m", "regen.target.llama_cpp"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "1234"
    assert cmd[cmd.index("--gguf") + 1].endswith("smollm2-135m/engine-q8_0.gguf")
    assert cmd[cmd.index("--parallel") + 1] == "4" and cmd[cmd.index("--alias") + 1] == "smollm2-135m"


def test_the_served_template_renders_the_renderer_s_text(model_dir):
    """Without its generation tags the template renders the same text (the tags only mark the loss span)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    served = llama_cpp.served_template(model_dir)
    assert "generation" not in re.sub(r"[\"'][^\"']*[\"']", "", served.replace("add_generation_prompt", ""))
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "x"}]
    want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **k: json.dumps(x, ensure_ascii=False)
    assert env.from_string(served).render(messages=msgs, add_generation_prompt=True, tools=None) == want


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with EmbeddedTarget(LLAMA, log_path=log, sampling={"temperature": 0.7, "top_p": 0.9}) as t:
        yield t


@pytest.mark.slow
def test_serves_on_loopback_only_with_the_profile_s_samplers(engine):
    assert engine.engine == "llama.cpp" and engine.model == "smollm2-135m"
    ids = [m["id"] for m in httpx.get(engine.base_url + "/models").json()["data"]]
    assert "smollm2-135m" in ids
    proc = psutil.Process(engine.pid)
    addrs = {c.laddr.ip for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    assert addrs == {"127.0.0.1"}
    props = httpx.get(engine.base_url.removesuffix("/v1") + "/props").json()["default_generation_settings"]
    params = props.get("params", props)
    assert params["top_k"] == 0 and params["min_p"] == 0
    assert params["samplers"] == ["temperature", "top_p"]  # temperature first, as OpenAI/transformers


@pytest.mark.slow
def test_greedy_is_deterministic_and_max_tokens_is_honoured(engine):
    body = {"model": engine.model, "messages": [{"role": "user", "content": "Name three colors."}],
            "max_tokens": 12, "temperature": 0}
    a, b = (httpx.post(engine.base_url + "/chat/completions", json=body, timeout=120).json() for _ in range(2))
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["usage"]["completion_tokens"] <= 12 and a["choices"][0]["finish_reason"] in ("stop", "length")
    assert engine.request_count() >= 3  # the warm-up and these two


@pytest.mark.slow
def test_prompt_token_ids_equal_the_renderer_s_on_bundled_prompts(engine, model_dir):
    """The engine's rendering (its template, its tokenizer) of real prompts, tools included, equals the renderer's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from serve_agreement import prompt_ids_check
    from serve_target import bench_prompts

    from regen.render.hf_template import HFTemplateRenderer

    prompts = bench_prompts(64)
    assert sum(1 for p in prompts if p["tools"]) >= 4
    out = prompt_ids_check(engine.base_url, HFTemplateRenderer(model_dir), prompts)
    assert out["prompt_ids_equal"] == out["prompts"] == len(prompts), out["first_difference"]


@pytest.mark.slow
def test_stop_ends_the_server(model_dir, tmp_path):
    t = EmbeddedTarget(LLAMA, log_path=tmp_path / "s.log").start()
    pid = t.pid
    t.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
def test_the_bench_prints_levels_summary_and_agreement():
    """bench/serve_target.py --quick: figures printed and sane (the goals are judged on full runs, not here)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-P", str(root / "bench" / "serve_target.py"), "--quick"], cwd=root,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    levels = [x for x in lines if "concurrency" in x]
    assert [x["concurrency"] for x in levels] == [1, 4]
    assert all(x["tok_s"] > 0 and x["cpu_s_per_1k_tokens"] > 0 and x["server_rss_mb"] > 0 for x in levels)
    summary = [json.loads(x[8:]) for x in out.stdout.splitlines() if x.startswith("SUMMARY ")]
    assert summary[0]["engines"]["llama.cpp"]["weights"] == "engine-q8_0.gguf"
    agreement = summary[1]["agreement"][0]
    assert agreement["prompt_ids_equal"] == agreement["prompts"] == 16
    assert 0.5 <= agreement["greedy_agreement"] <= 1.0 and agreement["positions"] > 0
