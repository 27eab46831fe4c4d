"""The draft built on the meta device and materialised where it trains (torchtitan's order: meta, then device).

`DSparkDraft.from_target(...).to(device)` builds the whole draft on the host in fp32, frozen embed_tokens and
lm_head included (23.6 GB per rank for kimi-k3, 94 GB per 4-GPU tray, ~5.9B single-threaded `normal_` draws),
copies the target's head into those fp32 copies only to replace them with the target's own tensors, then
copies everything to the GPU (gpu-readiness finding 9). `build_draft` instead:

1. builds the module tree on the meta device (no storage, no draws);
2. points the frozen embed_tokens / lm_head at the target head's tensors (shared when the dtype and device
   match; else one copy in `frozen_dtype` on `device`; the reduced draft vocabulary's lm_head rows are
   gathered there);
3. materialises every other parameter and buffer on `device` (`to_empty`, module by module) and initialises
   it there as `DSparkDraft.__init__` does (normal(0, 0.02) weights, zero biases, RMSNorm ones, the rotary
   table), in the same module order, from torch's generator of that device (seed it on every rank: identical
   weights everywhere before sharding).

The frozen tensors draw no random numbers here, so the trainable weights differ from `from_target`'s for the
same seed (which also draws them); the distribution is the same.
"""
from __future__ import annotations

import torch
from torch import nn

from regen.train.layers import RMSNorm, Rotary, rope_inv_freq


def build_draft(target_model, cfg, device, *, draft_vocab=None, frozen_dtype=None):
    """A DSparkDraft on `device` (torch.device or str), trainable parameters fp32, frozen embed_tokens/lm_head the
    target's (`frozen_dtype`, default the target's dtype). draft_vocab: int64[Vd] target ids (required iff
    cfg.draft_vocab_size). Raises ValueError like `DSparkDraft.from_target` (shapes, draft vocabulary)."""
    from regen.train.model import DSparkDraft, target_head_weights

    device = torch.device(device)
    with torch.device("meta"):
        draft = DSparkDraft(cfg)
    emb, head = target_head_weights(target_model, cfg)
    if cfg.draft_vocab_size and draft_vocab is None:
        raise ValueError(f"draft_vocab_size={cfg.draft_vocab_size} needs the draft vocabulary's target ids "
                         "(regen.train.draft_vocab.select_draft_vocab)")
    frozen = {draft.embed_tokens, draft.lm_head}
    for module in draft.modules():  # materialise everything but the frozen head, module by module
        if module not in frozen:
            module.to_empty(device=device, recurse=False)
    if cfg.draft_vocab_size:
        draft.set_draft_vocab(draft_vocab)
    dtype = frozen_dtype or emb.dtype
    with torch.no_grad():
        rows = head.detach() if not cfg.draft_vocab_size else head.detach()[draft.draft_vocab().to(head.device)]
        for module, w in ((draft.embed_tokens, emb.detach()), (draft.lm_head, rows)):
            shared = w if w.dtype == dtype and w.device == device else w.to(device=device, dtype=dtype)
            module.weight = nn.Parameter(shared, requires_grad=False)
    init_trainable(draft)
    return draft


@torch.no_grad()
def init_trainable(draft) -> None:
    """Initialise the materialised (non-frozen) parameters and buffers in place, as `DSparkDraft.__init__`."""
    frozen = {draft.embed_tokens, draft.lm_head}
    for module in _post_order(draft):  # the order of nn.Module.apply: children first, then the module
        if module in frozen:
            continue
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, Rotary):
            inv, _ = rope_inv_freq(module.inv_freq.numel() * 2, draft.config.rope_parameters)
            module.inv_freq.copy_(inv.to(module.inv_freq.device))


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module
