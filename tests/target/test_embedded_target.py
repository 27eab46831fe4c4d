"""The embedded target: a real `transformers serve` process on loopback, started and stopped by regen.target.server."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from regen.config.serve import ServeConfig
from regen.errors import InputError
from regen.target.server import EmbeddedTarget, server_command


def test_host_must_be_loopback():
    with pytest.raises(ValueError, match="loopback"):
        ServeConfig(host="0.0.0.0")
    assert ServeConfig(host="localhost").host == "localhost"


def test_command_line():
    cmd = server_command(ServeConfig(cb_num_blocks=32, cb_max_batch_tokens=512), "smollm2-135m", 1234)
    assert cmd[1:3] == ["serve", "smollm2-135m"]
    i = cmd.index("--host")
    assert cmd[i + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "1234"
    assert "--continuous-batching" in cmd and cmd[cmd.index("--cb-num-blocks") + 1] == "32"
    assert "--continuous-batching" not in server_command(ServeConfig(continuous_batching=False), "m", 1)


def test_the_warm_up_carries_exactly_the_request_sampling():
    """The warm-up fixes the batch's sampling, so it sends what every request sends (seed included when set),
    never the run's max_tokens."""
    from regen.config.generate import GenerateConfig
    from regen.target.server import sampling

    assert sampling(GenerateConfig(temperature=0.7, top_p=0.9, max_tokens=512)) == {"temperature": 0.7, "top_p": 0.9}
    assert sampling(GenerateConfig(temperature=0.0, top_p=1.0, seed=3)) == {"temperature": 0.0, "top_p": 1.0, "seed": 3}


@pytest.mark.integration
def test_missing_model_names_the_fix(tmp_path):
    with pytest.raises(InputError, match="scripts/setup.sh"):
        EmbeddedTarget(ServeConfig(model_dir=str(tmp_path / "nope"))).start()


def test_transformers_serve_outside_the_tested_releases_is_refused_naming_them(model_dir, monkeypatch):
    from importlib import metadata

    from regen.target.server import check_transformers_serve

    for ok in ("5.0.0", "5.19.0", "5.24.0", "5.24.3"):
        check_transformers_serve(ok)
    for bad in ("5.25.0", "6.0.0", "4.57.6"):
        with pytest.raises(InputError, match=rf"transformers {bad} .*5\.0 to 5\.24\.x.*requirements/lock\.txt"):
            check_transformers_serve(bad)
    # refused at start, before any process is spawned
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "5.25.0" if name == "transformers" else real(name))
    with pytest.raises(InputError, match="transformers 5.25.0"):
        EmbeddedTarget(ServeConfig(engine="transformers")).start()


@pytest.fixture(scope="module")
def target(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with EmbeddedTarget(ServeConfig(cb_num_blocks=32, cb_max_batch_tokens=512), log_path=log) as t:
        yield t


@pytest.mark.slow
def test_serves_the_model_on_loopback_only(target):
    assert target.model == "smollm2-135m"
    assert target.base_url.startswith("http://127.0.0.1:")
    models = httpx.get(target.base_url + "/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["smollm2-135m"]
    listening = [c for c in psutil.Process(target.pid).net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert listening and {c.laddr.ip for c in listening} == {"127.0.0.1"}


@pytest.mark.slow
def test_chat_completion_honours_max_tokens_and_is_greedy(target):
    body = {"model": target.model, "messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "Name three colors."}],
            "max_tokens": 6, "temperature": 0}
    before = target.request_count()
    a = httpx.post(target.base_url + "/chat/completions", json=body, timeout=300).json()
    b = httpx.post(target.base_url + "/chat/completions", json=body, timeout=300).json()
    assert a["usage"]["completion_tokens"] <= 6
    assert a["choices"][0]["finish_reason"] in ("length", "stop")
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert "reasoning_content" not in a["choices"][0]["message"]
    assert target.request_count() == before + 2


@pytest.mark.slow
def test_streaming_ends_with_usage(target):
    body = {"model": target.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", target.base_url + "/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert events[-1]["usage"]["completion_tokens"] <= 4


@pytest.mark.slow
def test_unknown_fields_are_rejected(target):
    """Why the local profile never sends return_token_ids or thinking: the server answers 422."""
    body = {"model": target.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "return_token_ids": True}
    assert httpx.post(target.base_url + "/chat/completions", json=body, timeout=60).status_code == 422


@pytest.mark.slow
def test_the_warm_up_fixes_the_run_s_sampling(model_dir, tmp_path):
    """transformers serve fixes one sampling for its whole continuous batch from the first request: the warm-up
    carries the run's (`sampling=`), so a sampled run samples (the greedy fixture above repeats itself exactly)."""
    body = {"messages": [{"role": "user", "content": "Write one sentence about the sea."}], "max_tokens": 24,
            "temperature": 1.0}
    with EmbeddedTarget(ServeConfig(cb_num_blocks=16, cb_max_batch_tokens=256), log_path=tmp_path / "log",
                        sampling={"temperature": 1.0, "top_p": 1.0}) as t:
        assert t.sampling == {"temperature": 1.0, "top_p": 1.0}
        texts = {t.chat(**body)["choices"][0]["message"]["content"] for _ in range(4)}
    assert len(texts) > 1, texts  # four identical 24-token answers under sampling at T=1: not plausible


CHILD = """
import sys, time
from regen.config.serve import ServeConfig
from regen.target.server import EmbeddedTarget
t = EmbeddedTarget(ServeConfig(cb_num_blocks=16, cb_max_batch_tokens=256, warmup=False)).start()
print(t.pid, t.port, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_server_dies_with_a_killed_parent(model_dir):
    """SIGKILL of the process that started the server (a killed worker) takes the server down too."""
    parent = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        pid, port = map(int, parent.stdout.readline().split())
        assert psutil.pid_exists(pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 60
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the server outlived its parent"
            time.sleep(0.2)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        parent.kill()


@pytest.mark.slow
def test_stop_ends_the_process_group(target):
    """Last test of the module: stops the shared server (the fixture's own stop is then a no-op)."""
    pid, port = target.pid, target.port
    target.stop()
    target.stop()  # idempotent
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
