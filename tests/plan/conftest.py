"""Fixtures of the preflight and plan tests: the kimi-k3 profile pointed at a real test server on loopback."""
from __future__ import annotations

import json
import socket

import pytest

from regen.config import REPO_ROOT
from regen.testing.openai_server import ServerThread, Settings

KEY = "sk-preflight-good-key"
MODEL = "moonshotai/Kimi-K3"


def closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return f"http://127.0.0.1:{port}/v1"


@pytest.fixture
def server():
    srv = ServerThread(Settings(models=[MODEL], api_key=KEY))
    yield srv
    srv.stop()


@pytest.fixture
def k3_env(monkeypatch, tmp_path):
    """The worker environment of the kimi-k3 profile: pool, key, test tokenizer, a target config."""
    target = tmp_path / "k3-target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "num_hidden_layers": 93,
                                                    "hidden_size": 7168, "vocab_size": 163840}))
    env = {"KIMI_MTP_DATASET": str(REPO_ROOT / "data/prompts/kimi_mtp_sample"), "REGEN_API_KEY": KEY,
           "KIMI_K3_TOKENIZER": str(REPO_ROOT / "data/tokenizers/kimi-k3-test"), "KIMI_K3_MODEL": str(target),
           "MOONCAKE_MASTER": "10.0.0.2:50051"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env
