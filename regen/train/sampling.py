"""Speculative rejection sampling: the verification rule of `regen eval --temperature T` (T > 0).

Sources: Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative Decoding"
(arXiv 2211.17192, Algorithm 1 and Appendix A.1); Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling" (arXiv 2302.01318, Algorithm 2); the DSpark reference's evaluation (DS
`eval/base_evaluator.py::verify_draft_tokens`, spec §7), which this follows round for round.

For drafted tokens d_1…d_K sampled from the draft's per-slot distributions q_1…q_K, and the target's
distributions p_1…p_{K+1} after the verify inputs `[anchor, d_1, …, d_K]`:
    d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)), in order, stopping at the first rejection;
    on a rejection at slot i the bonus token is drawn from the residual norm(max(0, p_i − q_i));
    after K acceptances the bonus token is drawn from p_{K+1}.
The committed tokens are then distributed exactly as samples from the target (the papers' theorem; checked by
enumeration in tests/train/test_sampling.py). q_i must be the distribution d_i was actually drawn from, given
the tokens drafted before it: for a DSpark draft that is softmax((U_i + W2·W1[d_{i−1}]) / T) with d_{i−1} the
sampled draft token (spec §2 Inference, §3; `DSparkDraft.propose(..., return_probs=True)`), not the
teacher-forced training distribution.

Temperature and nucleus: both distributions are `sampling_probs(logits, T, top_p)`: softmax(logits / T), then,
when top_p < 1, the smallest set of most likely tokens whose mass reaches top_p, renormalised (Holtzman et al.
2020, arXiv 1904.09751). The draft samples at the same (T, top_p) as the target (DS passes one temperature to
both; DS has no top-p). Stop tokens follow spec §7: an accepted stop token at 1-based j ends generation with
τ_round = j (no bonus); a stop bonus ends it with τ_round = accepted + 1.

Shapes: V vocabulary (the target's), K drafted tokens. Probabilities float32/float64 tensors on any device;
the random draws use a seeded `torch.Generator` on that device, so a run is reproducible.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Verdict(NamedTuple):
    """One round's outcome (the fields of `regen.train.eval.Round`) and its bonus token (None: no bonus)."""

    accepted: int
    tau: int
    proposed: int
    stopped: bool
    bonus: int | None


def sampling_probs(logits_V: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """float32[..., V]: softmax(logits / T), restricted to the top-p nucleus and renormalised when top_p < 1.

    Raises ValueError for T <= 0 (greedy verification is `regen.train.eval.score_round`) or top_p outside (0, 1].
    """
    if temperature <= 0:
        raise ValueError(f"temperature {temperature}: sampling needs T > 0 (T = 0 is greedy verification)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p {top_p}: use a value in (0, 1]")
    p = torch.softmax(logits_V.float() / temperature, dim=-1)
    if top_p >= 1:
        return p
    sorted_p, order = p.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above each one
    keep_sorted = before < top_p  # the most likely token is always kept
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    p = p * keep
    return p / p.sum(-1, keepdim=True)


def residual_distribution(p_t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p_t − q)) over the last axis (Leviathan et al. 2023, eq. for p'(x)).

    When the residual has no mass (p_t ≤ q everywhere, i.e. p_t = q up to rounding, where a rejection has
    probability 0), p_t itself is returned, as in the reference (DS `utils/sampling.py::sample_residual`).
    """
    r = (p_t - q).clamp(min=0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 1e-12, r / mass.clamp(min=1e-30), p_t)


def draw(p_V: torch.Tensor, generator: torch.Generator) -> int:
    """One token id drawn from the distribution p_V (float[V], sums to 1)."""
    return int(torch.multinomial(p_V.float(), 1, generator=generator)[0])


def uniform(generator: torch.Generator) -> float:
    """One draw from U[0, 1) on the generator's device."""
    return float(torch.rand((), generator=generator, device=generator.device))


def verify_sampled(drafts: list[int], q_KV: torch.Tensor, p_KV: torch.Tensor, stop_ids,
                   generator: torch.Generator) -> Verdict:
    """Rejection-sampling verification of one round (module docstring).

    drafts: d_1…d_K (K may be 0). q_KV: float[K, V], row i the distribution d_{i+1} was drawn from.
    p_KV: float[K+1, V], row i the target's distribution after verify input i (`[anchor, d_1, …]`).
    The bonus is None when an accepted stop token ends generation (no bonus, spec §7).
    """
    stop = set(int(s) for s in stop_ids)
    K = len(drafts)
    for i, d in enumerate(drafts):
        p, q = float(p_KV[i, d]), float(q_KV[i, d])
        ratio = p / q if q > 0 else (1.0 if p > 0 else 0.0)
        if uniform(generator) < min(1.0, ratio):
            if int(d) in stop:  # stop token accepted at j = i + 1: no bonus, generation ends
                return Verdict(i + 1, i + 1, i + 1, True, None)
            continue
        bonus = draw(residual_distribution(p_KV[i], q_KV[i]), generator)
        return Verdict(i, i + 1, K, bonus in stop, bonus)
    bonus = draw(p_KV[K], generator)
    return Verdict(K, K + 1, K, bonus in stop, bonus)


def acceptance_closed_form(p_t: torch.Tensor, q: torch.Tensor) -> float:
    """α = Σ_x min(p_t(x), q(x)): the probability that a token drawn from q is accepted (Leviathan et al. 2023,
    §3.1, β = 1 − D_LK(p, q)); for a uniform draft q = 1/V it is Σ_x min(p_t(x), 1/V)."""
    return float(torch.minimum(p_t, q).sum())
