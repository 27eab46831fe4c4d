"""acc_len (spec §7): the worked example on a scripted verifier, the replay, held-out split, `regen eval` end to end."""
from __future__ import annotations

import json

import pytest
import torch

from regen.train.eval import Round, replay_rounds, score_round, summarize
from regen.train.heldout import is_heldout

EOS = 0


def test_worked_example_of_spec_section_7():
    E, F, G, X = 11, 12, 13, 99  # prefill token D = 10 is not counted
    r1 = score_round([E, F, X, 1, 2, 3, 4], [E, F, G, 5, 6, 7, 8, 9], [EOS])  # 2 accepted, bonus G
    r2 = score_round([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [EOS])  # all 7, bonus = 8th argmax
    r3 = score_round([EOS, 5, 5, 5, 5, 5, 5], [EOS], [EOS])  # stop accepted at j = 1: no bonus
    assert (r1.accepted, r1.tau, r1.stopped) == (2, 3, False)
    assert (r2.accepted, r2.tau) == (7, 8)
    assert r3 == Round(accepted=1, tau=1, proposed=1, stopped=True)
    s = summarize([r1, r2, r3], block_size=7)
    assert s["acc_len"] == pytest.approx(4.0)
    assert s["accept_rate"]["0"] == pytest.approx(3 / 3)
    assert s["accept_rate"]["2"] == pytest.approx(1 / 2)
    assert s["num_rounds"] == 3 and s["accepted_draft_tokens"] == 10


def test_stop_bonus_ends_generation_with_the_bonus_counted():
    r = score_round([5, 6, 7], [5, EOS, 1, 1], [EOS])
    assert r == Round(accepted=1, tau=2, proposed=3, stopped=True)


def test_replay_with_oracle_scripted_and_stop():
    K = 4
    prompt = [7, 7, 7]
    gen = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, EOS]
    seq = prompt + gen
    argmax = seq[1:] + [EOS]
    oracle = lambda pos: (argmax[pos: pos + K] + [2] * K)[:K]  # noqa: E731
    rounds = replay_rounds(oracle, seq, argmax, len(prompt), max_new_tokens=100, block_size=K, stop_ids=[EOS])
    # anchor 20 (prefill token, uncounted): 21..24 + bonus 25 | 26..29 + bonus 30 | EOS accepted at j=1
    assert [r.tau for r in rounds] == [5, 5, 1] and rounds[-1].stopped
    wrong = lambda pos: [1] * K  # noqa: E731
    rounds = replay_rounds(wrong, seq, argmax, len(prompt), max_new_tokens=100, block_size=K, stop_ids=[EOS])
    assert all(r.tau == 1 for r in rounds) and len(rounds) == len(gen) - 1  # one token per round until EOS
    rounds = replay_rounds(wrong, seq, argmax, len(prompt), max_new_tokens=4, block_size=K, stop_ids=[EOS])
    assert len(rounds) == 4


def test_heldout_split_is_deterministic_and_sized():
    ids = [f"prompt-{i}" for i in range(4000)]
    held = [p for p in ids if is_heldout(p, 0.05)]
    assert 150 < len(held) < 250
    assert held == [p for p in ids if is_heldout(p, 0.05)]
    assert not any(is_heldout(p, 0.0) for p in ids[:100]) and all(is_heldout(p, 1.0) for p in ids[:100])
    assert set(held) <= {p for p in ids if is_heldout(p, 0.1)}  # nested: a larger fraction keeps these out too


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=512, eos_token_id=1, pad_token_id=0)
    model = Qwen3ForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=[1], pad_token_id=0)
    d = tmp_path_factory.mktemp("target")
    model.save_pretrained(d)
    return d


@pytest.mark.integration
def test_regen_eval_end_to_end_on_a_tiny_target(tmp_path, tiny_target_dir, shard_writer):
    from train_helpers import make_rows

    from regen.config.train import TrainConfig
    from regen.rundir import RunDir
    from regen.train.eval import run_eval
    from regen.train.model import DSparkDraft, save_draft, small_config_for_target
    from regen.train.target import TargetContract, TargetFeatures

    shard_writer.add(make_rows(6, seed=1, vocab=512, min_len=20, max_len=40), complete=True)
    run = RunDir.at(shard_writer.dir.parent)
    tf = TargetFeatures.from_pretrained(tiny_target_dir, TargetContract((0, 2)))
    dcfg = small_config_for_target(tf.config, target_layer_ids=(0, 2), num_hidden_layers=1, markov_rank=8,
                                   block_size=4)
    torch.manual_seed(1)
    save_draft(DSparkDraft.from_target(tf.model, dcfg), tmp_path / "ckpt")
    cfg = TrainConfig(target=str(tiny_target_dir), heldout_fraction=1.0, target_layer_ids=[0, 2])
    out = run_eval(cfg, run, draft_dir=tmp_path / "ckpt", seed=3, num_prompts=3, max_new_tokens=12, progress=False)
    saved = json.loads((run.root / "eval.json").read_text())
    assert saved["num_prompts"] == 3 and saved["seed"] == 3
    for name in ("trained", "untrained"):
        s = saved[name]
        assert s["num_rounds"] > 0 and 1.0 <= s["acc_len"] <= 5.0
        assert set(s["per_category"]) == {"math"} and set(s["accept_rate"]) == {"0", "1", "2", "3"}
    assert out["trained"]["acc_len"] == saved["trained"]["acc_len"]
    from regen.cli import main

    rc = main(["eval", "--run", str(run.root), "--draft", str(tmp_path / "ckpt"), "--num-prompts", "1",
               "--max-new-tokens", "4", "--set", f"train.target={tiny_target_dir}",
               "--set", "train.heldout_fraction=1.0", "--set", "train.target_layer_ids=[0, 2]"])
    assert rc == 0 and json.loads((run.root / "eval.json").read_text())["num_prompts"] == 1
    # without --draft: the run's own training directory (its latest step), as after `regen train`
    import shutil

    shutil.copytree(tmp_path / "ckpt", run.train, dirs_exist_ok=True)
    rc = main(["eval", "--run", str(run.root), "--num-prompts", "2", "--max-new-tokens", "4",
               "--set", f"train.target={tiny_target_dir}", "--set", "train.heldout_fraction=1.0",
               "--set", "train.target_layer_ids=[0, 2]"])
    assert rc == 0 and json.loads((run.root / "eval.json").read_text())["num_prompts"] == 2
    from regen.train.target import ContractError

    with pytest.raises(ContractError, match="target_layer_ids"):
        run_eval(TrainConfig(target=str(tiny_target_dir), heldout_fraction=1.0, target_layer_ids=[0, 1]), run,
                 draft_dir=tmp_path / "ckpt", num_prompts=1, max_new_tokens=4, progress=False)


def test_eval_compares_an_ablation_on_the_same_prompts(tmp_path, tiny_target_dir, shard_writer):
    """`--compare markov_rank_0=DIR`: another draft measured beside trained/untrained, written where asked."""
    from train_helpers import make_rows

    from regen.config.train import TrainConfig
    from regen.rundir import RunDir
    from regen.train.eval import run_eval
    from regen.train.model import DSparkDraft, save_draft, small_config_for_target
    from regen.train.target import TargetContract, TargetFeatures

    shard_writer.add(make_rows(4, seed=2, vocab=512, min_len=20, max_len=40), complete=True)
    run = RunDir.at(shard_writer.dir.parent)
    tf = TargetFeatures.from_pretrained(tiny_target_dir, TargetContract((0, 2)))
    for rank, name in ((8, "main"), (0, "markov0")):
        dcfg = small_config_for_target(tf.config, target_layer_ids=(0, 2), markov_rank=rank, block_size=4)
        save_draft(DSparkDraft.from_target(tf.model, dcfg), tmp_path / name)
    cfg = TrainConfig(target=str(tiny_target_dir), heldout_fraction=1.0, target_layer_ids=[0, 2])
    out = run_eval(cfg, run, draft_dir=tmp_path / "main", num_prompts=2, max_new_tokens=8, progress=False,
                   compare={"markov_rank_0": tmp_path / "markov0"}, out_path=tmp_path / "ablation.json")
    saved = json.loads((tmp_path / "ablation.json").read_text())
    assert not (run.root / "eval.json").exists()
    assert set(saved["drafts"]) == {"trained", "untrained", "markov_rank_0"}
    assert saved["drafts"]["markov_rank_0"]["markov_rank"] == 0 and saved["drafts"]["trained"]["markov_rank"] == 8
    assert saved["markov_rank_0"]["num_rounds"] > 0 and out["markov_rank_0"]["acc_len"] >= 1.0
    from regen.errors import InputError

    for name in ("untrained", "seed", "drafts"):  # names that would overwrite eval.json's own keys
        with pytest.raises(InputError, match="reserved"):
            run_eval(cfg, run, draft_dir=tmp_path / "main", num_prompts=1, max_new_tokens=4, progress=False,
                     compare={name: tmp_path / "markov0"})
    dcfg = small_config_for_target(tf.config, target_layer_ids=(0, 2), markov_rank=8, block_size=7)
    save_draft(DSparkDraft.from_target(tf.model, dcfg), tmp_path / "block7")
    with pytest.raises(InputError, match="block_size 7"):
        run_eval(cfg, run, draft_dir=tmp_path / "main", num_prompts=1, max_new_tokens=4, progress=False,
                 compare={"b7": tmp_path / "block7"})
    with pytest.raises(InputError, match="--compare gone="):
        run_eval(cfg, run, draft_dir=tmp_path / "main", num_prompts=1, max_new_tokens=4, progress=False,
                 compare={"gone": tmp_path / "nowhere"})


def test_oracle_draft_on_a_real_target_reaches_full_blocks(tiny_target_dir):
    """The replay against a real target: a draft that returns the target's own greedy tokens gets τ = K+1."""
    from regen.train.eval import greedy_reference
    from regen.train.target import TargetContract, TargetFeatures

    tf = TargetFeatures.from_pretrained(tiny_target_dir, TargetContract((0, 2)))
    seq, argmax, taps = greedy_reference(tf, [5, 6, 7, 8], 30, [1])
    assert taps.shape[0] == len(seq) and argmax[3] == seq[4]
    K = 4
    rounds = replay_rounds(lambda pos: argmax[pos: pos + K], seq, argmax, 4, max_new_tokens=20, block_size=K,
                           stop_ids=[1])
    assert rounds and all(r.tau == K + 1 for r in rounds if not r.stopped)


def test_batched_greedy_continuations_equal_one_prompt_at_a_time(tiny_target_dir):
    """`greedy_continuations` (left-padded, one batch) gives each prompt the sequence, argmax and taps its own
    generation gives, a row that stops early included (cut at its stop, not padded to the longest)."""
    from regen.train.eval import greedy_continuations, greedy_reference
    from regen.train.target import TargetContract, TargetFeatures

    tf = TargetFeatures.from_pretrained(tiny_target_dir, TargetContract((0, 2)))
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17]]
    free = greedy_reference(tf, prompts[1], 20, [1])[0]
    stop = [free[len(prompts[1]) + 3]]  # the 4th new token of the second prompt: that row stops there
    single = [greedy_reference(tf, p, 20, stop) for p in prompts]
    generated = greedy_continuations(tf, prompts, 20, stop)
    batched = [greedy_reference(tf, p, 20, stop, sequence=g) for p, g in zip(prompts, generated)]
    assert generated[1][-1] == stop[0] and len(generated[1]) <= len(prompts[1]) + 4
    for (seq, argmax, taps), (bseq, bargmax, btaps) in zip(single, batched):
        assert bseq == seq and bargmax == argmax
        assert torch.allclose(btaps, taps, atol=1e-5)
    assert max(len(g) for g in generated) > len(generated[1])  # the others ran past the early stop


def test_confidence_threshold_cuts_blocks():
    from test_dspark_model import tiny_cfg

    from regen.train.eval import proposal_table
    from regen.train.model import DSparkDraft

    d = DSparkDraft(tiny_cfg(block_size=4))
    with torch.no_grad():
        d.confidence_head.proj.weight.zero_()
        d.confidence_head.proj.bias.fill_(torch.logit(torch.tensor(0.3)).item())
    seq = list(range(10, 30))
    taps = torch.randn(len(seq), 3 * 64)
    assert [len(b) for b in proposal_table(d, taps, seq, 5)] == [4] * 15
    assert [len(b) for b in proposal_table(d, taps, seq, 5, confidence_threshold=0.2)] == [4] * 15
    assert proposal_table(d, taps, seq, 5, confidence_threshold=0.5) == [[]] * 15
    r = score_round([], [7], [0])
    assert r == Round(accepted=0, tau=1, proposed=0, stopped=False)


def test_target_session_cache_equals_a_full_forward(tiny_target_dir):
    """The cached verify passes (with a rejected tail cropped) give the logits and taps of one full pass."""
    from regen.train.eval import TargetSession
    from regen.train.target import TargetContract, TargetFeatures

    tf = TargetFeatures.from_pretrained(tiny_target_dir, TargetContract((0, 2)))
    s = TargetSession(tf)
    s.prefill([5, 6, 7, 8])
    s.verify([9, 10, 11, 12])
    s.keep(6)  # commits 9, 10; 11, 12 rejected
    logits = s.verify([40, 41, 42])
    s.keep(8)
    assert s.ids == [5, 6, 7, 8, 9, 10, 40, 41] and s.cache.get_seq_length() == 8 and s.taps.shape[0] == 8
    seq = torch.tensor([[5, 6, 7, 8, 9, 10, 40, 41, 42]])
    taps, last = tf.features(seq)
    torch.testing.assert_close(logits, tf.logits(last[0])[6:9], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s.taps, taps[0, :8], rtol=1e-4, atol=1e-4)


def test_target_as_its_own_draft_is_accepted_at_every_position(tiny_target_dir):
    """Rejection sampling against the real target with a draft that draws from the target's own distributions
    (a full forward per slot): every drafted token is accepted, so acc_len = K + 1."""
    from regen.train.eval import TargetSession, sampled_rounds
    from regen.train.sampling import sampling_probs
    from regen.train.target import TargetContract, TargetFeatures

    tf = TargetFeatures.from_pretrained(tiny_target_dir, TargetContract((0, 2)))
    K, T = 3, 1.0
    g = torch.Generator().manual_seed(0)

    def propose(pos, seq):
        ctx, toks, qs = list(seq[: pos + 1]), [], []
        for _ in range(K):
            q = sampling_probs(tf.logits(tf.features(torch.tensor([ctx]))[1][0, -1]), T)
            ctx.append(int(torch.multinomial(q, 1, generator=g)))
            toks.append(ctx[-1])
            qs.append(q)
        return toks, torch.stack(qs)

    rounds, seq = sampled_rounds(propose, TargetSession(tf), [5, 6, 7, 8], max_new_tokens=16, temperature=T,
                                 top_p=1.0, stop_ids=[], generator=g)
    s = summarize(rounds, K)
    assert s["num_rounds"] == 4 and all(s["accept_rate"][str(k)] == 1.0 for k in range(K))
    assert s["acc_len"] == K + 1 and len(seq) == 4 + 1 + 16


@pytest.mark.integration
def test_regen_eval_at_temperature_is_seeded_and_keeps_greedy(tmp_path, tiny_target_dir, shard_writer):
    from train_helpers import make_rows

    from regen.config.train import TrainConfig
    from regen.errors import InputError
    from regen.rundir import RunDir
    from regen.train.eval import run_eval
    from regen.train.model import DSparkDraft, save_draft, small_config_for_target
    from regen.train.target import TargetContract, TargetFeatures

    shard_writer.add(make_rows(4, seed=3, vocab=512, min_len=20, max_len=40), complete=True)
    run = RunDir.at(shard_writer.dir.parent)
    tf = TargetFeatures.from_pretrained(tiny_target_dir, TargetContract((0, 2)))
    dcfg = small_config_for_target(tf.config, target_layer_ids=(0, 2), markov_rank=8, block_size=4)
    torch.manual_seed(1)
    save_draft(DSparkDraft.from_target(tf.model, dcfg), tmp_path / "ckpt")
    cfg = TrainConfig(target=str(tiny_target_dir), heldout_fraction=1.0, target_layer_ids=[0, 2])
    kw = dict(draft_dir=tmp_path / "ckpt", num_prompts=2, max_new_tokens=10, progress=False)
    greedy = run_eval(cfg, run, seed=3, out_path=tmp_path / "g.json", **kw)
    a = run_eval(cfg, run, seed=3, temperature=1.0, top_p=0.9, out_path=tmp_path / "a.json", **kw)
    served = [("probabilistic", "standard"), ("probabilistic", "block"), ("greedy", "block")]
    b = run_eval(cfg, run, seed=3, temperature=1.0, top_p=0.9, out_path=tmp_path / "b.json", methods=served, **kw)
    c = run_eval(cfg, run, seed=4, temperature=1.0, top_p=0.9, out_path=tmp_path / "c.json", **kw)
    assert "sampled" not in greedy and greedy["temperature"] == 0.0
    for name in ("trained", "untrained"):
        assert a[name] == greedy[name]  # the top-level (T = 0) figures are the greedy ones, unchanged
        assert a["sampled"][name] == b["sampled"][name]  # same seed: the same draws
        s = a["sampled"][name]
        assert s["num_rounds"] > 0 and 1.0 <= s["acc_len"] <= 5.0 and set(s["per_category"]) == {"math"}
    assert c["sampled"]["protocol"]["seed"] == 4
    assert (c["sampled"]["trained"], c["sampled"]["untrained"]) != (a["sampled"]["trained"], a["sampled"]["untrained"])
    proto = a["sampled"]["protocol"]
    assert (proto["temperature"], proto["top_p"], proto["seed"]) == (1.0, 0.9, 3)
    assert "min(1, p_t(d_k)/q_k(d_k))" in proto["verification"] and "max(0, p_t - q_k)" in proto["verification"]
    for bad in (dict(temperature=-1.0), dict(temperature=1.0, top_p=0.0), dict(methods=served[1:])):
        with pytest.raises(InputError, match="--temperature"):
            run_eval(cfg, run, seed=3, **kw, **bad)
    # the served protocols (draft_sample_method x rejection_sample_method) on the same streams as "sampled"
    assert list(b["served"]) == ["probabilistic+standard", "probabilistic+block", "greedy+block"]
    assert b["served"]["probabilistic+standard"]["trained"] == a["sampled"]["trained"]
    for key, (dm, rm) in zip(b["served"], served):
        res = b["served"][key]
        assert (res["protocol"]["draft_sample_method"], res["protocol"]["rejection_sample_method"]) == (dm, rm)
        assert res["trained"]["num_rounds"] > 0 and 1.0 <= res["trained"]["acc_len"] <= 5.0
    assert "arXiv 2403.10444" in b["served"]["probabilistic+block"]["protocol"]["verification"]
    assert b["served"]["probabilistic+block"]["trained"] != b["served"]["greedy+block"]["trained"]


def test_eval_refuses_a_checkpoint_of_another_rope_theta(tmp_path, tiny_target_dir, shard_writer):
    """The checkpoint's RoPE base is a checked serving field: a profile expecting another one is an InputError
    naming both values, for the draft and for a --compare draft, before the target loads."""
    from train_helpers import make_rows

    from regen.config.train import TrainConfig
    from regen.errors import InputError
    from regen.rundir import RunDir
    from regen.train.eval import run_eval
    from regen.train.model import DSparkDraft, save_draft, small_config_for_target
    from regen.train.target import TargetContract, TargetFeatures

    shard_writer.add(make_rows(2, seed=4, vocab=512, min_len=20, max_len=40), complete=True)
    run = RunDir.at(shard_writer.dir.parent)
    tf = TargetFeatures.from_pretrained(tiny_target_dir, TargetContract((0, 2)))
    for name, theta in (("a", 10000.0), ("b", 50000.0)):
        dcfg = small_config_for_target(tf.config, target_layer_ids=(0, 2), markov_rank=8, block_size=4,
                                       rope_parameters={"rope_type": "default", "rope_theta": theta})
        save_draft(DSparkDraft.from_target(tf.model, dcfg), tmp_path / name)
    kw = dict(num_prompts=1, max_new_tokens=4, progress=False, out_path=tmp_path / "e.json")
    cfg = TrainConfig(target=str(tiny_target_dir), heldout_fraction=1.0, target_layer_ids=[0, 2], rope_theta=50000)
    with pytest.raises(InputError, match=r"rope_theta is 10000, the profile's train.rope_theta expects 50000"):
        run_eval(cfg, run, draft_dir=tmp_path / "a", **kw)
    with pytest.raises(InputError, match=r"--compare other=.*rope_theta is 10000.*expects 50000"):
        run_eval(cfg, run, draft_dir=tmp_path / "b", compare={"other": tmp_path / "a"}, **kw)
    assert run_eval(cfg, run, draft_dir=tmp_path / "b", **kw)["rope_theta"] == 50000.0
    unset = TrainConfig(target=str(tiny_target_dir), heldout_fraction=1.0, target_layer_ids=[0, 2])
    assert run_eval(unset, run, draft_dir=tmp_path / "a", **kw)["rope_theta"] == 10000.0  # nothing expected
