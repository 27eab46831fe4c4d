"""Rejection-sampling verification (`regen eval --temperature`): the sampler on small vectors, the round loop on
toy models with closed forms, the DSpark draft's per-slot proposal, and seeded end-to-end runs."""
from __future__ import annotations

import math

import pytest
import torch

from regen.train.eval import sampled_rounds, summarize
from regen.train.sampling import acceptance_closed_form, residual_distribution, sampling_probs, verify_sampled

CHI2_DF4_P0005 = 20.0  # chi-square quantile, 4 degrees of freedom, p ≈ 0.0005 (seeded draws: deterministic)


def test_sampling_probs_temperature_and_nucleus():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    torch.testing.assert_close(sampling_probs(logits, 1.0), torch.softmax(logits, -1))
    torch.testing.assert_close(sampling_probs(logits, 0.5), torch.softmax(logits * 2, -1))
    p = torch.softmax(logits, -1)  # 0.644, 0.237, 0.087, 0.032
    nucleus = sampling_probs(logits, 1.0, top_p=0.8)  # 0.644 < 0.8 -> the second token completes the nucleus
    torch.testing.assert_close(nucleus, torch.tensor([p[0], p[1], 0, 0]) / (p[0] + p[1]))
    assert sampling_probs(logits, 1.0, top_p=0.5).tolist() == [1.0, 0.0, 0.0, 0.0]  # the top token always stays
    for bad in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, 1.5)):
        with pytest.raises(ValueError):
            sampling_probs(logits, *bad)


def _exact_output(p, q):
    """P(committed token = x) of one speculative step, by enumeration over the drafted token y ~ q."""
    out = torch.zeros_like(p)
    res = residual_distribution(p, q)
    for y in range(len(p)):
        accept = min(1.0, float(p[y] / q[y])) if q[y] > 0 else 0.0
        out[y] += q[y] * accept
        out += q[y] * (1 - accept) * res
    return out


@pytest.mark.parametrize("case", range(4))
def test_residual_makes_the_output_exactly_the_target_by_enumeration(case):
    g = torch.Generator().manual_seed(case)
    p = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64) * 2, -1)
    if case == 2:
        q[0], q[1] = 0.0, q[1] + q[0]  # a token the draft never proposes: only the residual can emit it
    if case == 3:
        p = q.clone()  # draft == target: the residual has no mass and is never used
    torch.testing.assert_close(_exact_output(p, q), p)
    r = residual_distribution(p, q)
    want = (p - q).clamp(min=0)
    want = want / want.sum() if want.sum() > 1e-12 else p
    torch.testing.assert_close(r, want)
    assert float(r.sum()) == pytest.approx(1.0)


def test_verify_sampled_first_token_follows_the_target_chi_square():
    """verify_sampled itself (the function eval uses): 20,000 seeded rounds of one drafted token from q; the
    committed token (the accepted draft or the bonus) is distributed as p_t (chi-square, 4 dof)."""
    p = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05], dtype=torch.float64)
    q = torch.tensor([0.10, 0.10, 0.50, 0.00, 0.30], dtype=torch.float64)  # over- and under-proposes, one zero
    g = torch.Generator().manual_seed(0)
    n, counts = 20000, torch.zeros(5)
    accepted = 0
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g))
        v = verify_sampled([d], q[None], torch.stack([p, p]), [], g)
        tok = d if v.accepted == 1 else v.bonus
        counts[tok] += 1
        accepted += v.accepted
        assert (v.tau, v.proposed) == (v.accepted + 1, 1)
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < CHI2_DF4_P0005, (chi2, counts.tolist())
    alpha = acceptance_closed_form(p, q)  # 0.1 + 0.1 + 0.2 + 0 + 0.05 = 0.45
    assert alpha == pytest.approx(0.45)
    assert accepted / n == pytest.approx(alpha, abs=4 * math.sqrt(alpha * (1 - alpha) / n))


def test_verify_sampled_stop_rules():
    p = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    g = torch.Generator().manual_seed(0)
    v = verify_sampled([1, 0], p[:2], p, stop_ids=[0], generator=g)  # stop token 0 accepted at j = 2: no bonus
    assert (v.accepted, v.tau, v.proposed, v.stopped, v.bonus) == (2, 2, 2, True, None)
    v = verify_sampled([1, 2], p[:2], p, stop_ids=[0], generator=g)  # d_2 = 2 has p_t 0: rejected, bonus 0 (stop)
    assert (v.accepted, v.tau, v.proposed, v.stopped, v.bonus) == (1, 2, 2, True, 0)
    v = verify_sampled([], p[:0], p[:1], stop_ids=[0], generator=g)  # nothing proposed: the bonus from p_t
    assert (v.accepted, v.tau, v.proposed, v.bonus) == (0, 1, 0, 1)


class ToySession:
    """A toy target for `sampled_rounds`: logits depend on the previous token only (a Markov chain)."""

    def __init__(self, logits_fn):
        self.logits_fn, self.ids = logits_fn, []

    def prefill(self, prompt_ids):
        self.ids = list(prompt_ids)
        return self.logits_fn(self.ids[-1])

    def verify(self, ids):
        self.ids += list(ids)
        return torch.stack([self.logits_fn(t) for t in ids])

    def keep(self, n):
        assert n <= len(self.ids)
        self.ids = self.ids[:n]


def _chain(V, seed=0):
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 1.5
    return lambda prev: table[int(prev)]


def _run(propose_fn, logits_fn, *, seed, K=4, max_new_tokens=24, temperature=1.0, stop_ids=()):
    g = torch.Generator().manual_seed(seed)
    session = ToySession(logits_fn)

    def propose(pos, seq):
        prev, toks, qs = seq[pos], [], []
        for _ in range(K):
            q = propose_fn(prev)
            prev = int(torch.multinomial(q, 1, generator=g))
            toks.append(prev)
            qs.append(q)
        return toks, torch.stack(qs)

    return sampled_rounds(propose, session, [3, 1], max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=1.0, stop_ids=stop_ids, generator=g)


def test_draft_equal_to_target_is_accepted_at_every_position():
    V, K, T = 6, 4, 0.7
    logits_fn = _chain(V)
    rounds = []
    for seed in range(20):
        r, seq = _run(lambda prev: sampling_probs(logits_fn(prev), T), logits_fn, seed=seed, K=K, temperature=T)
        rounds += r
        assert len(seq) == 2 + 1 + sum(x.tau for x in r)
    s = summarize(rounds, K)
    assert all(s["accept_rate"][str(k)] == 1.0 for k in range(K))
    assert s["acc_len"] == K + 1


def test_uniform_draft_matches_the_closed_form():
    """i.i.d. target p, uniform draft q = 1/V: per-slot acceptance α = Σ_x min(p(x), 1/V) independently, so
    accept_rate@k = α^(k+1) and acc_len = (1 − α^(K+1)) / (1 − α). 300 seeds x 6 rounds = 1,800 rounds: each
    figure within 4 standard errors (binomial for the rates; the sample std of τ for acc_len)."""
    V, K = 8, 4
    logits = torch.tensor([3.0, 2.0, 1.5, 1.0, 0.0, -1.0, -1.0, -2.0], dtype=torch.float64)
    p = torch.softmax(logits, -1)
    uniform = torch.full((V,), 1.0 / V, dtype=torch.float64)
    alpha = acceptance_closed_form(p, uniform)
    assert alpha == pytest.approx(float(torch.minimum(p, uniform).sum())) and 0.3 < alpha < 0.8
    rounds = []
    for seed in range(300):
        rounds += _run(lambda prev: uniform, lambda prev: logits, seed=seed, K=K, max_new_tokens=6)[0]
    n = len(rounds)
    s = summarize(rounds, K)
    for k in range(K):
        a = alpha ** (k + 1)
        assert s["accept_rate"][str(k)] == pytest.approx(a, abs=4 * math.sqrt(a * (1 - a) / n)), k
    taus = torch.tensor([float(r.tau) for r in rounds])
    want = (1 - alpha ** (K + 1)) / (1 - alpha)
    assert s["acc_len"] == pytest.approx(want, abs=4 * float(taus.std()) / math.sqrt(n))


def test_sampled_rounds_are_reproducible_and_seed_dependent():
    V, K = 6, 4
    logits_fn = _chain(V, seed=1)
    q_fn = lambda prev: torch.full((V,), 1.0 / V, dtype=torch.float64)  # noqa: E731
    a = _run(q_fn, logits_fn, seed=5, K=K)
    assert a == _run(q_fn, logits_fn, seed=5, K=K)
    assert a[1] != _run(q_fn, logits_fn, seed=6, K=K)[1]


def test_dspark_proposal_distribution_is_the_markov_corrected_one_at_the_drawn_tokens():
    """q_k = softmax((U_k + W2·W1[x_(k−1)]) / T) with x_(k−1) the token drawn at slot k−1 (spec §2/§3)."""
    from test_dspark_model import tiny_cfg

    from regen.train.model import DSparkDraft

    torch.manual_seed(0)
    d = DSparkDraft(tiny_cfg(block_size=4)).eval()
    with torch.no_grad():
        d.markov_head.markov_w2.weight.normal_(0, 2.0)  # a strong Markov bias: q_k depends on x_(k−1)
    taps = torch.randn(9, 3 * 64)
    T = 0.8
    toks, _, q = d.propose(taps, 17, 9, temperature=T, generator=torch.Generator().manual_seed(3), return_probs=True)
    toks2, _, q2 = d.propose(taps, 17, 9, temperature=T, generator=torch.Generator().manual_seed(3), return_probs=True)
    assert torch.equal(toks, toks2) and torch.equal(q, q2)
    with torch.no_grad():
        ids = torch.tensor([[17, *[d.config.mask_token_id] * 3]])
        h = d.backbone(d.context(taps[None]), ids, torch.arange(9)[None], (9 + torch.arange(4))[None])[0]
        U = d.base_logits(h)
        prev = [17, *toks[:-1].tolist()]
        for k in range(4):
            want = torch.softmax((U[k] + d.markov_bias(torch.tensor(prev[k]))) / T, -1)
            torch.testing.assert_close(q[k], want)
            assert q[k, toks[k]] > 0
    greedy, _, onehot = d.propose(taps, 17, 9, return_probs=True)
    assert torch.equal(greedy, d.propose(taps, 17, 9)[0])
    assert torch.equal(onehot.argmax(-1), greedy) and onehot.sum().item() == 4


def test_reduced_vocabulary_proposal_has_no_mass_outside_it():
    from test_dspark_model import tiny_cfg

    from regen.train.model import DSparkDraft

    torch.manual_seed(0)
    d = DSparkDraft(tiny_cfg(block_size=3, draft_vocab_size=40)).eval()
    vocab = torch.arange(5, 45)
    d.set_draft_vocab(vocab)
    toks, _, q = d.propose(torch.randn(6, 3 * 64), 9, 6, temperature=1.0, generator=torch.Generator().manual_seed(0),
                           return_probs=True)
    assert q.shape == (3, d.config.vocab_size) and torch.allclose(q.sum(-1), torch.ones(3))
    outside = torch.ones(d.config.vocab_size, dtype=torch.bool)
    outside[vocab] = False
    assert float(q[:, outside].abs().sum()) == 0.0 and all(5 <= t < 45 for t in toks.tolist())
