"""The reduced draft vocabulary (EAGLE-3 d2t/t2d): selection, the model's mapping, the loss over it, training."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_dspark_model import tiny_cfg

from regen.train.draft_vocab import select_draft_vocab
from regen.train.loss import dspark_loss
from regen.train.model import DSparkDraft, load_draft, save_draft


def test_selection_takes_forced_then_most_frequent_then_lowest_unseen_ids():
    counts = np.zeros(32, dtype=np.int64)
    counts[[7, 3, 20, 9]] = [50, 10, 10, 1]  # 3 and 20 tie: the lower id ranks first
    ids, report = select_draft_vocab(counts, 3, always=[31])
    assert ids.tolist() == [3, 7, 31]
    assert report == {"size": 3, "distinct_seen": 4, "supervised_tokens": 71, "coverage": 60 / 71}
    ids, report = select_draft_vocab(counts, 7)
    assert ids.tolist() == [0, 1, 2, 3, 7, 9, 20]  # the 4 seen + the 3 lowest unseen
    assert report["coverage"] == 1.0
    with pytest.raises(ValueError, match="size 0"):
        select_draft_vocab(counts, 0)
    with pytest.raises(ValueError, match="always-included"):
        select_draft_vocab(counts, 2, always=[1, 2, 3])


def _reduced(ids, **kw):
    cfg = tiny_cfg(draft_vocab_size=len(ids), **kw)
    torch.manual_seed(0)
    d = DSparkDraft(cfg)
    d.set_draft_vocab(torch.tensor(ids))
    return d


def test_mapping_follows_the_eagle3_convention_and_round_trips_through_a_checkpoint(tmp_path):
    ids = [1, 5, 6, 300, 511]
    d = _reduced(ids)
    assert d.lm_head.weight.shape == (5, 64) and d.markov_head.markov_w2.weight.shape == (5, 16)
    assert d.markov_head.markov_w1.weight.shape == (512, 16)  # the previous token is a target id
    assert (torch.arange(5) + d.d2t).tolist() == ids  # target = draft index + d2t[draft index]
    assert d.t2d.sum() == 5 and d.t2d[ids].all()
    assert d.to_target_ids(torch.tensor([0, 3, 4])).tolist() == [1, 300, 511]
    assert d.to_draft_index(torch.tensor([511, 1, 6])).tolist() == [4, 0, 2]
    assert d.in_draft_vocab(torch.tensor([5, 7])).tolist() == [True, False]
    with pytest.raises(ValueError, match="outside the draft vocabulary"):
        d.to_draft_index(torch.tensor([7]))
    with pytest.raises(ValueError, match="want draft_vocab_size=5"):
        d.set_draft_vocab(torch.tensor([1, 2, 3]))
    save_draft(d, tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 5 and cfg["vocab_size"] == 512
    back = load_draft(tmp_path / "ckpt", target_model=_FakeTarget(d.config))
    assert torch.equal(back.d2t, d.d2t) and torch.equal(back.t2d, d.t2d)
    # the frozen lm_head is the target's rows at the draft vocabulary, restored from the target
    assert torch.equal(back.lm_head.weight, _FakeTarget(d.config).head.weight[ids])


class _FakeTarget:
    """Just what `copy_frozen_from` reads of an HF causal LM: input and output embeddings."""

    def __init__(self, cfg):
        g = torch.Generator().manual_seed(7)
        self.emb = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g))
            self.head.weight.copy_(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g))

    def get_input_embeddings(self):
        return self.emb

    def get_output_embeddings(self):
        return self.head


def test_from_target_needs_the_vocabulary_and_copies_its_rows():
    cfg = tiny_cfg(draft_vocab_size=4)
    target = _FakeTarget(cfg)
    with pytest.raises(ValueError, match="needs the draft vocabulary"):
        DSparkDraft.from_target(target, cfg)
    d = DSparkDraft.from_target(target, cfg, draft_vocab=torch.tensor([9, 2, 40, 3]))
    assert torch.equal(d.lm_head.weight, target.head.weight[[2, 3, 9, 40]])
    assert torch.equal(d.embed_tokens.weight, target.emb.weight)


def test_proposals_are_target_ids_inside_the_vocabulary_with_the_markov_step_on_target_ids():
    ids = list(range(0, 512, 4))  # 128 ids; the mask token 511 is not among them (it is only an input)
    d = _reduced(ids)
    with torch.no_grad():  # base logits 0; Markov bias 100 on rows whose id ≡ prev + 4 (mod 16)
        d.lm_head.weight.zero_()
        d.markov_head.markov_w1.weight.zero_()
        d.markov_head.markov_w1.weight[torch.arange(512), torch.arange(512) % 16] = 1.0
        d.markov_head.markov_w2.weight.zero_()
        for row, t in enumerate(ids):
            d.markov_head.markov_w2.weight[row, (t - 4) % 16] = 100.0
    taps = torch.randn(10, 3 * 64)
    tokens, _ = d.propose(taps, anchor_token=8, anchor_pos=10)
    # argmax = the lowest such id: 8 -> 12 -> 0 -> 4 -> ...; a draft index as the previous token would break it
    assert tokens.tolist() == [12, 0, 4, 8, 12, 0, 4]
    seq_taps = torch.cat([taps, torch.randn(1, 3 * 64)])[None]  # position 10 (the anchor's) is masked out
    batch_tokens, _ = d.propose_batch(seq_taps, torch.full((1, 11), 8), torch.tensor([[10]]))
    assert batch_tokens[0, 0].tolist() == tokens.tolist()


def test_loss_over_a_reduced_vocabulary_is_the_full_draft_restricted_to_its_rows():
    """CE and L1 over Vd rows = the full-vocabulary draft's logits taken at those rows and renormalised
    (EAGLE-3's restricted target distribution), with the same backbone weights."""
    from test_dspark_loss import _batch

    batch, feats = _batch()
    ids = torch.unique(torch.cat([batch["input_ids"].flatten(), torch.arange(0, 512, 3)]))
    torch.manual_seed(0)
    full = DSparkDraft(tiny_cfg(block_size=4))
    red = DSparkDraft(tiny_cfg(block_size=4, draft_vocab_size=ids.numel()))
    red.set_draft_vocab(ids)
    sd = full.state_dict()
    sd["lm_head.weight"] = sd["lm_head.weight"][ids]
    sd["markov_head.markov_w2.weight"] = sd["markov_head.markov_w2.weight"][ids]
    sd.update({"d2t": red.d2t, "t2d": red.t2d})
    red.load_state_dict(sd)
    anchors, keep = torch.tensor([[5, 10], [6, 16]]), torch.ones(2, 2, dtype=torch.bool)
    _, m = dspark_loss(red, batch, feats, anchors, keep)
    with torch.no_grad():
        h = full(feats[0], batch["input_ids"], anchors, keep)
    ce = l1 = den = 0.0
    x, lm = batch["input_ids"], batch["loss_mask"]
    for b in range(2):
        for n in range(2):
            a = int(anchors[b, n])
            for k in range(4):
                if a + k + 1 >= x.shape[1] or lm[b, a + k + 1] == 0:
                    break
                w = float(np.exp(-k / 4.0))
                prev, tgt = x[b, a + k], x[b, a + k + 1]
                with torch.no_grad():
                    p_d = (full.base_logits(h[b, n, k]) + full.markov_head(prev))[ids].softmax(-1)
                p_t = full.base_logits(feats[1][b, a + k])[ids].softmax(-1)
                ce += w * -float(p_d[(ids == tgt).nonzero()[0, 0]].log())
                l1 += w * float((p_d - p_t).abs().sum())
                den += w
    assert m["ce"] == pytest.approx(ce / den, rel=1e-4) and m["l1"] == pytest.approx(l1 / den, rel=1e-4)
    # a supervised target outside the vocabulary must have been masked out by the caller
    small = _reduced([1, 2, 3], block_size=4)
    with pytest.raises(ValueError, match="outside the draft vocabulary"):
        dspark_loss(small, batch, feats, anchors, keep)


@pytest.mark.integration
def test_training_with_a_draft_vocabulary_counts_training_rows_and_resumes_with_it(tiny_run, tmp_path):
    import shutil

    from test_train import samples, train_cfg, weights

    from regen.rundir import RunDir
    from regen.train.feed import FeedConfig, ShardFeed
    from regen.train.loop import run_train

    profile, run_dir = tiny_run
    cfg = train_cfg(profile, max_steps=5, draft_vocab_size=200, log_samples=True)
    counts = ShardFeed(run_dir / "shards", FeedConfig.from_train(cfg)).supervised_token_counts(512)
    ids, report = select_draft_vocab(counts, 200, always=[1])
    other = tmp_path / "other"
    shutil.copytree(run_dir / "shards", other / "shards")
    s = run_train(cfg, RunDir.at(run_dir))
    assert s["draft_vocab"] == {**report, "shards_counted": 3} and 0 < report["coverage"] < 1  # 200 of 512 ids
    w = weights(run_dir)
    assert (torch.arange(200) + w["d2t"]).tolist() == ids.tolist()
    run_train(cfg, RunDir.at(other), stop_after_steps=2)
    again = run_train(cfg, RunDir.at(other))
    assert again["draft_vocab"]["size"] == 200 and "from" in again["draft_vocab"]
    assert samples(other) == samples(run_dir)
    for k, v in weights(other).items():
        torch.testing.assert_close(v, w[k], rtol=1e-5, atol=1e-6, msg=k)
    from regen.errors import InputError

    with pytest.raises(InputError, match="draft_vocab_size=200, the profile gives 100"):
        run_train(train_cfg(profile, max_steps=6, draft_vocab_size=100), RunDir.at(run_dir))


@pytest.mark.integration
def test_follow_waits_for_the_first_shard_to_choose_the_vocabulary(tmp_path, tiny_target):
    import threading
    import time

    from test_train import samples
    from train_helpers import ShardWriter, make_rows, write_profile

    from regen.config import load_profile
    from regen.rundir import RunDir
    from regen.train.loop import run_train

    writer = ShardWriter(tmp_path / "run")
    cfg = load_profile(str(write_profile(tmp_path / "p.yaml", tiny_target, max_steps=1000, epochs=1,
                                         log_samples=True, draft_vocab_size=300, follow_poll_s=0.1,
                                         follow_timeout_s=60))).train

    def produce():
        for k in (0, 1):
            time.sleep(1.0)
            writer.add(make_rows(16, seed=k, prefix=f"s{k}"))
        time.sleep(0.5)
        writer.write_manifest(True)

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    s = run_train(cfg, RunDir.at(tmp_path / "run"), follow=True)  # no manifest yet when it starts
    t.join()
    assert s["draft_vocab"]["shards_counted"] == 1 and s["draft_vocab"]["size"] == 300
    assert {sid for step in samples(tmp_path / "run") for sid in step} == {r["sample_id"] for r in writer.rows}
