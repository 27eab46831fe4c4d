"""DSpark loss pieces from the spec's §5 rules: anchors, block mask, evaluation mask, weights, combination."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_dspark_model import tiny_cfg

from regen.train.loss import (
    chain_expectation,
    create_block_attention_mask,
    decay_weights,
    dspark_loss,
    evaluation_mask,
    sample_anchors,
)
from regen.train.model import DSparkDraft


def test_block_attention_mask_worked_example():
    S, K = 6, 3
    anchors = torch.tensor([[2, 4]])
    keep = torch.tensor([[True, False]])
    m = create_block_attention_mask(anchors, keep, S, K)
    assert m.shape == (1, 2 * K, S + 2 * K) and m.dtype == torch.bool
    row = [1, 1, 0, 0, 0, 0] + [1, 1, 1] + [0, 0, 0]  # ctx j < a=2 (strict), its own 3 slots, nothing else
    for q in range(K):
        assert m[0, q].int().tolist() == row
    assert not m[0, K:].any()  # padded (dummy) block fully masked
    # with keep on, block 2 sees j < 4 and its own slots only
    m2 = create_block_attention_mask(anchors, torch.tensor([[True, True]]), S, K)
    assert m2[0, K].int().tolist() == [1, 1, 1, 1, 0, 0] + [0, 0, 0] + [1, 1, 1]
    # padding in the context is masked too
    am = torch.tensor([[0, 1, 1, 1, 1, 1]])
    assert create_block_attention_mask(anchors, keep, S, K, attention_mask=am)[0, 0, :2].tolist() == [False, True]


def test_anchors_valid_count_sorted_padded_and_seeded():
    lm = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0, 0, 0],
                       [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]])
    # valid i: lm[i] = lm[i+1] = 1 and i <= S-2 -> row 0: {1, 2, 5}; row 1: {7, 8}
    a, keep = sample_anchors(lm, num_anchors=512, generator=torch.Generator().manual_seed(0))
    assert a.shape == (2, 3)  # padded to the batch max valid count
    assert a[0].tolist() == [1, 2, 5] and keep[0].all()
    assert a[1, :2].tolist() == [7, 8] and keep[1].tolist() == [True, True, False]
    lm2 = torch.ones(3, 200)
    a1, k1 = sample_anchors(lm2, 16, torch.Generator().manual_seed(7))
    a2, _ = sample_anchors(lm2, 16, torch.Generator().manual_seed(7))
    assert a1.shape == (3, 16) and k1.all() and torch.equal(a1, a2)
    assert (a1.diff(dim=1) > 0).all() and a1.max() <= 198 and a1.min() >= 0
    a3, k3 = sample_anchors(torch.zeros(2, 5), 4)
    assert a3.shape == (2, 1) and not k3.any()


def test_evaluation_mask_is_a_contiguous_supervised_prefix():
    lm = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 1]])
    anchors = torch.tensor([[1, 5, 0]])
    keep = torch.tensor([[True, True, False]])
    ev = evaluation_mask(anchors, keep, lm, 4)
    # anchor 1 predicts x2 (lm 1), x3 (lm 0) -> stop; anchor 5 predicts x6, x7, then past the end
    assert ev[0].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    w = decay_weights(7, 4.0)
    assert w[0] == 1.0 and w[3].item() == pytest.approx(math.exp(-3 / 4))


def test_tau_probabilistic_chain():
    c = torch.tensor([[[0.5, 0.5, 1.0], [1.0, 1.0, 1.0]]])
    ev = torch.tensor([[[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]])
    keep = torch.tensor([[True, True]])
    # block 1: 0.5 + 0.25 + 0.25 ; block 2: 1 (only one evaluated slot) -> 1 + (1.0 + 1.0) / 2
    assert chain_expectation(c, ev, keep) == pytest.approx(2.0)


def _batch(S=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 500, (2, S), generator=g)
    lm = torch.ones(2, S)
    lm[:, :4] = 0
    lm[1, 18:] = 0
    return {"input_ids": ids, "loss_mask": lm}, (torch.randn(2, S, 3 * 64, generator=g), torch.randn(2, S, 64, generator=g))


def test_loss_combination_matches_a_direct_computation():
    torch.manual_seed(0)
    d = DSparkDraft(tiny_cfg(block_size=4))
    batch, feats = _batch()
    anchors = torch.tensor([[5, 10], [6, 16]])
    keep = torch.tensor([[True, True], [True, True]])
    loss, m = dspark_loss(d, batch, feats, anchors, keep)
    assert loss.item() == pytest.approx(0.1 * m["ce"] + 0.9 * m["l1"] + 1.0 * m["conf"], rel=1e-5)
    # direct, slot by slot
    ids, lm = batch["input_ids"], batch["loss_mask"]
    h = d(feats[0], ids, anchors, keep)
    num = {"ce": 0.0, "l1": 0.0, "conf": 0.0}
    den = 0.0
    for b in range(2):
        for n in range(2):
            a = anchors[b, n].item()
            for k in range(4):
                if a + k + 1 >= 24 or lm[b, a + k + 1] == 0:
                    break  # cumulative product: the rest of the block is off
                w = math.exp(-k / 4.0)
                prev, tgt = ids[b, a + k], ids[b, a + k + 1]
                logits = d.base_logits(h[b, n, k]) + d.markov_head(prev)
                p_d = logits.softmax(-1)
                p_t = d.base_logits(feats[1][b, a + k]).softmax(-1)  # target state at a+k (spec: a+k-1, 1-based)
                l1 = (p_d - p_t).abs().sum()
                c_star = (1 - 0.5 * l1).clamp(0, 1)
                c = d.confidence_logits(h[b, n, k], prev)
                num["ce"] += w * -p_d[tgt].log().item()
                num["l1"] += w * l1.item()
                num["conf"] += w * F.binary_cross_entropy_with_logits(c, c_star).item()
                den += w
    for k in num:
        assert m[k] == pytest.approx(num[k] / den, rel=1e-4), k
    assert m["num_slots"] == 4 + 4 + 4 + 1  # anchor 16 of row 1 sees only x17 before loss_mask ends at 18


def test_dummy_blocks_are_finite_and_gradients_reach_trainable_parts_only():
    torch.manual_seed(0)
    d = DSparkDraft(tiny_cfg(fc_norm=True))
    batch, feats = _batch()
    anchors = torch.tensor([[5, 0], [6, 0]])
    keep = torch.tensor([[True, False], [True, False]])
    loss, m = dspark_loss(d, batch, feats, anchors, keep)
    loss.backward()
    assert torch.isfinite(loss) and m["num_blocks"] == 2
    assert d.embed_tokens.weight.grad is None and d.lm_head.weight.grad is None
    for name in ("context_proj.weight", "fc_norm.0.weight", "markov_head.markov_w1.weight",
                 "confidence_head.proj.weight", "layers.0.self_attn.kv_b_proj.weight"):
        g = dict(d.named_parameters())[name].grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, name


@pytest.mark.integration
def test_tiny_draft_learns_a_deterministic_sequence():
    """Sanity: on a language cycling through 8 tokens, with a target whose p_t says so, the loss falls and the
    teacher-forced acceptance chain grows."""
    torch.manual_seed(0)
    d = DSparkDraft(tiny_cfg(num_hidden_layers=1, block_size=4))
    with torch.no_grad():  # an informative frozen vocabulary (the default std 0.02 makes every logit ~0)
        d.lm_head.weight.normal_(std=0.3)
        d.embed_tokens.weight.normal_(std=0.3)
    opt = torch.optim.AdamW(d.trainable_parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    hist = []
    for step in range(80):
        ids = 10 + (torch.randint(0, 8, (4, 1), generator=g) + torch.arange(33)[None]) % 8
        nxt, ids = ids[:, 1:], ids[:, :-1]
        batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
        taps = d.embed_tokens.weight[ids].repeat(1, 1, 3)
        last = 3.0 * d.lm_head.weight[nxt]  # p_t peaks on the next token
        loss, m = dspark_loss(d, batch, (taps, last), generator=g)
        opt.zero_grad()
        loss.backward()
        opt.step()
        hist.append(m)
    first, last_m = hist[0], hist[-1]
    assert last_m["loss"] < 0.5 * first["loss"]
    assert last_m["tau_teacher_forced"] > first["tau_teacher_forced"] + 0.5


@pytest.mark.parametrize("extra", [{}, {"markov_rank": 0}, {"final_logit_softcapping": 3.0}])
def test_fused_and_chunked_vocabulary_terms_equal_plain_autograd(extra):
    torch.manual_seed(0)
    d = DSparkDraft(tiny_cfg(block_size=4, **extra))
    with torch.no_grad():
        d.lm_head.weight.normal_(std=0.3)  # informative logits, so the terms and gradients are not trivial
    batch, feats = _batch()
    anchors, keep = torch.tensor([[5, 10], [6, 12]]), torch.ones(2, 2, dtype=torch.bool)
    runs = []
    for fused, chunk in ((False, None), (False, 3), (True, None), (True, 3)):
        d.zero_grad()
        loss, m = dspark_loss(d, batch, feats, anchors, keep, chunk_slots=chunk, fused=fused)
        loss.backward()
        runs.append((loss.detach(), m, {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}))
    l0, m0, g0 = runs[0]
    assert set(g0) >= {"context_proj.weight", "confidence_head.proj.weight"}
    for li, mi, gi in runs[1:]:
        torch.testing.assert_close(li, l0)
        assert mi["tau_teacher_forced"] == m0["tau_teacher_forced"]
        assert mi["ce"] == pytest.approx(m0["ce"], rel=1e-5) and mi["l1"] == pytest.approx(m0["l1"], rel=1e-5)
        assert set(gi) == set(g0)
        for n in g0:
            torch.testing.assert_close(gi[n], g0[n], msg=n, atol=1e-6, rtol=1e-4)


def test_tau_probabilistic_counts_only_blocks_with_a_supervised_slot():
    """The loss mask changes after the anchors are drawn (a reduced draft vocabulary drops the target at a+1):
    that block keeps `keep` True but has no supervised slot, and the reference (DS `loss.py`: valid blocks =
    keep ∧ any(eval)) leaves it out of tau_probabilistic's mean instead of counting it as τ = 1."""
    c = torch.tensor([[[0.5, 0.5, 1.0], [0.9, 0.9, 0.9], [0.8, 0.8, 0.8]]])
    ev = torch.tensor([[[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]])
    keep = torch.tensor([[True, True, True]])
    assert chain_expectation(c, ev, keep) == pytest.approx(1 + (1.0 + 0.8) / 2)  # not 1 + 1.8 / 3

    torch.manual_seed(0)
    d = DSparkDraft(tiny_cfg(block_size=4))
    batch, feats = _batch()
    anchors = torch.tensor([[5, 10], [6, 12]])
    keep = torch.ones(2, 2, dtype=torch.bool)
    _, before = dspark_loss(d, batch, feats, anchors, keep)
    masked = {**batch, "loss_mask": batch["loss_mask"].clone()}
    masked["loss_mask"][0, 11] = 0  # after the draw: anchor 10's first target (x11) leaves the loss
    masked["loss_mask"][1, 7] = 0  # and anchor 6's first target (x7)
    _, after = dspark_loss(d, masked, feats, anchors, keep)
    assert before["num_supervised_blocks"] == 4 and after["num_supervised_blocks"] == 2 and after["num_blocks"] == 4
    ev = evaluation_mask(anchors, keep, masked["loss_mask"], 4)
    assert ev[0, 1].sum() == 0 and ev[1, 0].sum() == 0 and ev[0, 0].sum() == 4 and ev[1, 1].sum() == 4
    # = the mean over the two supervised blocks alone (the same blocks, the others switched off)
    _, only = dspark_loss(d, masked, feats, anchors, torch.tensor([[True, False], [False, True]]))
    assert only["num_blocks"] == 2 and after["tau_probabilistic"] == pytest.approx(only["tau_probabilistic"])
    unsupervised_as_one = 1 + (only["tau_probabilistic"] - 1) * 2 / 4  # the old denominator: all kept blocks
    assert after["tau_probabilistic"] > unsupervised_as_one + 0.01
