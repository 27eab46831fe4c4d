"""Preflight: `regen run` and the flow check every stage's configuration first and stop
before any request, listing every problem at once. The kimi-k3 profile against the real test server."""
from __future__ import annotations

import pytest
from conftest import MODEL, closed_port_url

from regen import cli
from regen.config import load_profile
from regen.pipeline import run_pipeline
from regen.preflight import PreflightError, check_profile, preflight
from regen.rundir import RunDir


def profile_for(url: str, **extra):
    return load_profile("kimi-k3", {"generate.endpoints": [url], "select.total": 24, **extra})


def chat_requests(server) -> list:
    return [e for e in server.server.log]  # the server logs chat requests only (never /models)


def test_a_good_configuration_passes(server, k3_env, tmp_path):
    rep = preflight(profile_for(server.base_url), RunDir.at(tmp_path / "run"), log=lambda *_: None)
    assert not rep.problems
    assert any("accept the key" in c for c in rep.checks) and any("kimi-k3 renderer" in c for c in rep.checks)
    assert chat_requests(server) == []


# fault -> (how to make it, a word the problem line must contain)
FAULTS = {
    "tokenizer_env_unset": (lambda mp, env: mp.delenv("KIMI_K3_TOKENIZER"), "render.tokenizer"),
    "tokenizer_dir_missing": (lambda mp, env: mp.setenv("KIMI_K3_TOKENIZER", env["KIMI_K3_MODEL"] + "-nope"),
                              "render.tokenizer"),
    "model_env_unset": (lambda mp, env: mp.delenv("KIMI_K3_MODEL"), "train.target"),
    "model_dir_missing": (lambda mp, env: mp.setenv("KIMI_K3_MODEL", env["KIMI_K3_MODEL"] + "-nope"), "train.target"),
    "wrong_key": (lambda mp, env: mp.setenv("REGEN_API_KEY", "sk-wrong"), "API key was rejected (HTTP 401"),
    "key_unset": (lambda mp, env: mp.delenv("REGEN_API_KEY"), "REGEN_API_KEY"),
    "pool_unset": (lambda mp, env: mp.delenv("KIMI_MTP_DATASET"), "KIMI_MTP_DATASET"),
}


@pytest.mark.integration
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_fault_stops_the_run_before_any_request(fault, server, k3_env, monkeypatch, tmp_path):
    make, word = FAULTS[fault]
    make(monkeypatch, k3_env)
    run = RunDir.at(tmp_path / "run")
    with pytest.raises(PreflightError) as exc:
        run_pipeline(profile_for(server.base_url), run, progress=False, log=lambda *_: None)
    assert len(exc.value.problems) == 1, exc.value.problems
    assert word in exc.value.problems[0]
    assert chat_requests(server) == [] and not run.prompts.exists()  # nothing selected, nothing requested


@pytest.mark.integration
def test_wrong_model_name_and_unreachable_endpoint(server, k3_env, tmp_path):
    dead = closed_port_url()
    prof = profile_for(server.base_url, **{"generate.model": "moonshotai/Kimi-K2"})
    prof = prof.model_copy(update={"generate": prof.generate.model_copy(update={"endpoints": [server.base_url, dead]})})
    with pytest.raises(PreflightError) as exc:
        run_pipeline(prof, RunDir.at(tmp_path / "run"), progress=False, log=lambda *_: None)
    problems = exc.value.problems
    assert len(problems) == 2, problems
    assert "not generate.model 'moonshotai/Kimi-K2'" in problems[0] and MODEL in problems[0]
    assert "unreachable" in problems[1] and dead.rsplit(":", 1)[1].split("/")[0] in problems[1]
    assert chat_requests(server) == []


def test_every_problem_is_listed_at_once(server, k3_env, monkeypatch, tmp_path):
    """Tokenizer env unset, model dir missing, wrong key, a dead second endpoint: one error, four lines."""
    monkeypatch.delenv("KIMI_K3_TOKENIZER")
    monkeypatch.setenv("KIMI_K3_MODEL", str(tmp_path / "no-such-model"))
    monkeypatch.setenv("REGEN_API_KEY", "sk-wrong")
    prof = profile_for(f"{server.base_url},{closed_port_url()}")
    rep = check_profile(prof, RunDir.at(tmp_path / "run"))
    joined = "\n".join(rep.problems)
    assert len(rep.problems) == 4, rep.problems
    for word in ("render.tokenizer", "train.target", "HTTP 401", "unreachable"):
        assert word in joined
    assert chat_requests(server) == []


def test_cli_run_prints_every_problem_without_a_traceback(server, k3_env, monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("KIMI_K3_TOKENIZER")
    monkeypatch.setenv("REGEN_API_KEY", "sk-wrong")
    sets = [f"generate.endpoints=[{server.base_url}]", "select.total=24"]
    argv = ["run", "--profile", "kimi-k3", "--run", str(tmp_path / "run"), "--no-progress"]
    rc = cli.main(argv + [x for s in sets for x in ("--set", s)])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "2 problem(s)" in err and "render.tokenizer" in err and "HTTP 401" in err and "sk-wrong" not in err
    assert chat_requests(server) == []


def test_contamination_file_and_output_space(server, k3_env, tmp_path):
    """Other fields and positions: a missing contamination file; a plan that needs more space than exists."""
    prof = profile_for(server.base_url)
    prof = prof.model_copy(update={
        "select": prof.select.model_copy(update={"contamination_files": ["data/prompts/no_such_benchmark"]}),
        "plan": prof.plan.model_copy(update={"shard_bytes_per_token": 1e12})})
    rep = check_profile(prof, RunDir.at(tmp_path / "run"))
    assert len(rep.problems) == 2, rep.problems
    assert "no_such_benchmark" in rep.problems[0] and "GB free, the plan needs" in rep.problems[1]


def test_flow_runs_the_same_preflight_first():
    """The flow's first task is `pipeline.preflight` (tested above); its source calls it before select."""
    import inspect

    from flows import regen_flow

    src = inspect.getsource(regen_flow.regen.fn)
    assert src.index("preflight_task(") < src.index("select_task(")
    assert "pipeline.preflight(" in inspect.getsource(regen_flow.preflight_task.fn)


def test_the_draft_the_profile_will_train_is_checked_against_every_serving_engine(server, k3_env, tmp_path):
    """A draft its listed engine cannot load, or that no engine loads, stops the run first."""
    run = RunDir.at(tmp_path / "run")
    rep = check_profile(profile_for(server.base_url), run)
    assert not rep.problems and any("the draft will load in tokenspeed" in c for c in rep.checks), rep.checks
    # the K3 draft with a reduced vocabulary: TokenSpeed (listed) refuses it, naming the field and the remedy
    rep = check_profile(profile_for(server.base_url, **{"train.draft_vocab_size": 4096}), run)
    assert any("train.serve_engines lists tokenspeed" in p and "draft_vocab_size=4096" in p
               and "train.draft_vocab_size: 0" in p for p in rep.problems), rep.problems
    # listed vllm: fc_norm is the reason; remedy TokenSpeed or fc_norm false
    rep = check_profile(profile_for(server.base_url, **{"train.serve_engines": ["vllm"]}), run)
    assert any("vllm: fc_norm=True" in p and "TokenSpeed >= 0.1.1" in p for p in rep.problems), rep.problems
    # nothing listed, and nothing can load it: still a problem, every engine's reasons listed
    rep = check_profile(profile_for(server.base_url, **{"train.serve_engines": [], "train.draft_vocab_size": 4096,
                                                        "train.draft": {"q_lora_rank": 0}}), run)
    assert any("no serving engine can load" in p and "llama.cpp" in p and "sglang" in p for p in rep.problems)


def test_the_local_profile_trains_a_draft_llama_cpp_serves(tmp_path):
    rep = check_profile(load_profile("local"), RunDir.at(tmp_path / "run"), network=False)
    assert any("the draft will load in" in c and "llama.cpp" in c for c in rep.checks), rep.checks
    rep = check_profile(load_profile("local", {"train.attention_type": "mla", "train.fc_norm": True}),
                        RunDir.at(tmp_path / "run"), network=False)
    line = next(p for p in rep.problems if "train.serve_engines lists llama.cpp" in p)
    assert "attention_type='mla'" in line and "fc_norm=True" in line and "train.fc_norm: false" in line
