"""`regen plan`: both profiles plan without a request, and the plan's counts are within
10% of what a small real run of the same profile produced (select + generate against the test server + render)."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from conftest import MODEL

from regen import cli
from regen.config import load_profile
from regen.pipeline import run_pipeline
from regen.report.plan import build_plan
from regen.report.plan_table import print_plan
from regen.rundir import RunDir
from regen.testing.openai_server import ServerThread, Settings


def quiet(*_):
    pass


@pytest.mark.integration
def test_kimi_k3_plans_without_a_request(k3_env, monkeypatch, tmp_path, capsys):
    """The profile as shipped, its tokenizer variable on the bundled test tokenizer; no endpoint, no key, no
    target: the plan is made (the K3 shape assumed for the draft) and lists what would stop `regen run`."""
    for var in ("REGEN_API_KEY", "KIMI_K3_MODEL", "REGEN_ENDPOINTS"):
        monkeypatch.delenv(var, raising=False)
    run = tmp_path / "run"
    rc = cli.main(["plan", "--profile", "kimi-k3", "--run", str(run), "--world-size", "8", "--formulas"])
    out = capsys.readouterr().out
    assert rc == 0, out
    plan = json.loads((run / "plan.json").read_text())
    assert plan["prompts"] == 150_000 and plan["scale"]["factor"] > 1  # the bundled pool is scaled to select.total
    assert plan["prompt_tokens"]["renderer"] == "kimi-k3" and 0 < plan["prompt_tokens"]["p50"] <= plan["prompt_tokens"]["max"]
    assert plan["output_tokens"]["source"].startswith("assumed")
    d = plan["draft"]
    assert d["params_trainable"] + d["params_frozen"] - 1_174_405_120 == 3_562_312_961 + 5 * 7168  # spec §2, fc_norm
    assert d["world_size"] == 8 and d["memory_per_gpu_gib"]["optimizer"] == pytest.approx(
        8 * d["params_trainable"] / 8 / 2 ** 30, abs=0.01)
    assert any("REGEN_API_KEY" in p for p in plan["preflight_problems"])
    assert "server-hours =" in out and "memory/GPU optimizer" in out
    # features with producers: 2 objects on the GPU, train.producers.read_ahead (2) read ahead in pinned host memory,
    # apart (16 slots, a step's objects, at read_ahead 0: 84 GiB)
    assert d["memory_per_gpu_gib"]["features"] == 10.5 and d["host_memory_per_gpu_gib"]["feature_staging"] == 10.5
    assert "host/GPU feature slots" in out and "host/GB200 tray" in out  # host memory per GPU, apart from its total
    # the target's forward runs on the producers: not in the trainer's FLOPs, stated beside them
    # the draft's FLOPs counted per part for the mean row (regen.train.flops), not 6·P·D; rows x epochs of it
    rs, sh = d["row_shape"], plan["shards"]
    assert rs["num_anchors"] == 512 and rs["tokens"] == pytest.approx(sh["tokens"] / sh["rows"], rel=1e-3)
    assert d["training_flops"] == pytest.approx(d["flops_per_row_tflop"]["total"] * 1e12 * sh["rows"] * 5, rel=1e-3)
    assert d["six_p_d_flops"] == pytest.approx(6 * d["params_trainable"] * d["training_tokens"])
    assert d["flops_per_max_row_tflop"]["total"] == pytest.approx(378.4, abs=0.1)  # a full 64K row
    assert "counted per part" in d["flops_formula"] and "trainer s/row at MFU" in out
    assert d["producer_flops"] == pytest.approx(2 * 32e9 * d["training_tokens"]) and "producers' GPUs" in out
    f = plan["features"]
    assert f["features_from"] == "producers" and f["bytes_per_token"] == 6 * 7168 * 2  # 84 KiB: 5 taps + last
    assert f["largest_object_bytes"] == 65536 * 86016 and f["store_budget_bytes"] == 256 * 2 ** 30
    assert f["target_memory_per_rank_bytes"] == (163840 * 7168 * 2 + 7168) * 2  # embeddings, LM head, norm
    rows_s = 8 / 1.0
    assert f["producer_engines"] == -(-int(rows_s * f["tokens_per_row_mean"]) // 40000)
    assert f["producer_gpus"] == 16 * f["producer_engines"] and "(assumed)" in f["balance_formula"]
    assert "feature bytes / token" in out and "84.0 KiB" in out
    # which engines load the draft this profile trains, before 36 hours of training
    sv = d["serving"]
    assert sv["tokenspeed"]["serves"] and sv["tokenspeed"]["version"] == "tokenspeed==0.1.1"
    assert not sv["vllm"]["serves"] and "fc_norm" in sv["vllm"]["refusals"][0]
    assert not sv["llama.cpp"]["serves"] and not sv["sglang"]["serves"]
    assert "served by tokenspeed" in out and "served by vllm" in out
    # the mix's length bands and modes are counted: every cell, its units, each mode's output tokens
    cells = plan["cells"]["cells"]
    assert {c["mode"] for c in cells} == {"think_max", "think_low", "no_think"}
    assert {c["length_band"] for c in cells} <= {"0-2K", "2K-8K", "8K-16K", "16K-32K"}
    assert sum(c["prompts"] for c in cells) == pytest.approx(150_000, abs=len(cells))
    by_mode = {m: sum(c["prompts"] for c in cells if c["mode"] == m) for m in ("think_max", "think_low", "no_think")}
    assert by_mode["think_max"] / 150_000 == pytest.approx(0.6, abs=0.02)
    assert by_mode["no_think"] / 150_000 == pytest.approx(0.2, abs=0.02)
    out_of = {m: sum(c["output_tokens_per_unit"] * c["units"] for c in cells if c["mode"] == m)
              / sum(c["units"] for c in cells if c["mode"] == m) for m in by_mode}
    assert out_of["no_think"] < 0.3 * out_of["think_max"]  # plan.mode_output_factor 0.15 (categories differ a bit)
    assert "cells (assumed" in out and "no_think" in out
    total = sum(c["output_tokens_per_unit"] * c["units"] for c in cells)
    assert total == pytest.approx(plan["output_tokens"]["total"], rel=0.01)
    # an 80-column terminal: the figures on one screen (two columns, no formula wrapped into a cell), each formula
    # behind --formulas, every engine's verdict with the subject of its refusals
    print_plan(plan, width=80)
    short = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in short) <= 80 and len(short) <= 80
    assert not any("server-hours =" in line for line in short) and "add --formulas" in short[-1]
    assert any("served by vllm" in line and "no: fc_norm=True" in line for line in short)
    assert any("memory/GPU total" in line and "GiB" in line for line in short)
    print_plan(plan, formulas=True, width=80)
    full = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in full) <= 80 and any("server-hours =" in line for line in full)


@pytest.mark.integration
def test_local_plans_without_a_request(tmp_path):
    profile = load_profile("local", {"select.total": 60})
    plan = build_plan(profile, RunDir.at(tmp_path / "run"), log=quiet)
    assert plan["prompt_tokens"]["renderer"] == "hf" and plan["prompt_tokens"]["render_errors"] == 0
    assert plan["units"] >= plan["prompts"] == 60 and plan["pilot"] is None
    assert plan["draft"]["params_trainable"] > 0 and plan["draft"]["target_config"].startswith("measured")
    assert plan["draft"]["serving"]["llama.cpp"]["serves"] and plan["draft"]["serving"]["vllm"]["serves"]
    assert not plan["draft"]["serving"]["sglang"]["serves"]  # the 4,096-token draft vocabulary
    assert not (tmp_path / "run" / "generations").exists()
    f = plan["features"]  # in process: the whole target in the rank, counted in its checkpoint
    assert f["features_from"] == "in_process" and "counted in its checkpoint" in f["target_memory_formula"]
    assert f["target_memory_per_rank_bytes"] > 100e6
    profile = load_profile("local", {"select.total": 60, "train.features": "producers"})
    g = build_plan(profile, RunDir.at(tmp_path / "run"), log=quiet)["features"]
    assert g["target_memory_per_rank_bytes"] < f["target_memory_per_rank_bytes"] / 2  # the head only (tied)


@pytest.fixture
def long_answers():
    srv = ServerThread(Settings(models=[MODEL], tokens=56, reasoning_tokens=40))
    yield srv
    srv.stop()


@pytest.mark.integration
def test_plan_within_10_percent_of_a_small_real_run(long_answers, k3_env, tmp_path):
    over = {"generate.endpoints": [long_answers.base_url], "select.total": 40, "train.enabled": False,
            "generate.max_tokens": 1024}
    profile = load_profile("kimi-k3", over)
    run = RunDir.at(tmp_path / "run")
    plan = build_plan(profile, run, pilot=24, log=quiet)
    pilot_requests = len(long_answers.server.log)
    assert 24 <= plan["pilot"]["units"] and pilot_requests == plan["pilot"]["attempts"]

    run_pipeline(profile, run, progress=False, log=quiet)
    gen = json.loads((run.generations / "manifest.json").read_text())
    shards = json.loads((run.shards / "manifest.json").read_text())
    rows = pq.read_table([run.shards / s["path"] for s in shards["shards"]]).to_pylist()
    real = {"units": gen["accounting"]["units"], "requests": len(long_answers.server.log) - pilot_requests,
            "prompt_tokens": sum(r["num_tokens"] - r["num_loss_tokens"] for r in rows),
            "supervised_tokens": sum(r["num_loss_tokens"] for r in rows), "rows": len(rows),
            "shard_bytes": sum(s["bytes"] for s in shards["shards"])}
    planned = {"units": plan["units"], "requests": plan["requests"]["total"],
               "prompt_tokens": plan["shards"]["prompt_tokens"], "supervised_tokens": plan["shards"]["supervised_tokens"],
               "rows": plan["shards"]["rows"], "shard_bytes": plan["shards"]["bytes"]}
    off = {k: planned[k] / real[k] - 1 for k in real}
    print("plan vs run:", planned, real, {k: round(v, 3) for k, v in off.items()})
    assert all(abs(v) <= 0.10 for v in off.values()), (planned, real, off)
    assert planned["units"] == real["units"]  # counted, not estimated
    # the rendered estimate (fixed part + earlier turns' supervised tokens) explains the pilot's real prompt side,
    # per stratum of category x turn kind x generation mode (a third of the rows each: 3% rather than 2%)
    ratios = {k: s["prompt_ratio"] for k, s in plan["strata"].items()}
    assert all(abs(r - 1) <= 0.03 for r in ratios.values()), ratios
    assert {k.rsplit("/", 1)[1] for k in ratios} == {"think_max", "think_low", "no_think"}
    # every continuation rate the plan applies was measured by the pilot, none taken from the pooled fallback
    assert all(k.get("turns") for k in plan["continuation"]["kinds"].values()), plan["continuation"]
