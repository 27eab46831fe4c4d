"""`regen engine-eval --endpoint` against vLLM's own server: vLLM's CPU build (`.venv-vllm`, the one the vLLM feature
producer's test uses) serving the embedded target with a speculative method its CPU build runs (n-gram prompt lookup,
`"method": "ngram"`; vLLM's DSpark drafts need its CUDA runner, docs/serve.md), started as a user starts it (its own
process, its own command line, on loopback), and a second server without speculation as the baseline. What is
read is vLLM's real `/metrics` counters (`vllm:spec_decode_*`), not a recording.

n-gram lookup proposes the continuation of an earlier occurrence of the last tokens, so a prompt that asks for a
repeated list is drafted and accepted often and a free answer rarely: the test asserts that the counters move, that
what they say is consistent with the tokens the server returned, and that the repeated prompts are accepted more than
the free ones. Slow: two vLLM servers start, side by side (about 22 s each alone on 2 cores, each with its engine core
in the server's own process).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "train"))

pytestmark = [pytest.mark.slow, pytest.mark.integration]

K = 4  # num_speculative_tokens
SERVED = "smollm2-135m"  # the local profile's generate.model
REPEAT = ["Repeat this line five times, one per line: the quick brown fox jumps over the lazy dog.",
          "Write the numbers from 1 to 40 separated by commas.",
          "Repeat exactly, three times: red, green, blue, yellow, purple, orange."]
FREE = ["Write a short poem about the sea.", "Why is the sky blue?", "Give me a tip for learning to cook."]


def vllm_server(python: str, model: Path, log: Path, speculative: dict | None):
    """A vLLM server started and not yet waited for (`wait_ready`): the fixture starts both, then waits."""
    from regen.train.features.store import free_port
    from regen.train.features.vllm_producer import VllmServer

    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", SERVED,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "1024",
           "--enforce-eager", "--seed", "0", "--distributed-executor-backend", "uni"]
    if speculative:
        cmd += ["--speculative-config", json.dumps(speculative)]
    # nobind: vLLM's CPU build otherwise pins its engine to core 0 (reserving the others), so that two servers, or
    # a server beside the other test worker, share one core while the rest stay idle
    # in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, the executor `uni`): vLLM's engine core and worker run in
    # the server's own process, not in two more processes that each import vLLM and torch again; one start took
    # 22 s and 22 CPU-seconds against 32 s and 34 (2026-12-07, AMD EPYC with avx512_bf16, alone on 2 cores)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return VllmServer.start(cmd, port, str(log), 900, env, wait=False)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, model_dir):
    """(url with n-gram speculation, url without): vLLM's CPU server on the embedded target, each its own process."""
    from test_vllm_producer import VLLM_PYTHON, _has_vllm

    if not _has_vllm():
        pytest.skip(f"no vLLM venv at {VLLM_PYTHON} (REGEN_VLLM=1 bash scripts/setup.sh)")
    root = tmp_path_factory.mktemp("vllm-endpoint")
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    started = []
    try:  # both start at once: a start-up is mostly one core's imports and loading, so the two overlap
        started.append(vllm_server(VLLM_PYTHON, model_dir, root / "spec.log", spec))
        started.append(vllm_server(VLLM_PYTHON, model_dir, root / "alone.log", None))
        for s in started:
            s.wait_ready(900)
        yield started[0].url, started[1].url
    finally:
        for s in started:
            s.stop()


def _prompts(name: str, texts: list[str]) -> list[dict]:
    """A prompt set in `regen.serve.engines.endpoint_eval.benchmark_prompts`' form."""
    return [{"prompt_id": f"{name}:{i}", "category": name, "length_band": None, "mode": None,
             "messages": [{"role": "user", "content": t}], "tools": None} for i, t in enumerate(texts)]


def test_vllms_own_counters_are_read_per_set_with_the_speedup(servers, monkeypatch):
    from regen.config import load_profile
    from regen.serve.engines import endpoint_eval
    from regen.serve.engines.endpoint import check_model, get, parse_counters

    with_spec, alone = servers
    check_model(with_spec, SERVED)
    sets = {"repeat": _prompts("repeat", REPEAT), "free": _prompts("free", FREE)}
    monkeypatch.setattr(endpoint_eval, "benchmark_prompts", lambda name, n: sets[name][:n])
    before = parse_counters(get(with_spec + "/metrics").text, "vllm")
    # greedy, as the card's temperature-zero endpoint: n-gram proposals carry no probabilities, so at the profile's
    # T = 0.7 vLLM accepts each with the target's probability of it (measured: 0 of 11 drafted tokens accepted on a
    # sampled answer, 44 of 44 greedy)
    profile = load_profile("local", ["generate.temperature=0"])
    res = endpoint_eval.measure(profile, None, endpoint=with_spec, baseline=alone, concurrency=(1, 2),
                                benchmark_sets=["repeat", "free"], num_prompts=3, max_new_tokens=48, heldout=False,
                                block_size=K, log=lambda *_: None)
    after = parse_counters(get(with_spec + "/metrics").text, "vllm")
    print("VLLM_ENDPOINT " + json.dumps(res, default=str))
    print(endpoint_eval.format_endpoint(res))
    assert res["engine"] == "vllm"  # detected from its /metrics
    figures = {}
    for name, s in res["sets"].items():
        (cell,) = s["cells"]
        for c, f in cell["by_concurrency"].items():
            assert f["num_requests"] == 3 and f["completion_tokens"] > 3 * 8, (name, c, f)
            assert f["num_rounds"] > 0 and 1.0 <= f["acc_len_per_round"] <= K + 1, (name, c, f)
            assert len(f["position_acceptance"]) == K and all(0 <= p <= 1 for p in f["position_acceptance"])
            # accepted tokens are tokens the server returned: never more than the answers hold
            assert f["accepted_draft_tokens"] <= f["completion_tokens"], f
            assert f["tokens_per_s"] > 0 and f["baseline_tokens_per_s"] > 0 and f["speedup"] > 0
            figures[name, c] = f
    # what the counters moved by over the whole measurement is what the cells add up to
    drafts = sum(f["num_rounds"] for f in figures.values())
    accepted = sum(f["accepted_draft_tokens"] for f in figures.values())
    assert (after - before).drafts == drafts and (after - before).accepted == accepted
    # n-gram lookup on repeated text is accepted more than on free text: the counters say what happened
    assert figures["repeat", "1"]["acc_len_per_round"] > figures["free", "1"]["acc_len_per_round"], figures
    assert figures["repeat", "1"]["acc_len_per_round"] > 1.5, figures
