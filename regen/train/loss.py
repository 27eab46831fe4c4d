"""DSpark training objective: anchors, block attention mask, evaluation mask, decay weights, CE + L1 + confidence.

Spec: shared/docs/dspark.md §5 (DS `loss.py`/`common.py`, SF `OnlineDSparkModel`). Shape legend as in
`regen.train.model`: B batch, S sequence, N anchors per row, K block_size, V vocab, H hidden.

Slot k (0-based) of the block at anchor a predicts x[a+k+1] (spec's 1-based slot k predicts x[a+k]); its
Markov previous token is x[a+k] and its target distribution p_t comes from the target's final-normed hidden
state at position a+k (spec: a+k−1 with 1-based k).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSS_WEIGHTS = (0.1, 0.9, 1.0)  # CE, L1, confidence (P eq. 12; DS config)


def sample_anchors(loss_mask_BS: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None):
    """Anchors per spec §5: valid i ∈ [0, S−2] with loss_mask[i] = loss_mask[i+1] = 1; draw min(num_anchors,
    #valid) uniformly without replacement (seeded `generator`, CPU), sort ascending, pad with dummy anchors.

    Returns (anchors int64[B, N], keep bool[B, N]) with N = max(1, min(num_anchors, max valid count in batch))
    (SF pads only to the batch maximum). Dummy anchors are 0 with keep False.
    """
    lm = loss_mask_BS.bool().cpu()
    B, S = lm.shape
    valid = lm[:, :-1] & lm[:, 1:] if S > 1 else torch.zeros(B, 0, dtype=torch.bool)
    picks = []
    for b in range(B):
        pos = valid[b].nonzero().flatten()
        n = min(num_anchors, pos.numel())
        pick = pos[torch.randperm(pos.numel(), generator=generator)[:n]] if n else pos[:0]
        picks.append(pick.sort().values)
    N = max(1, max(p.numel() for p in picks))
    anchors = torch.zeros(B, N, dtype=torch.long)
    keep = torch.zeros(B, N, dtype=torch.bool)
    for b, p in enumerate(picks):
        anchors[b, : p.numel()] = p
        keep[b, : p.numel()] = True
    return anchors.to(loss_mask_BS.device), keep.to(loss_mask_BS.device)


def create_block_attention_mask(anchors_BN, keep_BN, seq_len: int, block_size: int, attention_mask=None):
    """Dense boolean DSpark training mask (spec §2 "Training mask", = SF `create_dflash_sdpa_mask`).

    Returns bool[B, N·K, S + N·K], True = may attend. A query of block b sees context key j iff j < a_b
    (strict: the anchor's own features do not exist yet at inference) and `attention_mask[j]` (when given),
    and all K slots of its own block; nothing else. Blocks with keep False are fully masked.
    """
    B, N = anchors_BN.shape
    K, dev = block_size, anchors_BN.device
    j = torch.arange(seq_len, device=dev)
    ctx = j[None, None, :] < anchors_BN[:, :, None]  # [B, N, S]
    if attention_mask is not None:
        ctx = ctx & attention_mask.bool()[:, None, :]
    blk_id = torch.arange(N, device=dev)
    own = blk_id[:, None] == blk_id[None, :]  # [N, N]
    own = own[:, None, :, None].expand(N, K, N, K).reshape(N * K, N * K)
    ctx = ctx[:, :, None, :].expand(B, N, K, seq_len).reshape(B, N * K, seq_len)
    mask = torch.cat([ctx, own[None].expand(B, -1, -1)], dim=-1)
    q_keep = keep_BN.bool()[:, :, None].expand(B, N, K).reshape(B, N * K, 1)
    return mask & q_keep


def slot_positions(anchors_BN, block_size: int):
    """a + k for k = 0…K−1: int64[B, N, K] (unclamped)."""
    return anchors_BN[..., None] + torch.arange(block_size, device=anchors_BN.device)


def evaluation_mask(anchors_BN, keep_BN, loss_mask_BS, block_size: int):
    """eval[b, n, k] = keep ∧ (a+k+1 < S) ∧ loss_mask[a+k+1], then cumulative product along k (spec §5):
    float32[B, N, K], only a contiguous supervised prefix of each block counts."""
    S = loss_mask_BS.shape[1]
    tgt = slot_positions(anchors_BN, block_size) + 1
    inside = tgt < S
    lm = loss_mask_BS.bool().gather(1, tgt.clamp(max=S - 1).flatten(1)).view_as(tgt)
    ev = (keep_BN.bool()[..., None] & inside & lm).float()
    return ev.cumprod(dim=-1)


def decay_weights(block_size: int, gamma: float = 4.0, device=None):
    """w_k = exp(−(k−1)/γ_w), k = 1…K, γ_w = loss_decay_gamma = 4.0 (DS/SF/TS; the paper's γ=7 disagrees,
    spec §5/§10): float32[K]."""
    return torch.exp(-torch.arange(block_size, device=device, dtype=torch.float32) / gamma)


def _slot_terms(draft, h, prev, tgt, last_h):
    logits = draft.corrected_logits(h, prev)  # [m, V]
    logp_d = F.log_softmax(logits, dim=-1)
    ce = -logp_d.gather(-1, tgt[:, None]).squeeze(-1)
    with torch.no_grad():
        p_t = torch.softmax(draft.base_logits(last_h), dim=-1)
    l1 = (logp_d.exp() - p_t).abs().sum(-1)
    return ce, l1, (logits.argmax(-1) == tgt).float()


def vocab_terms(draft, h_MH, prev_M, tgt_M, last_h_MH, *, chunk_slots: int | None = None):
    """Per-slot CE −log p_d(x*), L1 ‖p_d − p_t‖₁ (not halved) and top-1 hit, each float32[M] (spec §5).

    p_d = softmax(lm_head(h) + W2·W1[prev]); p_t = softmax(lm_head(last_h)) (target's final-normed state).
    Computed in chunks of slots under activation checkpointing, so peak memory holds one chunk's [m, V]
    logits (a 262k vocabulary makes [M, V] gigabytes), at the price of one more lm_head pass in backward.
    """
    V = draft.config.output_vocab_size
    m = chunk_slots or max(1, (1 << 25) // V)
    if h_MH.shape[0] <= m or not torch.is_grad_enabled():
        return _slot_terms(draft, h_MH, prev_M, tgt_M, last_h_MH)
    from torch.utils.checkpoint import checkpoint

    parts = [checkpoint(_slot_terms, draft, h_MH[i:i + m], prev_M[i:i + m], tgt_M[i:i + m], last_h_MH[i:i + m],
                        use_reentrant=False) for i in range(0, h_MH.shape[0], m)]
    return tuple(torch.cat(x) for x in zip(*parts))


def chain_expectation(values_BNK, eval_BNK, keep_BN=None) -> float:
    """1 + mean over supervised blocks of Σ_k Π_{i≤k} v_i·eval_i (spec §9 `tau_probabilistic` with v = c*).

    A supervised block has at least one slot with eval > 0 (= its first slot, eval being a cumulative product);
    the reference counts only those (DS `loss.py`), so a block whose slots all left the loss mask after the
    anchors were drawn (a target outside the reduced draft vocabulary) does not pull the mean toward 1.
    `keep_BN` is accepted for compatibility and unused: a dummy block has no supervised slot.
    """
    chain = (values_BNK * eval_BNK).cumprod(-1)
    return 1.0 + float(chain.sum()) / max(1, num_supervised_blocks(eval_BNK))


def num_supervised_blocks(eval_BNK) -> int:
    """Blocks with at least one supervised slot (eval_BNK[..., 0] > 0; `evaluation_mask` is a prefix)."""
    return int((eval_BNK[..., 0] > 0).sum())


def _global_denominator(local: torch.Tensor, known: float | None = None) -> tuple[torch.Tensor | float, int]:
    """Σ w over data-parallel ranks and the world size: `known` when the caller has it (the trainer agrees on
    every micro-batch's weight once per step), else an all-reduce of the device tensor on the hot plane."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return (local.detach() if known is None else known), 1
    if known is not None:
        return known, dist.get_world_size()
    from regen.train.collectives import hot_all_reduce_sum

    return hot_all_reduce_sum(local, "the loss denominator"), dist.get_world_size()


@dataclass(frozen=True)
class SlotLayout:
    """Where a micro-batch's supervised slots are: the index plan the loss gathers and scatters with, so that on the
    training device it sizes every buffer from Python ints and reads nothing back (no boolean-mask indexing,
    `torch.unique` or `nonzero` there: each is a host synchronisation on a GPU).

    Built by `slot_layout` from the host copies of the anchors, keep flags and loss mask (`regen.train.step.
    prepare_microbatch` does, before they go to the device). M = B·N·K slots, flat index b·N·K + n·K + k:
    sel int64[n]: the slots with weight w > 0, ascending (= `(w.flatten() > 0).nonzero()`);
    order int64[n]: the stable sort of those slots by their (row, position) key b·S + min(a+k, S−1);
    back int64[n]: its inverse permutation; uniq int64[U]: the distinct keys, ascending;
    pt_idx int64[n]: each sorted slot's row in `uniq` (non-decreasing); pt_idx_host: the same as a tuple of
    Python ints (the fused loss's chunk bounds); vocab_checked: the supervised targets were checked against the draft vocabulary.
    """
    sel: torch.Tensor
    order: torch.Tensor
    back: torch.Tensor
    uniq: torch.Tensor
    pt_idx: torch.Tensor
    pt_idx_host: tuple  # of ints
    num_slots: int  # M = B·N·K
    vocab_checked: bool = False

    @property
    def n(self) -> int:
        return len(self.pt_idx_host)

    def to(self, device) -> "SlotLayout":
        """The index tensors on `device` (asynchronous host-to-device copies; pt_idx_host stays on the host)."""
        device = torch.device(device)
        if self.sel.device == device:
            return self
        mv = {f: getattr(self, f).to(device, non_blocking=True) for f in ("sel", "order", "back", "uniq", "pt_idx")}
        return SlotLayout(**mv, pt_idx_host=self.pt_idx_host, num_slots=self.num_slots,
                          vocab_checked=self.vocab_checked)

    @staticmethod
    def empty(num_slots: int, device=None) -> "SlotLayout":
        """No supervised slot (a micro-batch trained with its loss mask zeroed)."""
        z = torch.zeros(0, dtype=torch.long)
        return SlotLayout(z, z, z, z, z, (), num_slots, vocab_checked=True).to(device or "cpu")


def slot_layout(anchors_BN, keep_BN, loss_mask_BS, block_size: int, loss_decay_gamma: float = 4.0, *,
                input_ids=None, t2d=None) -> SlotLayout:
    """The `SlotLayout` of a micro-batch, on the device of `anchors_BN`. On the host (the trainer's case) this reads
    no device; given device tensors it makes one host read (the weights, positions and vocabulary flags together).

    input_ids int[B, S] and t2d bool[V] (a reduced draft vocabulary, `DSparkDraft.t2d`): every supervised target
    must lie inside it, else ValueError (mask such targets out of the loss mask first, `DSparkDraft.in_draft_vocab`).
    """
    B, N = anchors_BN.shape
    S, K = loss_mask_BS.shape[1], block_size
    ev = evaluation_mask(anchors_BN, keep_BN, loss_mask_BS, K)
    w = (ev * decay_weights(K, loss_decay_gamma, ev.device)).flatten()
    pos = slot_positions(anchors_BN, K).clamp(max=S - 1)
    parts = [w.double(), pos.flatten().double()]
    check = t2d is not None and input_ids is not None
    if check:
        tgt = input_ids.long().gather(1, (slot_positions(anchors_BN, K) + 1).clamp(max=S - 1).flatten(1)).flatten()
        parts.append(t2d.to(tgt.device)[tgt].double())
    if anchors_BN.device.type != "cpu":  # one read of every value the plan needs
        host = torch.cat(parts).cpu()
        M = B * N * K
        parts = [host[i * M:(i + 1) * M] for i in range(len(parts))]
    w, pos = parts[0], parts[1].long()
    sel = (w > 0).nonzero().flatten()
    if check and not bool(parts[2][sel].all()):
        raise ValueError("supervised target tokens outside the draft vocabulary: mask them out of the loss "
                         "with DSparkDraft.in_draft_vocab (regen.train.step.prepare_microbatch does)")
    key = (torch.arange(B)[:, None] * S + pos.view(B, N * K)).flatten()[sel]
    order = torch.argsort(key, stable=True)
    uniq, pt_idx = torch.unique(key[order], return_inverse=True)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel())
    lay = SlotLayout(sel, order, back, uniq, pt_idx, tuple(pt_idx.tolist()), B * N * K, vocab_checked=check)
    return lay.to(anchors_BN.device)


def dspark_loss(draft, batch: dict, features, anchors=None, keep=None, *, generator=None,
                weights=LOSS_WEIGHTS, chunk_slots: int | None = None, fused: bool = True,
                denominator: float | None = None, metrics_on_device: bool = False, layout: SlotLayout | None = None):
    """The DSpark loss for one micro-batch (spec §5). Returns (loss scalar tensor, metrics dict of floats).

    batch: `input_ids` int[B, S], `loss_mask` {0,1}[B, S], optional `attention_mask` [B, S], `position_ids`.
      With a reduced draft vocabulary the loss mask must exclude targets outside it (`DSparkDraft.in_draft_vocab`,
      as `regen.train.step.prepare_microbatch` does; EAGLE-3's position mask), else ValueError; p_t is then the
      target's distribution renormalised over the draft vocabulary (its lm_head rows), as in EAGLE-3.
    features: (taps [B, S, T·Ht], last_hidden [B, S, Ht]) from `regen.train.target.TargetFeatures.features`
      (last_hidden is the target's final-normed state; p_t = softmax(lm_head(last_hidden)), spec §1).
    anchors/keep: from `sample_anchors` (sampled here with `generator` when None).
    chunk_slots: slots per vocabulary-wide chunk; None = about 2**25 logits per chunk. fused: CE + L1 and their
    gradients in one pass (`regen.train.fused_loss`); False = plain autograd (`vocab_terms`), the reference.

    Each term is Σ w·term / Σ_global w · world_size (cancels DDP/FSDP gradient averaging):
    L = 0.1·CE + 0.9·L1 + 1.0·BCE(c, c*), c* = clamp(1 − ½‖p_d − p_t‖₁, 0, 1) detached, p_d the
    Markov-corrected draft distribution at T=1 with teacher forcing. Metrics are this rank's, unreduced.
    denominator: Σ_global w of this micro-batch when the caller knows it (no collective here).
    metrics_on_device: metrics as 0-d tensors on the training device (no host read; the trainer reads them
    once per log step) instead of Python numbers.
    layout: the micro-batch's `SlotLayout` (from `slot_layout` on the host copies of anchors, keep and loss mask);
    None = built here (one host read when the tensors are on a device). ValueError when it does not fit.

    Host synchronisations: none on the device with a layout and metrics_on_device (every buffer is sized from the
    layout's Python ints; the layout's agreement with the loss mask is asserted on the device, asynchronously);
    without a layout, the one read of `slot_layout`.
    """
    taps, last_hidden = features
    ids, lm = batch["input_ids"], batch["loss_mask"]
    cfg = draft.config
    K, S = cfg.block_size, ids.shape[1]
    if anchors is None:
        anchors, keep = sample_anchors(lm, cfg.num_anchors, generator)
    hidden = draft(taps, ids, anchors, keep, batch.get("position_ids"), batch.get("attention_mask"))  # [B,N,K,H]

    pos = slot_positions(anchors, K).clamp(max=S - 1)  # previous-token / p_t positions
    tgt_pos = (slot_positions(anchors, K) + 1).clamp(max=S - 1)
    prev_ids = ids.long().gather(1, pos.flatten(1)).view_as(pos)
    tgt_ids = ids.long().gather(1, tgt_pos.flatten(1)).view_as(pos)
    ev = evaluation_mask(anchors, keep, lm, K)
    w = ev * decay_weights(K, cfg.loss_decay_gamma, ev.device)

    if layout is None:
        t2d = draft.t2d if cfg.draft_vocab_size else None
        layout = slot_layout(anchors, keep, lm, K, cfg.loss_decay_gamma, input_ids=ids, t2d=t2d)
    elif cfg.draft_vocab_size and not layout.vocab_checked:
        raise ValueError("the slot layout was built without the draft vocabulary: pass input_ids and t2d to "
                         "slot_layout (regen.train.step.prepare_microbatch does)")
    lay = layout.to(hidden.device)
    if lay.num_slots != w.numel():
        raise ValueError(f"the slot layout covers {lay.num_slots} slots, this micro-batch has {w.numel()}: build it "
                         "from this micro-batch's anchors")
    # the layout must be this micro-batch's (the loss mask unchanged since): checked on the device, no host read
    sel, w_flat = lay.sel, w.flatten()  # only supervised slots enter the vocabulary-wide terms
    h_sel = hidden.flatten(0, 2).index_select(0, sel)
    prev_sel, w_sel = prev_ids.flatten().index_select(0, sel), w_flat.index_select(0, sel)
    torch._assert_async(((w_flat > 0).sum() == lay.n) & (w_sel > 0).all(), "the slot layout does not match the "
                        "loss mask: rebuild it with slot_layout after changing the loss mask")
    tgt_sel = draft.to_draft_index(tgt_ids.flatten().index_select(0, sel), check=False)  # output rows (checked)
    denom, world = _global_denominator(w.sum(), denominator)
    denom = max(denom, 1e-6) if isinstance(denom, float) else denom.clamp(min=1e-6)
    scale = w_sel / denom * world  # Σ over ranks of Σ scale·term = the global weighted mean (spec §5)
    if fused:
        from regen.train.fused_loss import fused_vocab_loss

        # slots ordered by (row, position) so each chunk computes p_t once per distinct position
        order = lay.order
        vocab_loss, ce, l1, hit = fused_vocab_loss(
            draft, h_sel[order], prev_sel[order], tgt_sel[order], last_hidden.flatten(0, 1).index_select(0, lay.uniq),
            lay.pt_idx, weights[0] * scale[order], weights[1] * scale[order], chunk_slots=chunk_slots,
            pt_idx_host=lay.pt_idx_host)
        ce, l1, hit = ce[lay.back], l1[lay.back], hit[lay.back]
    else:
        with torch.no_grad():
            lh = last_hidden.gather(1, pos.flatten(1)[..., None].expand(-1, -1, last_hidden.shape[-1]))
            lh_sel = lh.flatten(0, 1).index_select(0, sel)
        ce, l1, hit = vocab_terms(draft, h_sel, prev_sel, tgt_sel, lh_sel, chunk_slots=chunk_slots)
        vocab_loss = weights[0] * (scale * ce).sum() + weights[1] * (scale * l1).sum()
    c_star = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
    conf_logit = draft.confidence_logits(h_sel, prev_sel)
    bce = (F.binary_cross_entropy_with_logits(conf_logit, c_star, reduction="none")
           if conf_logit is not None else torch.zeros_like(ce))
    conf_t = (scale * bce).sum()
    loss = vocab_loss + weights[2] * conf_t
    ce_t, l1_t = (scale * ce.detach()).sum(), (scale * l1.detach()).sum()

    with torch.no_grad():
        M = w.numel()
        full_cstar = torch.zeros(M, device=w.device).index_put_((sel,), c_star)
        match = torch.zeros(M, device=w.device).index_put_((sel,), hit)
        if metrics_on_device:
            nsb = (ev[..., 0] > 0).sum()
            n_blocks = nsb.clamp(min=1)
            return loss, {
                "loss": loss.detach(), "ce": ce_t / world, "l1": l1_t / world, "conf": conf_t.detach() / world,
                "acc": (match.view_as(w) * ev).sum() / ev.sum().clamp(min=1),
                "tau_probabilistic": 1.0 + ((full_cstar.view_as(w) * ev).cumprod(-1).sum() / n_blocks),
                "tau_teacher_forced": 1.0 + ((match.view_as(w) * ev).cumprod(-1).sum() / n_blocks),
                "num_blocks": keep.sum(), "num_supervised_blocks": nsb, "num_slots": ev.sum(),
            }
        n_slots = max(1.0, float(ev.sum()))
        metrics = {
            "loss": float(loss), "ce": float(ce_t) / world, "l1": float(l1_t) / world, "conf": float(conf_t) / world,
            "acc": float((match.view_as(w) * ev).sum()) / n_slots,
            "tau_probabilistic": chain_expectation(full_cstar.view_as(w), ev, keep),  # 1 + Σ_k Π_{i≤k} c*_i
            "tau_teacher_forced": chain_expectation(match.view_as(w), ev, keep),
            "num_blocks": int(keep.sum()), "num_supervised_blocks": num_supervised_blocks(ev),
            "num_slots": int(ev.sum()),
            "conf_mean": float(torch.sigmoid(conf_logit).mean()) if conf_logit is not None and len(conf_logit) else math.nan,
        }
    return loss, metrics
