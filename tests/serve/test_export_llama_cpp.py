"""The llama.cpp export (GGUF `dflash`) read back, the engine's budget rule, the lossless comparison, and a real
llama.cpp server loading the export beside the embedded target."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from regen.errors import InputError
from regen.serve.engines import export_draft
from regen.serve.engines import llama_cpp as gg
from regen.serve.engines.draft import EngineRefused
from regen.serve.engines.spec_eval import lossless
from regen.target.llama_cpp import version as xllamacpp_version
from regen.train.eval import replay_rounds

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smol_step(tmp_path_factory, model_dir):
    """The local profile's draft (random weights, a 4,096-token draft vocabulary) in a trainer-style folder."""
    from transformers import AutoConfig

    from regen.config import load_profile
    from regen.train.draft_config import build_draft_config
    from regen.train.model import DSparkDraft, save_draft

    cfg = build_draft_config(load_profile("local").train, AutoConfig.from_pretrained(model_dir))
    torch.manual_seed(0)
    draft = DSparkDraft(cfg)
    draft.set_draft_vocab(torch.randperm(cfg.vocab_size)[:cfg.draft_vocab_size])
    out = tmp_path_factory.mktemp("smol") / "step"
    save_draft(draft, out)
    return out


@pytest.mark.integration
def test_the_gguf_holds_the_draft_in_llama_cpps_names_and_conventions(smol_step, model_dir, tmp_path):
    import gguf
    from safetensors.torch import load_file

    rec = export_draft(smol_step, "llama.cpp", tmp_path / "out", target_gguf=model_dir / "engine-q8_0.gguf",
                       target_path=str(model_dir))
    r = gguf.GGUFReader(str(tmp_path / "out" / gg.GGUF_NAME))
    f = {k: v.contents() for k, v in r.fields.items()}
    cfg = json.loads((smol_step / "config.json").read_text())
    assert f["general.architecture"] == "dflash"
    assert list(f["dflash.target_layers"]) == [i + 1 for i in cfg["target_layer_ids"]] == [2, 15, 28]
    assert f["dflash.block_size"] == 7 and f["dflash.sample_from_anchor"] is True
    assert f["dflash.attention.causal"] is False and f["dflash.attention.key_length"] == cfg["head_dim"]
    assert f["tokenizer.ggml.mask_token_id"] == cfg["mask_token_id"] == 3
    target = gguf.GGUFReader(str(model_dir / "engine-q8_0.gguf"))
    assert f["tokenizer.ggml.tokens"] == target.fields["tokenizer.ggml.tokens"].contents()  # the vocabulary, whole
    t = {x.name: x for x in r.tensors}
    src = load_file(str(smol_step / "model.safetensors"))
    d2t = np.asarray(t["d2t"].data)
    ids = src["d2t"].numpy() + np.arange(cfg["draft_vocab_size"])  # EAGLE-3 offsets -> absolute target ids
    assert t["d2t"].tensor_type == gguf.GGMLQuantizationType.I64 and np.array_equal(d2t, ids)
    w = load_file(str(model_dir / "model.safetensors"))
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])  # SmolLM2 ties its head to the embedding
    assert np.array_equal(np.asarray(t["output.weight"].data), head[torch.as_tensor(ids)].numpy())
    assert np.array_equal(np.asarray(t["fc.weight"].data), src["context_proj.weight"].numpy())
    assert np.array_equal(np.asarray(t["markov_w2.weight"].data), src["markov_head.markov_w2.weight"].numpy())
    assert [int(x) for x in t["markov_w1.weight"].shape] == [cfg["markov_rank"], cfg["vocab_size"]]  # {r, V}
    assert rec["widths"]["spec_draft_n_max"] == 7 and "--spec-type" in rec["command"]
    sh = (tmp_path / "out" / "launch.sh").read_text()
    assert "  --spec-type draft-dspark \\\n" in sh and f"--model-draft {tmp_path.resolve() / 'out' / gg.GGUF_NAME}" in sh


def test_a_target_gguf_of_another_model_and_a_diverged_draft_are_refused(smol_step, model_dir, tmp_path):
    other = model_dir.parent / "gemma3-270m" / "engine-q8_0.gguf"
    if other.exists():
        with pytest.raises(EngineRefused, match="target_num_hidden_layers"):
            export_draft(smol_step, "llama.cpp", tmp_path / "x", target_gguf=other, target_path=str(model_dir))
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "diverged"
    bad.mkdir()
    (bad / "config.json").write_text((smol_step / "config.json").read_text())
    t = load_file(str(smol_step / "model.safetensors"))
    t["layers.0.mlp.up_proj.weight"][3, 4] = float("nan")
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(InputError, match="non-finite values in layers.0.mlp.up_proj.weight"):
        export_draft(bad, "vllm", tmp_path / "y", target_path=str(model_dir))
    assert not (tmp_path / "y").exists()


def _from(table):
    """propose(anchor) from a table of blocks per anchor (prompt length 0), None past its end."""
    return lambda pos: table[pos] if pos < len(table) else None


def test_the_engine_budget_rule_matches_llama_cpps_count():
    """A draft that is never right: llama.cpp drafted 77 tokens in 14 rounds for 16 generated tokens (measured on
    xllamacpp 2026.10.11549); the rule replays exactly that."""
    argmax = list(range(100, 200))
    table = [[0] * 7 for _ in range(100)]
    rounds = replay_rounds(_from(table), None, argmax, 0, n_predict=16, block_size=7, stop_ids=[])
    assert len(rounds) == 14 and sum(r.proposed for r in rounds) == 77
    assert all(r.accepted == 0 and r.tau == 1 for r in rounds)
    perfect = [[argmax[a + k] for k in range(7)] for a in range(90)]  # the draft proposes the target's tokens
    rounds = replay_rounds(_from(perfect), None, argmax, 0, n_predict=16, block_size=7, stop_ids=[])
    assert [r.accepted for r in rounds] == [7, 6] and sum(r.tau for r in rounds) == 15  # + the prefill token = 16
    with pytest.raises(ValueError, match="exactly one of"):
        replay_rounds(_from(table), None, argmax, 0, n_predict=16, max_new_tokens=16, block_size=7, stop_ids=[])


def test_lossless_names_the_first_difference_and_its_near_tie():
    ref = [{"prompt_id": "a", "tokens": [1, 2, 3], "top": [[(1, -0.1), (9, -3.0)], [(2, -0.70), (7, -0.72)], []]},
           {"prompt_id": "b", "tokens": [5, 6], "top": [[(5, -0.1), (8, -2.0)], [(6, -0.1), (4, -2.5)]]}]
    spec = [{"prompt_id": "a", "tokens": [1, 7, 3]}, {"prompt_id": "b", "tokens": [5, 4]}]
    out = lossless(ref, spec)
    assert out["identical"] == 0 and out["differing"] == 2
    a, b = out["first_differences"]
    assert a["position"] == 1 and a["near_tie"] and abs(a["logprob_gap"] - 0.02) < 1e-9
    assert b["position"] == 1 and not b["near_tie"]  # a 2.4-nat gap is no tie: a bug in the export or the engine
    assert out["differing_unexplained"] == 1 and a["kind"] == "near_tie" and b["kind"] == "second_choice"
    assert out["warning"].startswith("1 of 2 answers differ") and "b at token 1: second_choice" in out["warning"]
    assert lossless(ref[:1], [{"prompt_id": "a", "tokens": [1, 2, 3]}])["identical"] == 1
    assert lossless(ref[:1], [{"prompt_id": "a", "tokens": [1, 2, 3]}])["warning"] is None


@pytest.mark.parametrize("with_draft,stop_type,kind", [
    ([5, 4], None, "second_choice"),  # the target's second choice at a 2.4-nat gap: more than arithmetic flips
    ([5, 0], "eos", "stop_not_chosen"),  # ends on a stop token (0) the target did not choose there
    ([5, 3, 9], None, "other"),  # a token outside the target's top two
    ([5], "limit", "length"),  # the other answer's prefix
])
def test_each_difference_is_named_by_its_kind(with_draft, stop_type, kind):
    from regen.serve.engines.spec_eval import DIFFERENCE_KINDS

    ref = [{"prompt_id": "p", "tokens": [5, 6, 7], "top": [[(5, -0.1), (8, -2.0)], [(6, -0.1), (4, -2.5)], []]}]
    out = lossless(ref, [{"prompt_id": "p", "tokens": with_draft, "stop_type": stop_type}])
    (d,) = out["first_differences"]
    assert d["kind"] == kind and d["kind_means"] == DIFFERENCE_KINDS[kind] and out["kinds"][kind] == 1
    assert out["differing_unexplained"] == 1 and f"p at token {d['position']}: {kind}" in out["warning"]


def test_a_difference_the_target_alone_reproduces_in_one_batch_is_explained_and_others_are_not():
    """recheck_in_one_batch's answer decides: the token the draft's run took, taken by the target alone when the
    shared prefix is prefilled in one batch, is batched arithmetic (explained, counted, no warning); a recheck that
    takes the reference's token leaves the difference of its first kind, unexplained."""
    ref = [{"prompt_id": "p", "tokens": [5, 6, 7], "top": [[(5, -0.1), (8, -2.0)], [(6, -0.1), (4, -2.5)], []]},
           {"prompt_id": "q", "tokens": [5, 6, 7], "top": [[(5, -0.1), (8, -2.0)], [(6, -0.1), (4, -2.5)], []]}]
    spec = [{"prompt_id": "p", "tokens": [5, 3, 9]}, {"prompt_id": "q", "tokens": [5, 4]}]
    out = lossless(ref, spec, {"p": [(3, -0.4), (6, -0.5)], "q": [(6, -0.1), (4, -2.4)]})
    p, q = out["first_differences"]
    assert p["kind"] == "batched_arithmetic" and p["one_batch_top"] == [(3, -0.4), (6, -0.5)]
    assert p["shared_prefix"] == q["shared_prefix"] == [5]  # what bench/batch_vs_decode.py reproduces from
    assert q["kind"] == "second_choice" and out["differing_batched_arithmetic"] == 1
    assert out["differing_unexplained"] == 1 and "q at token 1" in out["warning"] and "p at" not in out["warning"]
    assert lossless(ref[:1], spec[:1], {"p": [(3, -0.4)]})["warning"] is None


@pytest.mark.integration
@pytest.mark.skipif(xllamacpp_version() is None, reason="xllamacpp is not installed (scripts/setup.sh)")
def test_llama_cpp_serves_the_export_beside_the_target_and_an_untrained_draft_is_accepted_about_never(
        smol_step, model_dir, tmp_path):
    from regen.config.serve import ServeConfig
    from regen.serve.engines.spec_eval import serve_and_measure, summarize_engine

    export_draft(smol_step, "llama.cpp", tmp_path / "out", target_gguf=model_dir / "engine-q8_0.gguf",
                 target_path=str(model_dir))
    prompts = [{"prompt_id": "p", "prompt_ids": [1, 9690, 198, 2683, 359, 253, 1135, 1353, 2, 198, 1, 4093, 198,
                                                  6463, 314, 253, 3142, 30, 2, 198, 1, 520, 9531, 198]}]
    res = serve_and_measure(ServeConfig(engine="llama.cpp", ctx_per_slot=512, threads=2), prompts, 24,
                            draft_gguf=tmp_path / "out" / gg.GGUF_NAME, log_path=tmp_path / "srv.log")
    log = (tmp_path / "srv.log").read_text()
    assert "adding speculative implementation 'draft-dspark'" in log, log[-3000:]
    assert "block_size=7, mask_token_id=3" in log  # read from the GGUF: dflash.block_size, the mask token
    s = summarize_engine(res, 7)
    assert res[0]["drafts"] > 0 and len(res[0]["tokens"]) == 24
    assert s["acc_len"] < 1.15, s  # random weights: nearly nothing accepted, yet every round drafted


@pytest.mark.integration
@pytest.mark.skipif(xllamacpp_version() is None, reason="xllamacpp is not installed (scripts/setup.sh)")
def test_the_recheck_asks_the_target_alone_at_the_first_difference_in_one_batch(tmp_path):
    """recheck_in_one_batch sends prompt + the shared prefix and reads the next position: at a position where the
    target is sure (top-2 gap over a nat), its one-batch top token is the one the reference decoded there, at the
    same log-probability within arithmetic; a near-tie difference is not rechecked (no request, no server)."""
    from regen.config.serve import ServeConfig
    from regen.serve.engines.spec_eval import recheck_in_one_batch, serve_and_measure

    cfg = ServeConfig(engine="llama.cpp", ctx_per_slot=512, threads=2)
    prompts = [{"prompt_id": "p", "prompt_ids": [1, 9690, 198, 2683, 359, 253, 1135, 1353, 2, 198, 1, 4093, 198,
                                                  6463, 314, 253, 3142, 30, 2, 198, 1, 520, 9531, 198]}]
    ref = serve_and_measure(cfg, prompts, 24, log_path=tmp_path / "alone.log", n_probs=2)
    a, top = ref[0]["tokens"], ref[0]["top"]
    i = next(j for j in range(4, len(a)) if top[j][0][1] - top[j][1][1] > 1.0)
    other = next(t for t in range(3, 100) if t not in (top[i][0][0], top[i][1][0]))
    got = recheck_in_one_batch(cfg, prompts, lossless(ref, [{"prompt_id": "p", "tokens": a[:i] + [other]}]),
                               log_path=tmp_path / "recheck.log")
    assert got["p"][0][0] == a[i] and abs(got["p"][0][1] - top[i][0][1]) < 0.05, (got, top[i])
    # bench/batch_vs_decode.py's two ways to the same position (its one-token-at-a-time path reuses the KV cache)
    spec = importlib.util.spec_from_file_location("batch_vs_decode", ROOT / "bench" / "batch_vs_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    step, batch = bench.tops_both_ways(cfg, prompts[0]["prompt_ids"], a[:i], tmp_path / "both.log")
    assert step[0][0] == batch[0][0] == a[i] and bench.max_delta(step, batch) < 0.5, (step, batch, top[i])
    tie = [{"prompt_id": "p", "tokens": a, "top": [[(a[0], -0.70), (7, -0.72)]] + top[1:]}]
    assert recheck_in_one_batch(cfg, prompts, lossless(tie, [{"prompt_id": "p", "tokens": [7]}]),
                                log_path=tmp_path / "x") == {}
