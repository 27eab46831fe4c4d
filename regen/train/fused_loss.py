"""Fused vocabulary-wide DSpark terms: CE + L1 and their gradients in one chunked pass (no [M, V] kept).

Spec: shared/docs/dspark.md §5. For M supervised slots with draft hidden h [M, H], Markov rows e = W1[x_prev]
[M, r], frozen lm_head W [Vd, H], Markov W2 [Vd, r] (Vd = the output vocabulary: V, or the reduced draft
vocabulary) and the target's final-normed state at the same position:

    ℓ = cap(h·Wᵀ) + e·W2ᵀ,  p_d = softmax(ℓ),  p_t = softmax(cap(last_h·Wᵀ))
    ce_i = −log p_d[x*_i],   l1_i = Σ_v |p_d − p_t|   (not halved)
    S = Σ_i α_i·ce_i + β_i·l1_i                      (α, β: the per-slot loss weights, known up front)

∂S/∂ℓ_i = α_i (p_d − onehot(x*)) + β_i p_d ⊙ (s − ⟨s, p_d⟩), s = sign(p_d − p_t), so the gradients with
respect to h, e and W2 are computed chunk by chunk in the forward pass (as Liger's fused linear cross entropy
does) and backward only scales them: two lm_head-sized matmuls forward and one for ∂h, instead of five with
activation checkpointing, and no [M, V] tensor survives a chunk. `regen.train.loss.vocab_terms` is the
plain autograd reference it is tested against.
"""
from __future__ import annotations

import torch


class _FusedVocabLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, e, w2, W, last_h, pt_idx, pt_host, tgt, alpha, beta, cap, chunk):
        M = h.shape[0]
        g_h = torch.zeros(M, h.shape[1], dtype=torch.float32, device=h.device)
        g_e = torch.zeros_like(e, dtype=torch.float32) if e is not None else None
        g_w2 = torch.zeros_like(w2, dtype=torch.float32) if w2 is not None else None
        ce = torch.empty(M, dtype=torch.float32, device=h.device)
        l1 = torch.empty_like(ce)
        hit = torch.empty_like(ce)
        for i in range(0, M, chunk):
            j = min(M, i + chunk)
            u = (h[i:j].to(W.dtype) @ W.T).float()
            if cap:
                u = torch.tanh(u / cap) * cap
            logits = u if e is None else u + (e[i:j].to(w2.dtype) @ w2.T).float()
            logp = torch.log_softmax(logits, dim=-1)
            t = tgt[i:j]
            ce[i:j] = -logp.gather(-1, t[:, None]).squeeze(-1)
            hit[i:j] = (logits.argmax(-1) == t).float()
            del logits
            p = logp.exp_()  # logp is not needed any more: reuse its storage
            # p_t once per distinct position: pt_idx is non-decreasing, so the chunk's are rows [lo, hi) of last_h
            lo, hi = pt_host[i], pt_host[j - 1] + 1  # host ints: no device read
            pt = (last_h[lo:hi].to(W.dtype) @ W.T).float()
            if cap:
                pt = torch.tanh(pt / cap) * cap
            pt = torch.softmax(pt, dim=-1)[pt_idx[i:j] - lo]
            diff = p - pt
            del pt
            l1[i:j] = diff.abs().sum(-1)
            s = diff.sign_()  # reuse diff
            # dℓ = β p ⊙ (s − ⟨s, p⟩) + α (p − onehot)
            d = s.sub_((s * p).sum(-1, keepdim=True)).mul_(p).mul_(beta[i:j, None])
            d.add_(p.mul_(alpha[i:j, None]))
            d.scatter_add_(-1, t[:, None], -alpha[i:j, None])
            if e is not None:
                g_e[i:j] = (d.to(w2.dtype) @ w2).float()
                g_w2 += (d.T.to(w2.dtype) @ e[i:j].to(w2.dtype)).float()
            if cap:
                d = d.mul_(1 - (u / cap) ** 2)
            g_h[i:j] = (d.to(W.dtype) @ W).float()
            del d, u, p, s
        total = (alpha * ce + beta * l1).sum()
        ctx.save_for_backward(g_h, g_e, g_w2)
        ctx.mark_non_differentiable(ce, l1, hit)
        ctx.dtypes = (h.dtype, e.dtype if e is not None else None, w2.dtype if w2 is not None else None)
        return total, ce, l1, hit

    @staticmethod
    def backward(ctx, g_total, _g_ce, _g_l1, _g_hit):
        g_h, g_e, g_w2 = ctx.saved_tensors
        dh, de, dw2 = ctx.dtypes
        out_e = (g_total * g_e).to(de) if g_e is not None and ctx.needs_input_grad[1] else None
        out_w2 = (g_total * g_w2).to(dw2) if g_w2 is not None and ctx.needs_input_grad[2] else None
        return (g_total * g_h).to(dh), out_e, out_w2, None, None, None, None, None, None, None, None, None


def fused_vocab_loss(draft, h_MH, prev_M, tgt_M, last_h_UH, pt_idx_M, alpha_M, beta_M, *,
                     chunk_slots: int | None = None, pt_idx_host=None):
    """(S scalar with gradient, ce f32[M], l1 f32[M], hit f32[M]) — see the module docstring.

    last_h_UH: the target's final-normed states of the U distinct positions the slots use; pt_idx_M int64[M]: the
    row of each slot in it, non-decreasing (slots sorted by it, so each chunk's p_t matmul covers one contiguous
    range of rows, ~m/K of them at dense anchors, since up to K blocks supervise the same position; ValueError
    otherwise). pt_idx_host: the same as host ints, for the chunk bounds; None = one read of pt_idx_M here
    (`regen.train.loss.SlotLayout` carries it, so the trainer's loss reads nothing back). alpha/beta: per-slot
    coefficients of CE and L1 in the loss (detached), e.g. 0.1·w_i·world/Σw.
    """
    cfg = draft.config
    chunk = chunk_slots or max(1, (1 << 25) // cfg.output_vocab_size)
    pt_host = pt_idx_M.tolist() if pt_idx_host is None else list(pt_idx_host)
    if len(pt_host) != h_MH.shape[0]:
        raise ValueError(f"pt_idx_host has {len(pt_host)} entries for {h_MH.shape[0]} slots")
    if any(b < a for a, b in zip(pt_host, pt_host[1:])):
        raise ValueError("fused_vocab_loss: pt_idx must be non-decreasing (sort the slots by position first)")
    if draft.markov_head is not None:
        e = draft.markov_head.markov_w1(prev_M)
        w2 = draft.markov_head.markov_w2.weight
    else:
        e = w2 = None
    total, ce, l1, hit = _FusedVocabLoss.apply(h_MH, e, w2, draft.lm_head.weight, last_h_UH, pt_idx_M, pt_host, tgt_M,
                                               alpha_M.detach().float(), beta_M.detach().float(),
                                               cfg.final_logit_softcapping, chunk)
    return total, ce, l1, hit
