"""`regen engine-eval --endpoint`: the engines' metric names read from their released code (a rename fails here),
the counters parsed from Prometheus text in each engine's layout, the clear errors (a counter going backwards, a
missing metric, another model), and a real llama.cpp server started as its own process, the way a user starts one,
measured through the endpoint path beside a second server without the draft."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from regen.serve.engines.endpoint import (
    ENGINE_COUNTERS,
    Counters,
    EndpointError,
    check_model,
    detect_engine,
    parse_counters,
)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "tests" / "train"))

from test_served_protocol import engine_source  # noqa: E402


def bench_module(name: str):
    """bench/<name>.py imported by path, for its functions (its main does not run)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_metric_name_is_in_the_engines_released_code():
    vllm_src = engine_source("vllm", "v1/spec_decode/metrics.py")
    for name in ENGINE_COUNTERS["vllm"].values():
        assert f'"{name}"' in vllm_src, name
    ts = engine_source("tokenspeed", "runtime/metrics/collector.py")
    for name in ENGINE_COUNTERS["tokenspeed"].values():
        assert f'name="{name}"' in ts, name
    sg = engine_source("sglang", "srt/observability/metrics_collector.py")
    for name in ENGINE_COUNTERS["sglang"].values():  # prometheus_client Counters, declared with their _total
        assert f'name="{name}_total"' in sg, name
    gauge = sg.split('name="sglang:spec_accept_length"')[0][-80:]
    assert "Gauge(" in gauge  # a most-recent gauge: no use for attribution, hence the counters above
    so = sorted((ROOT / ".venv" / "lib").glob("python*/site-packages/xllamacpp/xllamacpp*.so"))
    if not so:
        pytest.skip("xllamacpp is not installed (scripts/setup.sh)")
    blob = so[0].read_bytes()
    assert b"# TYPE llamacpp:" in blob
    for name in ENGINE_COUNTERS["llama.cpp"].values():
        assert name.removeprefix("llamacpp:").encode() + b"_total" in blob, name
    assert b"llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position=\"" in blob


def exposition(engine: str, drafts, accepted, per_pos=(), *, generated=0, labels=(("engine", "0"),)) -> str:
    """Prometheus text of `engine`'s counters as prometheus_client writes it (the client vLLM, SGLang and
    TokenSpeed use), two label sets each, to check that the samples are summed."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    reg = CollectorRegistry()
    values = {"drafts": drafts, "draft_tokens": drafts * 3, "accepted": accepted, "generated": generated}
    keys = [k for k, _ in labels]
    for field, name in ENGINE_COUNTERS[engine].items():
        if field == "per_pos":
            c = Counter(name, "accepted per position", keys + ["position"], registry=reg)
            for k, v in enumerate(per_pos):
                c.labels(*[v_ for _, v_ in labels], str(k)).inc(v)
            continue
        c = Counter(name, field, keys, registry=reg)
        c.labels(*[v for _, v in labels]).inc(values[field] / 2)
        c.labels(*["other" for _ in labels]).inc(values[field] / 2)
    return generate_latest(reg).decode()


@pytest.mark.parametrize("engine", ["vllm", "tokenspeed"])
def test_counters_are_summed_over_label_sets_and_attributed_by_difference(engine):
    before = parse_counters(exposition(engine, 10, 25, (6, 5, 4)), engine)
    after = parse_counters(exposition(engine, 30, 85, (20, 17, 14)), engine)
    assert detect_engine(exposition(engine, 1, 1)) == engine
    d = after - before
    assert (d.drafts, d.accepted, d.draft_tokens) == (20, 60, 60)
    assert 1 + d.accepted / d.drafts == 4.0
    if engine == "vllm":
        assert d.per_pos == {0: 14, 1: 12, 2: 10}
    with pytest.raises(EndpointError, match="went backwards.*restarted"):
        before - after


@pytest.mark.parametrize("engine,want", [
    ("vllm", dict(drafts=2, accepted=2, draft_tokens=6, per_pos={0: 1, 1: 1, 2: 0})),  # drafts of 3: 2 and 0 kept
    ("tokenspeed", dict(drafts=4, accepted=10, draft_tokens=28, per_pos={})),  # one step, 4 slots x 7 tokens
    ("sglang", dict(drafts=4, accepted=13 - 4 - 1, draft_tokens=None, per_pos={}))])  # 13 tokens, 4 verify calls
@pytest.mark.integration  # each engine's code in a subprocess
def test_the_metrics_text_each_engines_own_code_writes_is_read(engine, want):
    """The engine's own metrics code (vLLM's SpecDecodingProm, TokenSpeed's EngineMetrics, SGLang's
    TokenizerMetricsCollector) after a known workload, in a subprocess (tests/serve/engine_driver.py metrics)."""
    import json

    python = ROOT / ".venv-vllm" / "bin" / "python" if engine == "vllm" else Path(sys.executable)
    if engine == "vllm" and not python.exists():
        pytest.skip("vLLM's CPU venv .venv-vllm is missing (REGEN_VLLM=1 bash scripts/setup.sh builds it)")
    if engine != "vllm" and not (ROOT / ".engines" / engine).is_dir():
        pytest.skip(f".engines/{engine} is missing: bash scripts/setup.sh installs the {engine} wheel there")
    proc = subprocess.run([str(python), str(Path(__file__).parent / "engine_driver.py"), "metrics", engine],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ENGINE_RESULT ")), None)
    assert line, proc.stderr[-3000:]
    res = json.loads(line.removeprefix("ENGINE_RESULT "))
    assert "crash" not in res, res
    assert detect_engine(res["text"]) == engine
    c = parse_counters(res["text"], engine).with_requests(1)
    assert (c.drafts, c.accepted, c.draft_tokens, c.per_pos) == (want["drafts"], want["accepted"],
                                                                 want["draft_tokens"], want["per_pos"])


def test_sglang_accepted_drafts_come_from_generated_tokens_and_rounds():
    """SGLang counts verify rounds and generated tokens: each round commits accepted + 1, each request's first token
    comes from the prefill, so 2 requests, 10 rounds and 42 tokens are 42 - 10 - 2 = 30 accepted drafts."""
    text0, text1 = exposition("sglang", 0, 0, generated=0), exposition("sglang", 10, 0, generated=42)
    assert detect_engine(text1) == "sglang"
    d = (parse_counters(text1, "sglang") - parse_counters(text0, "sglang")).with_requests(2)
    assert (d.drafts, d.accepted) == (10, 30)


def test_a_missing_metric_or_an_unknown_engine_is_a_clear_error():
    text = exposition("tokenspeed", 3, 4)
    with pytest.raises(EndpointError, match="has no vllm:spec_decode_num_drafts.*speculative-config"):
        parse_counters(text, "vllm")
    with pytest.raises(EndpointError, match="no known engine.*--engine"):
        detect_engine("# HELP up 1\nup 1\n")
    with pytest.raises(EndpointError, match="--engine 'trt'"):
        parse_counters(text, "trt")
    assert (Counters("vllm", 4.0, 9.0, 6.0) - Counters("vllm")).accepted is None  # unknown before: None, never 0


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory, model_dir):
    """llama.cpp's server started as users start it (its own process, the exported draft on its command line), on
    loopback: (url with the draft, url of the target alone, block size). The draft is a random one of the local
    profile's shape: acceptance is low, but the counters move and the path is the user's."""
    from test_engine_contracts import local_draft

    from regen.serve.engines import export_draft
    from regen.target.llama_cpp import served_template, version

    if version() is None:
        pytest.skip("xllamacpp is not installed (scripts/setup.sh)")
    root = tmp_path_factory.mktemp("endpoint")
    step = local_draft(root, model_dir)
    rec = export_draft(step, "llama.cpp", root / "export", target_gguf=model_dir / "engine-q8_0.gguf",
                       target_path=str(model_dir))
    template = root / "template.jinja"
    template.write_text(served_template(model_dir))
    K = rec["widths"]["block_size"]
    bench = bench_module("served_endpoint")
    cmds = bench.server_commands(model_dir / "engine-q8_0.gguf", template, "smollm2-135m", parallel=2,
                                 ctx_per_slot=1024, threads=1, draft=root / "export" / "draft-dspark.gguf",
                                 block_size=K)
    with bench.llama_cpp_servers(cmds, root) as (with_draft, alone):
        yield with_draft, alone, K


@pytest.mark.integration  # two llama.cpp servers (two_servers)
def test_the_command_line_measures_an_endpoint_and_refuses_bad_flags(two_servers, tmp_path, capsys):
    import json

    from regen.cli import main

    with_draft, _, _ = two_servers
    base = ["engine-eval", "--profile", "local", "--run", str(tmp_path / "run"), "--endpoint", with_draft,
            "--benchmarks-only", "--benchmark", "humaneval", "--num-prompts", "1", "--max-new-tokens", "8"]
    assert main(base) == 0
    res = json.loads((tmp_path / "run" / "engine-eval-endpoint.json").read_text())
    assert res["engine"] == "llama.cpp" and res["sets"]["humaneval"]["cells"][0]["by_concurrency"]["1"]["num_rounds"]
    assert "| set | category |" in capsys.readouterr().out
    assert main([*base, "--concurrency", "0"]) == 2
    assert "--concurrency '0'" in capsys.readouterr().err
    assert main([*base[:-4], "--benchmark", "gsm9k"]) == 2
    assert "choose from" in capsys.readouterr().err


@pytest.mark.integration  # two llama.cpp servers (two_servers)
def test_the_heldout_cells_of_a_run_are_measured_and_aimable(two_servers, tmp_path):
    """A run's held-out prompts (shards + selection), measured per cell through the endpoint; the result carries the
    `trained.breakdown` view `regen select --aim` reads, and regen eval's figures when the run has an eval.json."""
    import json

    from train_helpers import ShardWriter

    from regen.config import load_profile
    from regen.rundir import RunDir
    from regen.select.aim import cell_figures
    from regen.serve.engines.endpoint_eval import measure
    from schemas.io import write_json_atomic, write_rows_atomic
    from schemas.messages import message_to_arrow
    from schemas.prompt import PROMPT_SCHEMA

    with_draft, _, K = two_servers
    prompts, shard_rows = [], []
    for i, (cat, band) in enumerate([("coding", "short"), ("coding", "short"), ("general", "long")]):
        prompts.append({"prompt_id": f"p{i}", "messages": [message_to_arrow({"role": "user", "content": f"Say {i}."})],
                        "tools": None, "category": cat, "language": "en", "source": "t", "source_file": "x.jsonl",
                        "source_row": i, "num_turns": 1, "num_prompt_tokens": 5, "length_band": band, "mode": None})
        shard_rows.append({"sample_id": f"s{i}", "prompt_id": f"p{i}", "turn": 0, "category": cat, "language": "en",
                           "input_ids": list(range(1, 13)), "loss_spans": [{"start": 6, "end": 12}],
                           "num_tokens": 12, "num_loss_tokens": 6})
    info = write_rows_atomic(prompts, tmp_path / "prompts" / "part-00000.parquet", PROMPT_SCHEMA)
    write_json_atomic({"stage": "select", "parts": [info], "rows": len(prompts)},
                      tmp_path / "prompts" / "manifest.json")
    ShardWriter(tmp_path).add(shard_rows, complete=True)
    run = RunDir.at(str(tmp_path))
    ev = {"trained": {"breakdown": {"cells": [{"category": "coding", "length_band": "short", "mode": None,
                                               "acc_len_per_round": 2.5}]}}}
    (tmp_path / "eval.json").write_text(json.dumps(ev))
    profile = load_profile("local", ["train.heldout_fraction=1.0", "train.heldout_per_cell=0"])
    res = measure(profile, run, endpoint=with_draft, concurrency=(1,), num_prompts=3, max_new_tokens=8,
                  block_size=K, log=lambda *_: None)
    cells = {(c["category"], c["length_band"]): c for c in res["sets"]["heldout"]["cells"]}
    assert set(cells) == {("coding", "short"), ("general", "long")}
    assert cells[("coding", "short")]["by_concurrency"]["1"]["num_requests"] == 2
    assert cells[("coding", "short")]["regen"] == {"greedy": 2.5} and "regen" not in cells[("general", "long")]
    figs, _, overall = cell_figures(res)
    assert set(figs) == {("coding", "short", None), ("general", "long", None)} and overall >= 1.0
    assert res["draft"] == f"llama.cpp at {with_draft}"


@pytest.mark.integration  # two llama.cpp servers (two_servers)
def test_the_next_selection_is_aimed_from_the_served_engines_cells(two_servers, tmp_path, capsys):
    """The loop on the engine's word, end to end through the commands a user runs: `regen select`, the selection's
    held-out prompts measured through the served endpoint (`regen engine-eval --endpoint`), then `regen select
    --eval <run>/engine-eval-endpoint.json --budget-units N`. The round's reasoning carries the engine's per-cell
    acc_len, and its prompts are new, not held out, and within the budget."""
    import json

    import pyarrow.parquet as pq
    from train_helpers import ShardWriter

    from regen.cli import main
    from regen.select.aim import is_heldout
    from schemas.prompt import turn_positions

    with_draft, _, _ = two_servers
    root = tmp_path / "run"
    common = ["--profile", "local", "--run", str(root), "--set", "select.total=40"]
    assert main(["select", *common, "--no-progress"]) == 0
    selected = [r for f in sorted((root / "prompts").glob("part-*.parquet")) for r in pq.read_table(f).to_pylist()]
    # a training row for every selected prompt (what render writes): the held-out split is drawn from the shards
    ShardWriter(root).add([{"sample_id": f"s{i}", "prompt_id": r["prompt_id"], "turn": 0, "category": r["category"],
                            "language": r["language"], "input_ids": list(range(1, 13)),
                            "loss_spans": [{"start": 6, "end": 12}], "num_tokens": 12, "num_loss_tokens": 6}
                           for i, r in enumerate(selected)], complete=True)
    assert main(["engine-eval", *common, "--endpoint", with_draft, "--num-prompts", "6", "--max-new-tokens", "8"]) == 0
    measured = json.loads((root / "engine-eval-endpoint.json").read_text())
    engine_cells = {(c["category"], c["length_band"], c["mode"]): c["acc_len_per_round"]
                    for c in measured["trained"]["breakdown"]["cells"] if c["acc_len_per_round"] is not None}
    assert engine_cells, measured["trained"]

    assert main(["select", *common, "--eval", str(root / "engine-eval-endpoint.json"), "--budget-units", "12"]) == 0
    assert "loop round 1 (weakest):" in capsys.readouterr().out
    record = json.loads((root / "loop" / "round-01.json").read_text())
    assert record["eval"] == str(root / "engine-eval-endpoint.json")
    reasoning = {(c["category"], c["length_band"], c["mode"]): c["acc_len"] for c in record["cells"]}
    assert any(cell in reasoning for cell in engine_cells), (reasoning, engine_cells)
    for cell, acc in reasoning.items():  # every measured cell the pool supplies is weighed at the engine's figure
        if cell in engine_cells:
            assert acc == engine_cells[cell], (cell, acc, engine_cells[cell])
    assert record["prompts_added"] > 0, record
    added = pq.read_table(root / "prompts" / record["part"]).to_pylist()
    used = {r["prompt_id"] for r in selected}
    assert all(r["prompt_id"] not in used and not is_heldout(r["prompt_id"], 0.15) for r in added)
    assert sum(len(turn_positions(r["messages"])) for r in added) == record["units_added"] <= 12


@pytest.mark.integration  # two llama.cpp servers (two_servers)
def test_a_llama_cpp_server_of_its_own_measured_through_the_endpoint(two_servers):
    from regen.config import load_profile
    from regen.serve.engines.endpoint_eval import format_endpoint, measure

    with_draft, alone, K = two_servers
    profile = load_profile("local")
    res = measure(profile, None, endpoint=with_draft, baseline=alone, concurrency=(1, 2),
                  benchmark_sets=["humaneval", "fastchat_mt_bench"], num_prompts=2, max_new_tokens=12, heldout=False,
                  block_size=K, log=lambda *_: None)
    assert res["engine"] == "llama.cpp" and list(res["sets"]) == ["humaneval", "fastchat_mt_bench"]
    for s in res["sets"].values():
        (cell,) = s["cells"]
        one, two = cell["by_concurrency"]["1"], cell["by_concurrency"]["2"]
        for f in (one, two):
            assert f["num_requests"] == 2 and f["num_rounds"] > 0 and f["completion_tokens"] > 2
            assert 1.0 <= f["acc_len_per_round"] <= K + 1 and len(f["position_acceptance"]) == K
            assert f["tokens_per_s"] > 0 and f["baseline_tokens_per_s"] > 0 and f["speedup"] > 0
        assert one["acc_len_per_request"] is not None and two["acc_len_per_request"] is None  # counters are shared
        assert one["accepted_draft_tokens"] == round((one["acc_len_per_round"] - 1) * one["num_rounds"])
    assert "| humaneval | humaneval | - | - | 1 | 2 |" in format_endpoint(res)
    # the server without the draft exposes the counters but never drafts: reported as such, never as acc_len 1
    bare = measure(profile, None, endpoint=alone, concurrency=(1,), benchmark_sets=["humaneval"], num_prompts=1,
                   max_new_tokens=12, heldout=False, log=lambda *_: None)
    f = bare["sets"]["humaneval"]["cells"][0]["by_concurrency"]["1"]
    assert f["num_rounds"] == 0 and f["acc_len_per_round"] is None and "drafted nothing" in f["warning"]
    with pytest.raises(EndpointError, match=r"serves \['smollm2-135m'\], not 'kimi-k3'"):
        check_model(with_draft, "kimi-k3")
    with pytest.raises(EndpointError, match="has no vllm:spec_decode_num_drafts"):
        measure(profile, None, endpoint=with_draft, engine="vllm", benchmark_sets=["humaneval"], num_prompts=1,
                heldout=False, log=lambda *_: None)


def test_heldout_prompts_go_out_as_their_first_turn_with_the_modes_body(tmp_path):
    """A held-out prompt is sent as the messages before its first generated turn, with its tools, under its mode's
    settings (the card's `thinking` / `thinking_effort` body); a prompt missing from the selection is an error."""
    import json

    from regen.config.generate import GenerateConfig
    from regen.errors import InputError
    from regen.rundir import RunDir
    from regen.serve.engines.endpoint_eval import heldout_messages, request_body_of
    from schemas.io import write_rows_atomic
    from schemas.messages import message_to_arrow
    from schemas.prompt import PROMPT_SCHEMA

    msgs = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    row = {"prompt_id": "p1", "messages": [message_to_arrow(m) for m in msgs], "tools": json.dumps(tools),
           "category": "coding", "language": "en", "source": "t", "source_file": "x.jsonl", "source_row": 0,
           "num_turns": 2, "num_prompt_tokens": 5}
    write_rows_atomic([row], tmp_path / "prompts" / "part-00000.parquet", PROMPT_SCHEMA)
    run = RunDir.at(str(tmp_path))
    (p,) = heldout_messages(run, [{"prompt_id": "p1", "category": "coding", "mode": "no_think"}])
    assert [m["content"] for m in p["messages"]] == ["q1"] and p["tools"] == tools
    gen = GenerateConfig(model="kimi-k3", temperature=1.0, extra_body={"thinking": True, "thinking_effort": "max"},
                         modes={"think_max": {}, "no_think": {"temperature": 0.6,
                                                              "extra_body": {"thinking": False,
                                                                             "thinking_effort": None}}})
    body = request_body_of(gen, p, 64, "kimi-k3")
    assert (body["temperature"], body["thinking"], body["max_tokens"]) == (0.6, False, 64)
    assert "thinking_effort" not in body
    body = request_body_of(gen, {**p, "mode": "think_max"}, 64, "kimi-k3")
    assert (body["temperature"], body["thinking"], body["thinking_effort"]) == (1.0, True, "max")
    with pytest.raises(InputError, match="held-out prompt p2 is not in"):
        heldout_messages(run, [{"prompt_id": "p2"}])


def test_benchmark_sets_are_selectable_by_name():
    from regen.errors import InputError
    from regen.serve.engines.endpoint_eval import benchmark_prompts, benchmarks

    assert {"fastchat_mt_bench", "humaneval", "mbpp", "arena_hard_v0.1"} <= set(benchmarks())
    ps = benchmark_prompts("humaneval", 3)
    assert len(ps) == 3 and ps[0]["prompt_id"] == "humaneval:0"
    assert "has_close_elements" in ps[0]["messages"][0]["content"]
    with pytest.raises(InputError, match="--benchmark 'gsm9k': no such set; choose from .*humaneval"):
        benchmark_prompts("gsm9k")


def test_regen_evals_cells_stand_beside_the_engines():
    from regen.serve.engines.endpoint_eval import format_endpoint, regen_cells

    def b(x):
        return {"trained": {"breakdown": {"cells": [{"category": "coding", "length_band": "short", "mode": None,
                                                     "acc_len_per_round": x}]}}}

    ev = {**b(3.5), "sampled": {"protocol": {"temperature": 1.0}, **b(3.1)},
          "served": {"probabilistic+standard": b(3.1), "probabilistic+block": b(3.3)}}
    cells = regen_cells(ev)
    assert cells == {("coding", "short", None): {"greedy": 3.5, "T=1": 3.1, "T=1 probabilistic+block": 3.3}}
    res = {"sets": {"heldout": {"cells": [{"category": "coding", "length_band": "short", "mode": None,
                                           "regen": cells[("coding", "short", None)],
                                           "by_concurrency": {"1": {"num_requests": 2, "num_rounds": 9,
                                                                    "acc_len_per_round": 3.2}}}]}}}
    assert "| 3.200 | - | - | - | - | greedy 3.500; T=1 3.100; T=1 probabilistic+block 3.300 |" in format_endpoint(res)
    assert regen_cells(None) == {}


def test_the_next_selection_can_be_aimed_from_the_engines_cells():
    """`regen select --aim engine-eval-endpoint.json` reads the engine's held-out cells as it reads eval.json's."""
    from regen.select.aim import cell_figures
    from regen.serve.engines.endpoint_eval import aim_breakdown

    def cell(cat, band, rounds, accepted, n=2):
        return {"category": cat, "length_band": band, "mode": None, "by_concurrency": {
            "1": {"num_requests": n, "num_rounds": rounds, "accepted_draft_tokens": accepted,
                  "acc_len_per_round": round(1 + accepted / rounds, 6) if rounds else None}}}

    heldout = {"cells": [cell("coding", "short", 10, 20), cell("coding", "long", 10, 0), cell("math", "short", 0, 0)]}
    cells, cats, overall = cell_figures({"trained": {"breakdown": aim_breakdown(heldout, "1")}})
    assert cells == {("coding", "short", None): (3.0, 2), ("coding", "long", None): (1.0, 2)}  # math: never drafted
    assert cats == {"coding": 2.0} and overall == 2.0
    assert aim_breakdown(None, "1") is None
