"""The verification rules a serving engine runs at T > 0, named as the engines name them, so `regen eval` measures
what the engine will report under the launch `regen export-draft` writes.

Two choices make a served protocol (vLLM's `--speculative-config` keys; TokenSpeed's launch uses the same names):
    draft_sample_method      "probabilistic": each draft token is drawn from the draft's q_k at (T, top_p);
                             "greedy": each draft token is the draft's argmax, so q_k is one-hot on it.
    rejection_sample_method  "standard": token-level rejection sampling (Leviathan et al. 2023, arXiv 2211.17192,
                             Algorithm 1; `regen.train.sampling.verify_sampled`);
                             "block": block verification (Sun et al. 2024, "Block Verification Accelerates
                             Speculative Decoding", arXiv 2403.10444, Algorithm 2; `verify_block`).
Both rules are lossless for any q the drafts were really drawn from (one-hot included): the committed tokens are
distributed as the target's samples. Block verification accepts at least as many tokens in expectation as the
token-level rule and is optimal among valid verifiers (the paper's Theorems 1 and 2).

Block verification of drafts d_1…d_K drawn from q_1…q_K, with the target's p_1…p_{K+1} after `[anchor, d_1, …]`
(Algorithm 2, in the paper's symbols p_i ↔ the joint survival probability, h_i ↔ the sub-block acceptance):
    a_0 = 1,  a_i = min(1, a_{i-1} · p_i(d_i) / q_i(d_i))                                   i = 1…K
    r_i(x) = max(0, a_i · p_{i+1}(x) − q_{i+1}(x)),  m_i = Σ_x r_i(x)                       i = 0…K−1
    h_i = m_i / (m_i + 1 − a_i)  for i < K (1 when the denominator is 0),  h_K = a_K
    one uniform η_i per i = 1…K; τ = the largest i with η_i ≤ h_i (0 when none)
    commit d_1…d_τ and a bonus drawn from norm(r_τ) when τ < K (p_{τ+1} itself when r_τ has no mass),
    from p_{K+1} when τ = K.
Stop tokens follow spec §7 as in `verify_sampled`: a stop token among the committed drafts at 1-based j ends the
generation with τ_round = j and no bonus; a stop bonus ends it with τ_round = τ + 1.

Shapes: V vocabulary (the target's), K drafted tokens. Probabilities float32/float64 on any device; the draws use
the caller's seeded `torch.Generator`, K uniforms first (in slot order) then the bonus, so a run is reproducible.
"""
from __future__ import annotations

import torch

from regen.train.sampling import Verdict, draw, verify_sampled

DRAFT_SAMPLE_METHODS = ("probabilistic", "greedy")
REJECTION_SAMPLE_METHODS = ("standard", "block")
DEFAULT_METHOD = ("probabilistic", "standard")  # `regen eval --temperature T`'s figures under "sampled"

METHOD_DESCRIPTIONS = {
    "probabilistic": "each draft token drawn from q_k = the draft's distribution at (T, top_p)",
    "greedy": "each draft token the draft's argmax; q_k one-hot on it",
    "standard": "token-level rejection sampling (Leviathan et al. 2023, arXiv 2211.17192): d_k accepted with "
                "probability min(1, p_t(d_k)/q_k(d_k)) in order; bonus from norm(max(0, p_t - q_k)) at the first "
                "rejection, from p_t after all",
    "block": "block verification (Sun et al. 2024, arXiv 2403.10444, Algorithm 2): the longest sub-block i with "
             "eta_i <= h_i is kept, a_i = min(1, a_(i-1) p_i(d_i)/q_i(d_i)), h_i = m_i/(m_i + 1 - a_i), "
             "m_i = sum_x max(0, a_i p_(i+1)(x) - q_(i+1)(x)); bonus from norm(max(0, a_tau p - q)) or p_(K+1)",
}


def method_key(draft_sample_method: str, rejection_sample_method: str) -> str:
    """The name of a served protocol in eval.json: `"<draft_sample_method>+<rejection_sample_method>"`."""
    return f"{draft_sample_method}+{rejection_sample_method}"


def parse_methods(draft_methods: str, rejection_methods: str) -> list[tuple[str, str]]:
    """The cross product of two comma-separated lists, in order, checked. Raises InputError naming the bad value."""
    from regen.errors import InputError

    out = []
    d = [x.strip() for x in draft_methods.split(",") if x.strip()]
    r = [x.strip() for x in rejection_methods.split(",") if x.strip()]
    for flag, given, allowed in (("--draft-sample-method", d, DRAFT_SAMPLE_METHODS),
                                 ("--rejection-sample-method", r, REJECTION_SAMPLE_METHODS)):
        bad = [x for x in given if x not in allowed] or ([] if given else ["(empty)"])
        if bad:
            raise InputError(f"{flag} {','.join(given)!r}: {bad[0]} is not one of {', '.join(allowed)}; give a "
                             f"comma-separated list of them")
    for dm in d:
        for rm in r:
            if (dm, rm) not in out:
                out.append((dm, rm))
    return out


def block_acceptance(drafts: list[int], q_KV: torch.Tensor, p_KV: torch.Tensor):
    """(h float64[K], residuals float64[K+1, V]) of block verification (module docstring): h[i-1] = h_i, the
    probability that the sub-block d_1…d_i is kept given the later ones are not; residuals[i] = the bonus
    distribution when τ = i (norm(r_i), or p_{i+1} when r_i has no mass; p_{K+1} for i = K).

    drafts: d_1…d_K. q_KV: float[K, V] (row i: the distribution d_{i+1} was drawn from). p_KV: float[K+1, V].
    """
    K = len(drafts)
    p, q = p_KV.double(), q_KV.double()
    a = torch.ones(K + 1, dtype=torch.float64, device=p.device)
    for i, d in enumerate(drafts):
        pd, qd = float(p[i, d]), float(q[i, d])
        ratio = pd / qd if qd > 0 else (float("inf") if pd > 0 else 0.0)
        a[i + 1] = min(1.0, float(a[i]) * ratio) if float(a[i]) > 0 else 0.0
    h = torch.zeros(K, dtype=torch.float64, device=p.device)
    residuals = []
    for i in range(K):
        r = (a[i] * p[i] - q[i]).clamp(min=0)
        mass = float(r.sum())
        residuals.append(r / mass if mass > 1e-12 else p[i])
        if i >= 1:
            denom = mass + 1.0 - float(a[i])
            h[i - 1] = mass / denom if denom > 1e-12 else 1.0
    if K:
        h[K - 1] = a[K]
    residuals.append(p[K])
    return h, torch.stack(residuals)


def verify_block(drafts: list[int], q_KV: torch.Tensor, p_KV: torch.Tensor, stop_ids,
                 generator: torch.Generator) -> Verdict:
    """Block verification of one round (module docstring); the same arguments and result as
    `regen.train.sampling.verify_sampled`. K uniforms are drawn first (slot order), then the bonus."""
    stop = set(int(s) for s in stop_ids)
    K = len(drafts)
    h, residuals = block_acceptance(drafts, q_KV, p_KV)
    eta = torch.rand(K, generator=generator, device=generator.device, dtype=torch.float64).to(h.device)
    kept = [i + 1 for i in range(K) if float(eta[i]) <= float(h[i])]
    tau = max(kept) if kept else 0
    j = next((i + 1 for i, d in enumerate(drafts[:tau]) if int(d) in stop), None)
    if j is not None:  # a stop token among the kept drafts: generation ends there, no bonus
        return Verdict(j, j, j, True, None)
    bonus = draw(residuals[tau], generator)
    return Verdict(tau, tau + 1, K, bonus in stop, bonus)


def verifier(rejection_sample_method: str):
    """The verify function of a rejection_sample_method: `verify_sampled` ("standard") or `verify_block`."""
    return {"standard": verify_sampled, "block": verify_block}[rejection_sample_method]

