"""Every entry that sends requests checks its endpoints first (they answer, accept the key, list
the model), without asking for what only later stages need: `regen generate`, `regen plan --pilot`, the flow's
generate task. The kimi-k3 profile against the real test server; a server that lists another model gets 0
chat requests."""
from __future__ import annotations

import logging

import pyarrow as pa
import pytest
from conftest import KEY, MODEL, closed_port_url

from regen import cli
from regen.config import load_profile
from regen.generate.endpoints import EndpointsRefused
from regen.preflight import PreflightError
from regen.report.plan import build_plan
from regen.rundir import RunDir
from regen.testing.openai_server import ServerThread, Settings
from schemas.io import write_json_atomic, write_parquet_atomic
from schemas.prompt import PROMPT_SCHEMA, PromptRecord, prompt_id_of


@pytest.fixture
def other_model():
    """A server that answers, accepts the key, but serves another model."""
    srv = ServerThread(Settings(models=["moonshotai/Kimi-K2"], api_key=KEY))
    yield srv
    srv.stop()


def write_prompts(run: RunDir, n: int) -> None:
    records = []
    for i in range(n):
        messages = [{"role": "user", "content": f"question {i}"}]
        records.append(PromptRecord(prompt_id=prompt_id_of(messages, None), messages=messages, tools=None,
                                    category="general", language="en", source="test", source_file="t.jsonl",
                                    source_row=i, num_turns=1))
    table = pa.Table.from_pylist([r.to_arrow_row() for r in records], schema=PROMPT_SCHEMA)
    info = write_parquet_atomic(table, run.prompts / "part-00000.parquet", PROMPT_SCHEMA)
    write_json_atomic({"parts": [info]}, run.prompts / "manifest.json")


def generate_args(run: RunDir, url: str) -> list[str]:
    return ["generate", "--profile", "kimi-k3", "--run", str(run.root), "--endpoint", url, "--no-progress",
            "--max-in-flight", "4", "--set", "generate.max_tokens=16"]


@pytest.mark.integration
def test_regen_generate_refuses_a_server_without_the_model_before_any_request(other_model, k3_env, tmp_path, capsys):
    run = RunDir.at(tmp_path / "run")
    write_prompts(run, 3)
    assert cli.main(generate_args(run, other_model.base_url)) == 2
    err = capsys.readouterr().err
    assert "nothing was requested" in err and "not generate.model 'moonshotai/Kimi-K3'" in err
    assert "Traceback" not in err
    assert other_model.server.log == [] and not list(run.generations.glob("part-*.parquet"))


def test_regen_generate_on_a_generation_only_node_needs_no_tokenizer_nor_target(server, k3_env, monkeypatch,
                                                                                tmp_path, capsys):
    """A node that only generates has neither the render tokenizer nor the target checkpoint: not asked for."""
    monkeypatch.delenv("KIMI_K3_TOKENIZER")
    monkeypatch.delenv("KIMI_K3_MODEL")
    run = RunDir.at(tmp_path / "run")
    write_prompts(run, 3)
    assert cli.main(generate_args(run, server.base_url)) == 0
    assert "generated 3 + error 0 + skipped 0 == 3" in capsys.readouterr().out
    assert len(server.server.log) == 3


def test_regen_generate_refuses_a_wrong_key_and_an_unreachable_endpoint(server, k3_env, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("REGEN_API_KEY", "sk-wrong-key-0000")
    run = RunDir.at(tmp_path / "run")
    write_prompts(run, 2)
    args = generate_args(run, server.base_url) + ["--endpoint", closed_port_url()]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "2 endpoint problem(s)" in err and "HTTP 401" in err and "unreachable" in err
    assert server.server.log == []


@pytest.mark.integration
def test_plan_pilot_refuses_before_its_first_request(other_model, k3_env, tmp_path):
    profile = load_profile("kimi-k3", {"generate.endpoints": [other_model.base_url], "select.total": 24,
                                       "train.enabled": False})
    with pytest.raises(PreflightError) as exc:
        build_plan(profile, RunDir.at(tmp_path / "run"), pilot=4, log=lambda *_: None)
    assert any("not generate.model" in p for p in exc.value.problems)
    assert other_model.server.log == []


@pytest.mark.integration
def test_the_flows_generate_task_checks_before_its_first_request(other_model, k3_env, tmp_path, monkeypatch):
    from flows import regen_flow

    monkeypatch.setattr(regen_flow, "get_run_logger", lambda: logging.getLogger("test-flow"))
    profile = load_profile("kimi-k3", {"generate.endpoints": [other_model.base_url]})
    run = RunDir.at(tmp_path / "run")
    write_prompts(run, 2)
    with pytest.raises(EndpointsRefused, match="not generate.model"):
        regen_flow.generate_task.fn(profile.generate, profile.serve, str(run.root))
    with pytest.raises(EndpointsRefused):  # a rerun that re-sends failed units checks first too
        regen_flow.generate_task.fn(profile.generate, profile.serve, str(run.root), retry_classes=[])
    assert other_model.server.log == []
    assert MODEL == profile.generate.model
