"""Block verification (Sun et al. 2024, arXiv 2403.10444) and the served protocols of `regen eval`: the rule equal
to a reference written from the paper's Algorithm 2 on fixed tensors, the paper's own worked example, lossless by
exact enumeration and by seeded sampling through `sampled_rounds`, and never fewer accepted tokens than the
token-level rule."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from regen.train.eval import sampled_rounds, summarize
from regen.train.sampling import verify_sampled
from regen.train.verification import block_acceptance, parse_methods, verifier, verify_block

CHI2_DF26_P0005 = 56.4  # chi-square quantile, 26 degrees of freedom, p = 0.0005 (scipy.stats.chi2.ppf(0.9995, 26))


def paper_block_verification(drafts, q, p, eta):
    """Algorithm 2 of Sun et al. 2024 as printed, in plain floats: (tau, the bonus distribution as a list).

    p_0 = 1; p_i = min(p_{i-1} M_b(X_i | X^{i-1}) / M_s(X_i | X^{i-1}), 1); for i < gamma
    h_i = sum_x max(p_i M_b(x | X^i) - M_s(x | X^i), 0) / (that sum + 1 - p_i), h_gamma = p_gamma;
    tau = 0, and for i = 1..gamma: if eta_i <= h_i then tau = i; Y ~ p_res(tau) (the normalised max(...) term,
    or M_b(. | X^gamma) when tau = gamma)."""
    K, V = len(drafts), len(p[0])
    surv = [1.0]
    for i in range(1, K + 1):
        surv.append(min(surv[i - 1] * p[i - 1][drafts[i - 1]] / q[i - 1][drafts[i - 1]], 1.0))
    tau = 0
    for i in range(1, K + 1):
        if i == K:
            h = surv[K]
        else:
            mass = sum(max(surv[i] * p[i][x] - q[i][x], 0.0) for x in range(V))
            h = mass / (mass + 1.0 - surv[i]) if mass + 1.0 - surv[i] > 0 else 1.0
        if eta[i - 1] <= h:
            tau = i
    if tau == K:
        return tau, list(p[K])
    r = [max(surv[tau] * p[tau][x] - q[tau][x], 0.0) for x in range(V)]
    return tau, [v / sum(r) for v in r]


def _case(seed, V=5, K=3):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(K + 1, V, generator=g, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(K, V, generator=g, dtype=torch.float64) * 1.5, -1)
    drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(K)]
    return drafts, q, p


@pytest.mark.parametrize("seed", range(6))
def test_verify_block_equals_the_papers_algorithm_on_fixed_tensors(seed):
    drafts, q, p = _case(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    twin = torch.Generator().manual_seed(100 + seed)
    eta = torch.rand(len(drafts), generator=twin, dtype=torch.float64).tolist()  # verify_block's first draws
    tau, bonus_dist = paper_block_verification(drafts, q.tolist(), p.tolist(), eta)
    v = verify_block(drafts, q, p, [], gen)
    want_bonus = int(torch.multinomial(torch.tensor(bonus_dist), 1, generator=twin))
    assert (v.accepted, v.tau, v.proposed, v.stopped, v.bonus) == (tau, tau + 1, 3, False, want_bonus)
    _, residuals = block_acceptance(drafts, q, p)
    torch.testing.assert_close(residuals[tau], torch.tensor(bonus_dist, dtype=torch.float64))


def test_block_acceptance_on_hand_computed_tensors():
    """Two drafts over {0, 1}: p = (0.5, 0.5) everywhere, q = (0.8, 0.2), drafts (1, 0). a_1 = min(1, 0.5/0.2) = 1,
    a_2 = min(1, 0.5/0.8) = 0.625; m_1 = sum max(0, p - q) = 0.3, h_1 = 0.3 / (0.3 + 0) = 1; h_2 = a_2 = 0.625."""
    p = torch.tensor([[0.5, 0.5]] * 3, dtype=torch.float64)
    q = torch.tensor([[0.8, 0.2]] * 2, dtype=torch.float64)
    h, residuals = block_acceptance([1, 0], q, p)
    torch.testing.assert_close(h, torch.tensor([1.0, 0.625], dtype=torch.float64))
    torch.testing.assert_close(residuals[1], torch.tensor([0.0, 1.0], dtype=torch.float64))  # norm(max(0, p - q))
    torch.testing.assert_close(residuals[2], p[2])


def _exact_round(drafts_q, p_fn, anchor, K, V):
    """{committed tuple: probability} of one round and (E[accepted] block, E[accepted] token-level), by enumerating
    every draft block and the closed-form probability of each tau: P(tau = i) = h_i prod_{j > i} (1 - h_j)."""
    out, e_block, e_token = {}, 0.0, 0.0
    for block in itertools.product(range(V), repeat=K):
        prev, prob, qs = anchor, 1.0, []
        for d in block:
            qd = drafts_q(prev)
            prob *= float(qd[d])
            qs.append(qd)
            prev = d
        if prob == 0:
            continue
        ctx = [anchor, *block]
        p = torch.stack([p_fn(c) for c in ctx])
        h, residuals = block_acceptance(list(block), torch.stack(qs), p)
        for tau in range(K + 1):
            pt = (float(h[tau - 1]) if tau else 1.0) * math.prod(1 - float(h[j]) for j in range(tau, K))
            e_block += prob * pt * tau
            for y in range(V):
                key = (*block[:tau], y)
                out[key] = out.get(key, 0.0) + prob * pt * float(residuals[tau][y])
        run = 1.0
        for i, d in enumerate(block):  # token-level: P(accepted >= i + 1) = prod of min(1, p/q)
            run *= min(1.0, float(p[i, d]) / float(qs[i][d]))
            e_token += prob * run
    return out, e_block, e_token


def _markov(V, seed, scale=1.5):
    t = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale, -1)
    return lambda prev: t[int(prev)]


@pytest.mark.parametrize("K,drafting", [(2, "probabilistic"), (3, "probabilistic"), (3, "greedy")])
def test_block_verification_is_lossless_by_exact_enumeration(K, drafting):
    """For every continuation s of K + 1 tokens: sum over the round's outcomes o of P(o) * P_target(rest of s | o)
    equals P_target(s), the paper's losslessness (Theorem 1); and E[accepted] is >= the token-level rule's."""
    V = 3
    target, draft = _markov(V, 1), _markov(V, 2)
    if drafting == "greedy":  # q one-hot on the argmax: what vLLM's draft_sample_method "greedy" verifies against
        draft_q = lambda prev: torch.nn.functional.one_hot(draft(prev).argmax(), V).double()  # noqa: E731
    else:
        draft_q = draft
    for anchor in range(V):
        outcomes, e_block, e_token = _exact_round(draft_q, target, anchor, K, V)
        assert sum(outcomes.values()) == pytest.approx(1.0)
        for s in itertools.product(range(V), repeat=K + 1):
            want = math.prod(float(target(c)[x]) for c, x in zip((anchor, *s), s))
            got = sum(pr * math.prod(float(target(c)[x]) for c, x in zip((anchor, *s)[len(o):], s[len(o):]))
                      for o, pr in outcomes.items() if s[:len(o)] == o)
            assert got == pytest.approx(want, abs=1e-12), (anchor, s)
        assert e_block >= e_token - 1e-12, (anchor, e_block, e_token)


def test_the_papers_worked_example_block_accepts_11_9_against_10_9():
    """Sun et al. 2024, §1: binary vocabulary, context-free M_b = (1/3, 2/3), M_s = (2/3, 1/3), gamma = 2: token
    verification accepts 10/9 tokens per iteration in expectation, block verification 11/9."""
    mb = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
    ms = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    _, e_block, e_token = _exact_round(lambda prev: ms, lambda prev: mb, 0, 2, 2)
    assert e_token == pytest.approx(10 / 9) and e_block == pytest.approx(11 / 9)


class _Chain:
    """A toy target session whose logits depend on the previous token (the `sampled_rounds` session interface)."""

    def __init__(self, logits_fn):
        self.logits_fn, self.ids = logits_fn, []

    def prefill(self, prompt_ids):
        self.ids = list(prompt_ids)
        return self.logits_fn(self.ids[-1])

    def verify(self, ids):
        self.ids += list(ids)
        return torch.stack([self.logits_fn(t) for t in ids])

    def keep(self, n):
        self.ids = self.ids[:n]


def _generate(method, seed, *, K=2, V=3, n=3):
    logits = torch.log(torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(1),
                                                 dtype=torch.float64) * 1.5, -1))
    q_table = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 1.5,
                            -1)
    g = torch.Generator().manual_seed(seed)

    def propose(pos, seq):
        prev, toks, qs = seq[pos], [], []
        for _ in range(K):
            qs.append(q_table[prev])
            prev = int(torch.multinomial(q_table[prev], 1, generator=g))
            toks.append(prev)
        return toks, torch.stack(qs)

    rounds, seq = sampled_rounds(propose, _Chain(lambda t: logits[int(t)]), [0], max_new_tokens=n, temperature=1.0,
                                 top_p=1.0, stop_ids=(), generator=g, verify=verifier(method))
    return rounds, seq[1:1 + n], logits


def test_block_verification_through_sampled_rounds_follows_the_target_chi_square():
    """2,000 seeded generations of 3 tokens (V = 3, K = 2) with block verification: the 27 continuations follow the
    target's joint distribution (chi-square, 26 dof); the first round's mean accepted drafts is within 4 standard
    errors of its exact expectation, which is above the token-level rule's (one intra-op thread: tiny tensors)."""
    from train_helpers import one_torch_thread

    n_runs, V = 2000, 3
    counts, accepted = torch.zeros(V ** 3), []
    with one_torch_thread():
        for seed in range(n_runs):
            rounds, toks, logits = _generate("block", seed)
            assert len(toks) == 3
            accepted.append(float(rounds[0].accepted))
            counts[toks[0] * 9 + toks[1] * 3 + toks[2]] += 1
    p = torch.softmax(logits, -1)
    want = torch.tensor([float(p[0, a] * p[a, b] * p[b, c]) for a, b, c in itertools.product(range(V), repeat=3)])
    chi2 = float(((counts - n_runs * want) ** 2 / (n_runs * want)).sum())
    assert chi2 < CHI2_DF26_P0005, chi2
    q_table = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 1.5,
                            -1)
    exact = {"block": 0.0, "standard": 0.0}
    for first in range(V):  # the first round's anchor is the prefill token, drawn from p(. | 0)
        _, eb, et = _exact_round(lambda prev: q_table[int(prev)], lambda c: p[int(c)], first, 2, V)
        exact["block"] += float(p[0, first]) * eb
        exact["standard"] += float(p[0, first]) * et
    t = torch.tensor(accepted)
    assert float(t.mean()) == pytest.approx(exact["block"], abs=4 * float(t.std()) / math.sqrt(n_runs))
    assert exact["block"] > exact["standard"] + 0.01, exact


def test_verify_block_stop_rules_and_empty_block():
    p = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    v = verify_block([1, 0], p[:2], p, stop_ids=[0], generator=g)  # both kept (q = p): stop 0 at j = 2, no bonus
    assert (v.accepted, v.tau, v.proposed, v.stopped, v.bonus) == (2, 2, 2, True, None)
    v = verify_block([], p[:0], p[:1], stop_ids=[0], generator=g)  # nothing proposed: the bonus from p_1
    assert (v.accepted, v.tau, v.proposed, v.bonus) == (0, 1, 0, 1)
    v = verify_block([1, 2], p[:2], p, stop_ids=[0], generator=g)  # d_2 has p 0: a_2 = 0, tau = 1, bonus 0 (stop)
    assert (v.accepted, v.tau, v.proposed, v.stopped, v.bonus) == (1, 2, 2, True, 0)
    same = verify_sampled([1, 2], p[:2], p, stop_ids=[0], generator=torch.Generator().manual_seed(0))
    assert (same.accepted, same.bonus) == (1, 0)


def test_parse_methods_names_the_bad_value():
    from regen.errors import InputError

    assert parse_methods("probabilistic,greedy", "block") == [("probabilistic", "block"), ("greedy", "block")]
    with pytest.raises(InputError, match="--rejection-sample-method.*blok is not one of standard, block"):
        parse_methods("probabilistic", "blok")
    with pytest.raises(InputError, match="--draft-sample-method"):
        parse_methods("", "block")


def test_summaries_of_block_rounds_count_like_the_token_rule():
    """The rounds block verification returns are summarised by `summarize` as the token rule's are."""
    rounds, _, _ = _generate("block", 3, n=12)
    s = summarize(rounds, 2)
    assert s["num_rounds"] == len(rounds) and s["acc_len"] == sum(r.tau for r in rounds) / len(rounds)
    assert all(r.accepted <= r.proposed == 2 for r in rounds)
