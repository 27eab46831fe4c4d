"""The exports checked by the engines' own code at their pinned versions.

Each engine runs in its own process (tests/serve/engine_driver.py): TokenSpeed 0.1.1 and SGLang 0.5.23 from their
wheels in `.engines/` (scripts/setup.sh), vLLM 0.32 in `.venv-vllm` (its CPU build; REGEN_VLLM=1 setup). The engine
reads the exported config with its own config reader and validator, derives its launch widths with its own rules,
resolves the model class from `architectures` in its own registry, builds that class on the CPU and loads the export
with its own `load_weights`; the test then compares every engine parameter with the exported tensor it must hold.
A missing engine skips with the reason; an installed engine of another version fails (the contract was checked
against the pinned one).

Drafts: a small K3-shaped draft (every K3 field: MLA with q-LoRA, fc_norm, the attn_res stream, YaRN, Markov and
confidence heads, small dimensions) and the `local` profile's draft (GQA, SmolLM2's shape, a 4,096-token draft
vocabulary), plus a draft written by the trainer itself on the tests' tiny target.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from regen.serve.engines import ENGINES, export_draft, sglang, support, tokenspeed, vllm
from regen.serve.engines.draft import EngineRefused
from regen.train.model import DSparkDraft, kimi_k3_config, save_draft

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "serve" / "engine_driver.py"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
K3_TARGET = {"hidden_size": 256, "num_hidden_layers": 8, "vocab_size": 1000}
SMOL_TARGET = {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152}


def run_engine(engine: str, export: Path, target: dict, tmp_path: Path) -> dict:
    """The driver's JSON result for `engine` on `export` (skips when the engine is not installed)."""
    if engine == "vllm":
        python = VLLM_PYTHON
        if not python.exists():
            pytest.skip("vLLM's CPU venv .venv-vllm is missing (REGEN_VLLM=1 bash scripts/setup.sh builds it)")
    else:
        python = Path(sys.executable)
        if not (ROOT / ".engines" / engine).is_dir():
            pytest.skip(f".engines/{engine} is missing: bash scripts/setup.sh installs the {engine} wheel there")
    tj = tmp_path / f"target-{engine}.json"
    tj.write_text(json.dumps(target))
    proc = subprocess.run([str(python), str(DRIVER), engine, str(export), str(tj)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ENGINE_RESULT ")), None)
    assert line, f"driver printed no result (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    res = json.loads(line[len("ENGINE_RESULT "):])
    assert "crash" not in res, res.get("traceback") or res
    pinned = ENGINES[engine].PINNED_VERSION
    assert res["version"] == pinned, (f"{engine} {res['version']} is installed but the export's contract was "
                                      f"checked against {pinned}: re-read the engine's contract and update "
                                      f"regen.serve.engines.{ENGINES[engine].__name__.rsplit('.', 1)[-1]}")
    return res


def k3_draft(tmp_path: Path, **overrides) -> Path:
    """A trainer-style folder (save_draft) of a small K3-shaped draft with non-trivial norms."""
    fields = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, q_lora_rank=64,
                  kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, vocab_size=1000,
                  target_hidden_size=256, target_num_hidden_layers=8, target_layer_ids=(1, 3, 5, 6),
                  mask_token_id=997, markov_rank=16, max_position_embeddings=4096, eos_token_id=(2,), pad_token_id=0)
    fields.update(overrides)
    cfg = kimi_k3_config(**fields)
    torch.manual_seed(0)
    draft = DSparkDraft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight") or name.startswith("fc_norm"):
                p.uniform_(0.5, 1.5)  # distinguishable from the engines' initial ones
    out = tmp_path / "k3-step"
    save_draft(draft, out)
    return out


def local_draft(tmp_path: Path, model_dir: Path, *, draft_vocab_size: int = 4096) -> Path:
    """The local profile's draft (regen.train.draft_config.build_draft_config on SmolLM2's config), random weights."""
    from transformers import AutoConfig

    from regen.config import load_profile
    from regen.train.draft_config import build_draft_config

    cfg = build_draft_config(load_profile("local", [f"train.draft_vocab_size={draft_vocab_size}"]).train,
                             AutoConfig.from_pretrained(model_dir))
    assert cfg.attention_type == "gqa" and not cfg.fc_norm, "the local profile trains the draft llama.cpp serves"
    torch.manual_seed(0)
    draft = DSparkDraft(cfg)
    if draft_vocab_size:
        draft.set_draft_vocab(torch.randperm(cfg.vocab_size)[:draft_vocab_size])
    out = tmp_path / f"local-step-{draft_vocab_size}"
    save_draft(draft, out)
    return out


@pytest.mark.integration
def test_tokenspeed_serves_the_k3_export_with_fc_norm_and_the_attn_res_stream(tmp_path):
    export = tmp_path / "tokenspeed"
    rec = export_draft(k3_draft(tmp_path), "tokenspeed", export)
    res = run_engine("tokenspeed", export, K3_TARGET, tmp_path)
    assert res["config_class"] == "KimiK3DSparkConfig" and res["architectures"] == ["K3DSparkModel"]
    assert res["validate"] == "ok"  # validate_k3_dspark_config, against the target's shape too
    assert res["block_size_read"] == 7 and res["widths_derived"] == [7, 8]
    assert res["launch_widths"] == "ok"  # the launch's --speculative-num-steps/--num-draft-tokens pass its check
    assert rec["widths"]["speculative_num_steps"] == 7 and rec["widths"]["speculative_num_draft_tokens"] == 8
    assert res["aux_hidden_stream"] == "attn_res" and res["fc_norm"] is True and res["resolved_rope_theta"] == 50000.0
    assert res["model_class"].endswith("kimi_k3_dspark.K3DSparkModel")
    assert res["load_weights"] == "ok"
    v = res["values"]
    assert v["differ"] == [] and v["missing"] == [] and v["engine_params_not_from_export"] == [], v
    assert any(n.startswith("fc_norm.") for n in res["params"]) and v["equal"] == len(res["params"])


@pytest.mark.integration
def test_tokenspeed_own_checks_refuse_what_regen_refuses(tmp_path):
    """The refusals are the engine's: an export forced past regen's check fails the engine's own code."""
    export = tmp_path / "forced"
    export_draft(k3_draft(tmp_path), "tokenspeed", export)
    cfg = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**cfg, "q_lora_rank": 0}))
    res = run_engine("tokenspeed", export, K3_TARGET, tmp_path)
    assert "q-LoRA" in res["validate"]["message"]
    (export / "config.json").write_text(json.dumps({**cfg, "target_num_hidden_layers": 6}))
    res = run_engine("tokenspeed", export, K3_TARGET, tmp_path)
    assert "out of range" in res["validate"]["message"] or "does not match" in res["validate"]["message"]
    (export / "config.json").write_text(json.dumps({**cfg, "block_size": 6}))
    assert "requires --speculative-num-steps 6" in run_engine("tokenspeed", export, K3_TARGET, tmp_path)[
        "launch_widths"]["message"]  # a width typed for another block size raises at launch


@pytest.mark.integration
def test_vllm_serves_the_k3_export_and_refuses_fc_norm(tmp_path):
    with pytest.raises(EngineRefused, match="vllm: fc_norm=True: vLLM 0.32's K3 draft has no fc_norm"):
        export_draft(k3_draft(tmp_path), "vllm", tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    export = tmp_path / "vllm"
    rec = export_draft(k3_draft(tmp_path, fc_norm=False), "vllm", export)
    assert rec["env"] == {"VLLM_KIMI_K3_AUX_ATTN_RES_STREAM": "1"}  # vLLM reads the stream from the environment
    assert rec["speculative_config"]["num_speculative_tokens"] == 7
    res = run_engine("vllm", export, K3_TARGET, tmp_path)
    assert res["config"] == "ok" and res["config_class"] == "K3DSparkConfig"
    assert res["model_class"].endswith("dspark_mla.K3DSparkForCausalLM")
    assert res["aux_layer_ids"] == [2, 4, 6, 7]  # vLLM's aux ids = regen's + 1: the same layer outputs
    assert res["load_weights"] == "ok"
    v = res["values"]
    assert v["differ"] == [] and v["missing"] == [] and v["engine_params_not_from_export"] == [], v
    # regen's refusal is vLLM's own: the fc_norm tensors forced into the file fail its loader
    from safetensors.torch import load_file, save_file

    t = load_file(str(export / "model.safetensors"))
    save_file({**t, "fc_norm.0.weight": torch.ones(256)}, str(export / "model.safetensors"))
    assert "fc_norm" in run_engine("vllm", export, K3_TARGET, tmp_path)["load_weights"]["message"]


@pytest.mark.integration
def test_vllm_serves_the_local_gqa_export_with_its_draft_vocabulary(tmp_path, model_dir):
    export = tmp_path / "vllm-gqa"
    rec = export_draft(local_draft(tmp_path, model_dir), "vllm", export, target_path=str(model_dir))
    assert rec["layout"] == "qwen3"
    res = run_engine("vllm", export, SMOL_TARGET, tmp_path)
    assert res["config_class"] == "Qwen3Config" and res["architectures"] == ["Qwen3DSparkModel"]
    assert res["model_class"].endswith("qwen3_dspark.Qwen3DSparkForCausalLM")
    assert res["aux_layer_ids"] == [2, 15, 28]  # the local taps [1, 14, 27] + 1 in vLLM's numbering
    assert res["load_weights"] == "ok"
    v = res["values"]
    assert v["differ"] == [] and v["missing"] == [], v
    # shared from the target at serving time (vLLM's load_dspark_model), or an unused placeholder
    assert set(v["engine_params_not_from_export"]) <= {"model.embed_tokens.weight", "model.mask_embedding"}
    assert "draft_id_to_target_id" in res["params"] and res["params"]["lm_head.weight"][0] >= 4096


@pytest.mark.integration
def test_sglang_serves_the_full_vocabulary_gqa_export_and_refuses_a_reduced_one(tmp_path, model_dir):
    with pytest.raises(EngineRefused, match="sglang: draft_vocab_size=4096"):
        export_draft(local_draft(tmp_path, model_dir), "sglang", tmp_path / "refused")
    export = tmp_path / "sglang"
    rec = export_draft(local_draft(tmp_path, model_dir, draft_vocab_size=0), "sglang", export)
    res = run_engine("sglang", export, SMOL_TARGET, tmp_path)
    p = res["parsed"]
    assert p["gamma"] == 7 and p["target_layer_ids"] == [1, 14, 27] and p["mask_token_id"] == 3
    assert p["num_target_layers"] == 30 and p["markov_rank"] == 32 and p["markov_head_type"] == "vanilla"
    assert res["runtime"]["gamma"] == 7 == rec["widths"]["gamma"]  # SGLang's own width rule on the launch's flag
    assert res["model_class"].endswith("dspark.Qwen3DSparkModel") and res["load_weights"] == "ok"
    v = res["values"]
    assert v["differ"] == [] and v["missing"] == [] and v["engine_params_not_from_export"] == [], v


@pytest.mark.integration
def test_no_engine_takes_a_trainer_step_folder_for_a_model_of_its_own(tmp_path, model_dir):
    """The trainer's folders name no engine class: each engine's config reader refuses them outright."""
    step = k3_draft(tmp_path)
    cfg = json.loads((step / "config.json").read_text())
    assert "architectures" not in cfg and cfg["model_type"] == "regen_dspark"
    for engine in ("tokenspeed", "vllm"):
        res = run_engine(engine, step, K3_TARGET, tmp_path)
        assert isinstance(res["config"], dict) and "regen_dspark" in res["config"]["message"], (engine, res)


def test_support_names_every_engine_for_the_profiles_drafts():
    from types import SimpleNamespace

    from regen.config import load_profile
    from regen.train.draft_config import build_draft_config

    k3 = build_draft_config(load_profile("kimi-k3").train,
                            SimpleNamespace(hidden_size=7168, num_hidden_layers=93, vocab_size=163840))
    s = support(k3)
    assert s["tokenspeed"] == []  # the mission's draft: TokenSpeed serves it as trained
    assert [r.field for r in s["vllm"]] == ["fc_norm"]
    assert {r.field for r in s["llama.cpp"]} >= {"attention_type", "fc_norm", "aux_hidden_stream"}
    assert [r.field for r in s["sglang"]] == ["attention_type"]
    assert tokenspeed.launch(k3)["widths"]["speculative_num_draft_tokens"] == 8
    assert vllm.launch(k3)["env"] == {"VLLM_KIMI_K3_AUX_ATTN_RES_STREAM": "1"}
    assert sglang.refusals(k3)[0].remedy.startswith("serve an MLA draft with TokenSpeed")
