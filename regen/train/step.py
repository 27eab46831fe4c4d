"""One optimizer step of the trainer (`regen.train.trainer.Trainer` runs it) and what it is made of:
`make_objective` wraps the draft in the module FSDP2 shards (its forward is the DSpark loss),
`share_frozen_with_target` points the draft's frozen embeddings and head at the target's, `prepare_microbatch`
turns a feed micro-batch into the step's device batch, anchors and slot layout (planned on the host),
`train_step` runs a step's micro-batches, agrees on finiteness across ranks and steps the optimizer,
`reduce_metrics` reads the step's device metrics to the host at a log step."""
from __future__ import annotations

import time

from regen.errors import InputError


def make_objective(draft):
    """Wrap `draft` in a module whose forward is the DSpark loss, so FSDP2's root (this wrapper) unshards every
    parameter the loss touches (lm_head, Markov and confidence heads are used outside `draft.forward`)."""
    from torch import nn

    from regen.train.loss import dspark_loss

    class Objective(nn.Module):
        def __init__(self, draft):
            super().__init__()
            self.draft = draft

        @property
        def config(self):
            return self.draft.config

        def forward(self, batch, features, anchors, keep, weights=(0.1, 0.9, 1.0), denominator=None):
            return dspark_loss(self.draft, batch, features, anchors, keep, weights=weights,
                               denominator=denominator, metrics_on_device=denominator is not None,
                               layout=batch.get("slot_layout"))

    return Objective(draft)


def share_frozen_with_target(draft, target_model, dtype) -> None:
    """Point the draft's frozen embed_tokens/lm_head at the target's tensors when they match in shape, dtype and
    device (one copy in memory instead of two: 2 x 262K x 640 floats for Gemma); else cast them to `dtype`."""
    import torch

    for mine, theirs in ((draft.embed_tokens, target_model.get_input_embeddings()),
                         (draft.lm_head, target_model.get_output_embeddings())):
        w = theirs.weight
        if w.shape == mine.weight.shape and w.dtype == dtype and w.device == mine.weight.device:
            mine.weight = w if not w.requires_grad else torch.nn.Parameter(w.detach(), requires_grad=False)
        elif mine.weight.dtype != dtype:  # (already in dtype: nothing to convert, nor to swap on fake tensors)
            mine.to(dtype)


def prepare_microbatch(mb, seed: int, draft_cfg, device, t2d=None):
    """(batch dict on `device`, anchors int64[B, N], keep bool[B, N]) for a feed MicroBatch.

    Anchors come from a generator seeded by (seed, epoch, global micro-batch index): identical for the same
    sample at any world size and after a resume (spec §5 sampling: uniform without replacement, sorted).
    t2d: bool[V] of a reduced draft vocabulary (`DSparkDraft.t2d`): tokens outside it leave the loss mask after
    the anchors are drawn, so no supervised slot has one as its target (EAGLE-3's position mask; the
    evaluation mask's cumulative product ends a block there).
    """
    import torch

    from regen.train.feed import stable_hash
    from regen.train.loss import sample_anchors, slot_layout

    top = int(mb.input_ids.max())
    if top >= draft_cfg.vocab_size:
        raise InputError(f"sample {mb.sample_ids} has token id {top} >= the target's vocab_size "
                         f"{draft_cfg.vocab_size}: the shards were rendered with another tokenizer than the target's")
    gen = torch.Generator().manual_seed(stable_hash(seed, mb.epoch, mb.index, "anchors") & ((1 << 62) - 1))
    anchors, keep = sample_anchors(mb.loss_mask, draft_cfg.num_anchors, gen)  # an anchor token is only an input
    loss_mask = mb.loss_mask if t2d is None else mb.loss_mask & t2d.cpu()[mb.input_ids]
    # the supervised slots' index plan, from the host copies: the loss reads nothing back from the device
    layout = slot_layout(anchors, keep, loss_mask, draft_cfg.block_size, draft_cfg.loss_decay_gamma,
                         input_ids=mb.input_ids, t2d=None if t2d is None else t2d.cpu())
    batch = {"input_ids": mb.input_ids.to(device), "loss_mask": loss_mask.to(device),
             "attention_mask": mb.attention_mask.to(device), "key": (mb.epoch, mb.index),
             "num_tokens": int(mb.attention_mask.sum()),  # counted on the host copy: no device read
             # the host copies, for what keys rows on the host (regen.train.feature_cache): no device read
             "host_input_ids": mb.input_ids, "host_attention_mask": mb.attention_mask,
             "slot_layout": layout.to(device)}
    return batch, anchors.to(device), keep.to(device)



def zero_loss(batch: dict) -> None:
    """Train `batch` with zero weight (its features failed on every attempt, `on_failure: zero_loss`): its loss
    mask zeroed and its slot layout emptied to match."""
    import torch

    from regen.train.loss import SlotLayout

    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    if "slot_layout" in batch:
        batch["slot_layout"] = SlotLayout.empty(batch["slot_layout"].num_slots, batch["loss_mask"].device)


def train_step(model, target, opt, microbatches, *, loss_weights=(0.1, 0.9, 1.0), grad_clip: float = 1.0,
               loss_normalization: str = "step") -> dict:
    """One optimizer step over this rank's micro-batches [(batch, anchors, keep)]; collective over ranks.

    loss_normalization "step" (default): the step's objective is Σ_all w·term / Σ_all w over every micro-batch
    of every rank (spec §5), so A micro-batches equal one batch holding them all, and W ranks equal one rank
    accumulating their batches. "micro_batch" (the reference, DS trainer): (1/A) Σ_i Σ_ranks w·term_i / Σ_ranks w_i,
    each micro-batch normalised by its own weight sum over ranks, then averaged over the A accumulation steps.
    Returns this rank's partial sums (reduce with `reduce_metrics`), tokens, target seconds, grad norm, `finite`
    (False: some rank saw a non-finite loss or gradient norm or feature values, and `opt.step()` was skipped on
    every rank; the caller stops, `regen.train.guard`), `bad_microbatches` (this rank's indices with a non-finite
    loss or features) and `feature_breaches` (this rank's contract errors of non-finite feature values, from
    `target.take_breaches()` when it has one).
    Device synchronisations: none per micro-batch (the loss sizes its buffers from the host-built slot layout,
    `regen.train.loss.SlotLayout`); three per step (the loss weights, for the control-plane all-reduce, the
    finiteness flags before the optimizer step, and remote features' value counts, read on the copy stream in
    `target.take_breaches()`); the metric sums and the grad norm stay on the training device
    until `reduce_metrics` reads them at a log step. Each micro-batch's features are released to `target`
    (`target.release(batch)`, when it has one) after its backward: remote features keep at most two objects on
    the device (`regen.train.features.staging`).

    Features lost after the weights were agreed (`target.lost(batch)`, remote features reading ahead of compute:
    the micro-batch's object failed, or the reader stopped, mid-step): that micro-batch is trained with zero
    features and a zeroed loss mask, and its weight leaves the step's exactly as if it had been zeroed before:
    with "step" the gradient is Σ_i ∇(Σ w·term_i)·W / Σ_all w, linear in 1 / Σ_all w, so the lost weights of every
    rank are agreed after the backward (one control-plane all-reduce) and, when any was lost, the gradients and
    metric sums are multiplied by Σ_all w / (Σ_all w − lost) before the clip (equal to the serial path within
    rounding; without a loss nothing is multiplied: bit for bit); with "micro_batch" each micro-batch's own
    Σ_ranks w is its loss's divisor, so its lost weight is agreed before its forward (one all-reduce per
    micro-batch, where every rank already waits for its features).
    """
    import torch

    from regen.train.collectives import control_all_reduce_sum
    from regen.train.loss import decay_weights, evaluation_mask
    from regen.train.parallel import clip_grad_norm, set_gradient_sync

    cfg = model.config
    world = torch.distributed.get_world_size()
    gamma_w = None
    local_w = []
    for b, a, k in microbatches:
        ev = evaluation_mask(a, k, b["loss_mask"], cfg.block_size)
        gamma_w = decay_weights(cfg.block_size, cfg.loss_decay_gamma, ev.device) if gamma_w is None else gamma_w
        local_w.append((ev * gamma_w).sum())
    # Σ over ranks, per micro-batch slot: host values (one read per step), agreed on the control plane
    local_host = torch.stack(local_w).double().cpu() if local_w else torch.zeros(0, dtype=torch.float64)
    global_w = control_all_reduce_sum(local_host.clone(), "the step's loss weights").tolist()
    step_w = sum(global_w)
    # remote features reading ahead of compute: a micro-batch's features may be lost after the weights were agreed
    lost_of = getattr(target, "lost", None) if getattr(target, "read_ahead", 0) > 0 else None
    lost = [0.0] * len(microbatches)
    if loss_normalization not in ("step", "micro_batch"):
        raise ValueError(f"loss_normalization {loss_normalization!r}: use 'step' or 'micro_batch'")
    dev = microbatches[0][0]["input_ids"].device if microbatches else None
    sums = torch.zeros(6, dtype=torch.float64, device=dev)  # loss, ce, l1, conf, tau_prob·blocks, blocks (supervised)
    t_target = 0.0
    release = getattr(target, "release", None) or (lambda batch: None)  # remote features: at most 2 on the device
    loss_ok: list = []  # per micro-batch: a bool[1] device tensor, the loss is finite
    for i, (batch, anchors, keep) in enumerate(microbatches):
        set_gradient_sync(model, i == len(microbatches) - 1)
        tt = time.perf_counter()
        features = target.features_of(batch)
        t_target += time.perf_counter() - tt
        denominator = global_w[i]
        if lost_of is not None:
            if lost_of(batch) is not None:  # zero features: trained with zero weight, every rank in step
                zero_loss(batch)
                lost[i] = float(local_host[i])  # a host tensor: no device read
            if loss_normalization == "micro_batch":  # this micro-batch's own divisor, agreed before its loss
                gone = control_all_reduce_sum(torch.tensor([lost[i]], dtype=torch.float64),
                                              "a micro-batch's lost loss weight").tolist()[0]
                denominator, step_w = denominator - gone, step_w - gone
        loss, m = model(batch, features, anchors, keep, weights=loss_weights, denominator=denominator)
        loss_ok.append(torch.isfinite(m["loss"]).reshape(1))  # on the device: read once, after the clip
        if loss_normalization == "micro_batch":
            scale = 1.0 / len(microbatches)
        else:
            scale = global_w[i] / step_w if step_w > 0 else 0.0
        (loss * scale).backward()
        del features  # the backward freed what autograd saved: the features' device memory can take the next
        release(batch)
        # dspark_loss: loss = Σ_rank w·L / Σ_ranks w · world; metrics ce/l1/conf = that / world (device tensors)
        nsb = m["num_supervised_blocks"].double()
        sums += torch.stack([m["loss"].double() * (scale / world), m["ce"].double() * scale,
                             m["l1"].double() * scale, m["conf"].double() * scale,
                             m["tau_probabilistic"].double() * nsb, nsb])
    if lost_of is not None and loss_normalization == "step":
        gone = control_all_reduce_sum(torch.tensor(lost, dtype=torch.float64), "the step's lost loss weights")
        gone = float(gone.sum())
        if gone > 0:  # Σ w·term / Σ_all w  ->  Σ w·term / (Σ_all w − lost): one factor for the whole step
            factor = step_w / (step_w - gone) if step_w - gone > 0 else 0.0
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)
            sums[:4] *= factor
            step_w -= gone
    grad_norm = clip_grad_norm(model, grad_clip, as_tensor=True)
    # a non-finite loss or norm on any rank: no rank steps (regen.train.guard; clipping does not clean a NaN).
    # One device read for every flag of the step, then the agreement on the control plane.
    flags = torch.cat(loss_ok + [torch.isfinite(grad_norm).reshape(1)]).cpu().tolist() if microbatches else [True]
    bad_microbatches = [i for i, ok in enumerate(flags[:-1]) if not ok]
    # features whose values were not finite (remote features check them on the device as they are handed over):
    # the step is non-finite on this rank whatever its loss read, and the breach is named in the stop
    breaches = getattr(target, "take_breaches", dict)()
    keys = [tuple(b["key"]) if "key" in b else None for b, _, _ in microbatches]
    feature_breaches = {i: breaches[k] for i, k in enumerate(keys) if k in breaches}
    bad_microbatches = sorted(set(bad_microbatches) | set(feature_breaches))
    local_ok = flags[-1] and not bad_microbatches
    finite = control_all_reduce_sum(torch.tensor([0.0 if local_ok else 1.0], dtype=torch.float64),
                                    "the step's finiteness flags").tolist()[0] == 0.0
    if finite:
        opt.step()
    opt.zero_grad(set_to_none=True)
    tokens = sum(b["num_tokens"] if "num_tokens" in b else int(b["attention_mask"].sum()) for b, _, _ in microbatches)
    return {"sums": sums, "tokens": tokens, "target_s": t_target, "grad_norm": grad_norm, "weight": step_w,
            "finite": finite, "bad_microbatches": bad_microbatches,
            "feature_breaches": [feature_breaches[i] for i in sorted(feature_breaches)],
            "loss_finite": all(flags[:-1])}


def reduce_metrics(m: dict) -> dict:
    """Step metrics over all ranks from `train_step`'s partial sums (collective, control plane). The device
    values are read to the host here, once (a log step's one synchronisation)."""
    import torch

    from regen.train.collectives import control_all_reduce_sum

    host = torch.cat([m["sums"].detach().double().flatten(),
                      torch.as_tensor(m["grad_norm"]).detach().double().flatten().to(m["sums"].device)]).cpu()
    g = control_all_reduce_sum(torch.cat([host[:-1], torch.tensor([float(m["tokens"])], dtype=torch.float64)]),
                               "the step's metric sums").tolist()
    return {"loss": g[0], "ce": g[1], "l1": g[2], "conf": g[3], "tau_probabilistic": g[4] / max(1.0, g[5]),
            "tokens": int(g[6]), "grad_norm": float(host[-1]), "weight": m["weight"]}
