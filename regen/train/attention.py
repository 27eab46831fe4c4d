"""The draft's attention over [context; blocks]: dense SDPA with a pinned backend, or flex_attention with a block mask.

Shapes (B batch, nh heads, Q = N·K block queries, L = S + Q keys, d_qk / d_v head dims):
q [B, nh, Q, d_qk], k [B, nh, L, d_qk], v [B, nh, L, d_v] -> [B, nh, Q, d_v].

* `sdpa` (default): `F.scaled_dot_product_attention` with the dense boolean mask of
  `regen.train.loss.create_block_attention_mask` (rows with nothing to attend, the dummy blocks, attend
  everywhere: finite, and weighted 0 by the loss). On CUDA the backend is pinned to memory-efficient attention
  (`SDPA_BACKENDS`): cuDNN attention with an explicit mask has NaN-gradient reports on torch 2.11-2.13
  (pytorch/pytorch#196678, huggingface/trl#7181), and the math fallback would hold [nh, Q, L] probabilities per
  layer (16.7 GB at 32K rows); pinned, a fallback is an error instead of a silent change (gpu-readiness 1.4, 2.1).
* `flex`: `flex_attention` with a `BlockMask` built from the anchors (`dspark_block_mask`), so the tiles no
  query may see (about half of the context, all other blocks) are neither computed nor stored: TorchSpec's
  DFlash trainer does the same (`torchspec/models/dflash.py`, `torchspec/models/ops/flex_attention.py`).
  Compiled on CUDA (`torch.compile(flex_attention)`); torch 2.13 has no flex backward on CPU, so on CPU it
  serves forward passes only (tests compare it with the dense path there).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

IMPLS = ("sdpa", "flex")


def sdpa_backends():
    """The SDPA backends allowed on CUDA: memory-efficient attention only (see the module docstring)."""
    from torch.nn.attention import SDPBackend

    return [SDPBackend.EFFICIENT_ATTENTION]


def dspark_block_mask(anchors_BN, keep_BN, seq_len: int, block_size: int, attention_mask=None):
    """The DSpark training mask (`create_block_attention_mask`, with its fully-masked-row rule) as a flex
    `BlockMask` over Q = N·K queries and L = S + Q keys: query q of block b = q // K sees context key j < a_b
    (and `attention_mask[j]`), the K keys of its own block; a block with keep False sees every key."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, N = anchors_BN.shape
    S, K, dev = seq_len, block_size, anchors_BN.device
    anchors, keep = anchors_BN.long(), keep_BN.bool()
    visible = (attention_mask.bool() if attention_mask is not None
               else torch.ones(B, S, dtype=torch.bool, device=dev))

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // K
        is_ctx = kv_idx < S
        ctx = is_ctx & (kv_idx < anchors[b, blk]) & visible[b, kv_idx.clamp(max=S - 1)]
        own = ~is_ctx & ((kv_idx - S) // K == blk)
        return ~keep[b, blk] | ctx | own

    # compiled on CUDA (as TorchSpec does): eager create_block_mask materialises [Q, L] index grids, gigabytes at 32K
    return create_block_mask(mask_mod, B, None, N * K, S + N * K, device=dev, _compile=dev.type == "cuda")


def training_impl(name: str, device) -> str:
    """`train.attention` checked for training on `device`. Raises InputError for flex off CUDA (no backward)."""
    from regen.errors import InputError

    if name not in IMPLS:
        raise InputError(f"train.attention={name!r}: allowed values are {', '.join(IMPLS)}")
    if name == "flex" and torch.device(device).type != "cuda":
        raise InputError(f"train.attention=flex on {device}: torch {torch.__version__} has flex_attention's "
                         "backward on CUDA only; use train.attention=sdpa here")
    return name


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def attend(q, k, v, mask, scale: float):
    """Attention of q over k/v under `mask`: a dense bool [B, 1, Q, L] (True = attend) -> SDPA, or a `BlockMask`
    -> flex_attention. Returns [B, nh, Q, d_v] in q's dtype."""
    if mask is not None and not isinstance(mask, torch.Tensor):
        from torch.nn.attention.flex_attention import flex_attention

        fn = _compiled_flex() if q.is_cuda else flex_attention
        return fn(q, k, v, block_mask=mask, scale=scale)
    if q.is_cuda:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(sdpa_backends()):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
