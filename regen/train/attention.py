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
  On CUDA the mask builder and flex_attention are each compiled once per process (module scope), the row lengths
  bucketed (`flex_bucket`, at most 25% padding) so a run compiles a few shapes, the compilations counted
  (`FLEX_STATS`), and dynamo's silent fallback to eager flex (dense scores, about 33 GB per layer at 32K) refused
  with an error, as is a shape past FLEX_MAX_SHAPES. torch 2.13 has no flex backward on CPU, so on CPU it
  serves forward passes only, eagerly (tests compare it with the dense path there).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IMPLS = ("sdpa", "flex")


def sdpa_backends():
    """The SDPA backends allowed on CUDA: memory-efficient attention only (see the module docstring)."""
    from torch.nn.attention import SDPBackend

    return [SDPBackend.EFFICIENT_ATTENTION]


FLEX_BUCKETS_PER_OCTAVE = 4  # row lengths rounded up to 4 steps per power of two: at most 25% padding
FLEX_MIN_BUCKET = 128  # flex's tile size: every bucketed length is a multiple of it
FLEX_MAX_SHAPES = 48  # compiled (batch, queries, keys) shapes allowed per process; past it: an error, never eager
FLEX_STATS = {"shapes": set(), "mask_compiles": 0, "attention_compiles": 0}  # per process (tests read it)


def flex_bucket(n: int) -> int:
    """`n` rounded up to its bucket: a multiple of FLEX_MIN_BUCKET, FLEX_BUCKETS_PER_OCTAVE steps per power of two
    (e.g. 4,097 -> 5,120, 32,768 -> 32,768, 33,000 -> 40,960), so a run compiles a few shapes, not one per row."""
    n = max(int(n), 1)
    step = max(FLEX_MIN_BUCKET, (1 << max(0, (n - 1).bit_length() - 1)) // FLEX_BUCKETS_PER_OCTAVE)
    return -(-n // step) * step


@dataclass(frozen=True)
class FlexMask:
    """A flex `BlockMask` over bucketed lengths (q_bucket queries, kv_bucket keys) and the real ones it serves:
    `attend` pads q to q_bucket and k/v to kv_bucket (padding keys are seen by no real query; a padding query
    sees key 0 only) and returns the first q_len rows."""
    block_mask: object
    q_len: int
    kv_len: int
    q_bucket: int
    kv_bucket: int

    def sparsity(self) -> float:
        """Percent of the bucketed mask's tiles skipped (`BlockMask.sparsity`)."""
        return self.block_mask.sparsity()


def _dspark_mask_mod(anchors, keep, visible, num_ctx, num_q, K: int):
    """The mask_mod of `dspark_block_mask`. Its tensors are captured by the closure (inputs of the compiled
    builder, guarded by shape, not by value), so a new micro-batch of the same bucketed shape compiles nothing;
    the real lengths are 0-d tensors for the same reason. K (block_size) is a constant of the run."""
    N_b, S_b = anchors.shape[1], visible.shape[1]

    def mask_mod(b, h, q_idx, kv_idx):
        blk = (q_idx // K).clamp(max=N_b - 1)
        is_ctx = kv_idx < num_ctx
        real_kv = kv_idx < num_ctx + num_q
        ctx = is_ctx & (kv_idx < anchors[b, blk]) & visible[b, kv_idx.clamp(max=S_b - 1)]
        own = ~is_ctx & real_kv & ((kv_idx - num_ctx) // K == blk)
        real = (~keep[b, blk] & real_kv) | ctx | own
        return torch.where(q_idx < num_q, real, kv_idx == 0)

    return mask_mod


def dspark_block_mask(anchors_BN, keep_BN, seq_len: int, block_size: int, attention_mask=None) -> FlexMask:
    """The DSpark training mask (`create_block_attention_mask`, with its fully-masked-row rule) as a flex
    `BlockMask` over Q = N·K queries and L = S + Q keys: query q of block b = q // K sees context key j < a_b
    (and `attention_mask[j]`), the K keys of its own block; a block with keep False sees every key.

    Built over bucketed lengths (`flex_bucket` of S and of Q) by one compiled `create_block_mask` kept at module
    scope (`_compiled("mask")`; eager `create_block_mask` materialises [Q, L] index grids, gigabytes at 32K), on
    CUDA; on CPU eagerly (tests). Raises RuntimeError past FLEX_MAX_SHAPES compiled shapes (`_count_shape`)."""
    B, N = anchors_BN.shape
    S, K, dev = seq_len, block_size, anchors_BN.device
    S_b, Q_b = flex_bucket(S), flex_bucket(N * K)
    N_b = -(-Q_b // K)
    pad_n = N_b - N
    anchors = F.pad(anchors_BN.long(), (0, pad_n))
    keep = F.pad(keep_BN.bool(), (0, pad_n))
    visible = (attention_mask.bool() if attention_mask is not None
               else torch.ones(B, S, dtype=torch.bool, device=dev))
    visible = F.pad(visible, (0, S_b - S))
    num_ctx = torch.tensor(S, device=dev)
    num_q = torch.tensor(N * K, device=dev)
    mask_mod = _dspark_mask_mod(anchors, keep, visible, num_ctx, num_q, K)
    L_b = S_b + Q_b
    if dev.type == "cuda":
        _count_shape((B, Q_b, L_b))
        block_mask = _guarded("mask", _compiled("mask"), mask_mod, B, None, Q_b, L_b, device=dev)
    else:
        from torch.nn.attention.flex_attention import create_block_mask

        block_mask = create_block_mask(mask_mod, B, None, Q_b, L_b, device=dev)
    return FlexMask(block_mask, N * K, S + N * K, Q_b, L_b)


def _count_shape(shape: tuple) -> None:
    """Count a compiled (batch, queries, keys) shape; refuse one past FLEX_MAX_SHAPES (each is a compilation of
    the mask builder and of flex_attention, forward and backward)."""
    if shape in FLEX_STATS["shapes"]:
        return
    if len(FLEX_STATS["shapes"]) >= FLEX_MAX_SHAPES:
        raise RuntimeError(
            f"train.attention=flex: a {len(FLEX_STATS['shapes']) + 1}th shape {shape} (batch, queries, keys) to "
            f"compile, past the limit of {FLEX_MAX_SHAPES} (shapes so far: {sorted(FLEX_STATS['shapes'])}); rows "
            "are bucketed by length, so this many means batches of very different shapes: use train.attention=sdpa")
    FLEX_STATS["shapes"].add(shape)


def _guarded(what: str, fn, *args, **kwargs):
    """Call a compiled function with dynamo's silent fallback to eager turned into an error (an eager
    flex_attention builds the dense [B, nh, Q, L] scores: about 33 GB per layer at 32K), and count its
    compilations in FLEX_STATS[what + "_compiles"]."""
    import torch._dynamo.config as dynamo_config
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    try:
        with dynamo_config.patch(recompile_limit=FLEX_MAX_SHAPES + 2, fail_on_recompile_limit_hit=True):
            return fn(*args, **kwargs)
    except Exception as exc:
        if "recompile" in type(exc).__name__.lower() or "recompile_limit" in str(exc):
            raise RuntimeError(f"train.attention=flex: torch.compile hit its recompile limit in the {what} "
                               f"({FLEX_STATS[what + '_compiles']} compilations so far) and would fall back to eager "
                               "flex_attention, which builds the dense scores: refused. Use train.attention=sdpa, "
                               "or rows of fewer distinct lengths") from exc
        raise
    finally:
        FLEX_STATS[what + "_compiles"] += counters["stats"]["unique_graphs"] - before


def training_impl(name: str, device) -> str:
    """`train.attention` checked for training on `device`. Raises InputError for flex off CUDA (no backward)."""
    from regen.errors import InputError

    if name not in IMPLS:
        raise InputError(f"train.attention={name!r}: allowed values are {', '.join(IMPLS)}")
    if name == "flex" and torch.device(device).type != "cuda":
        raise InputError(f"train.attention=flex on {device}: torch {torch.__version__} has flex_attention's "
                         "backward on CUDA only; use train.attention=sdpa here")
    return name


@functools.lru_cache(maxsize=None)
def _compiled(what: str):
    """The process's one compiled mask builder ("mask") and one compiled flex_attention ("attention"), made once
    (not `create_block_mask(..., _compile=True)`, deprecated, which wraps a new compile on every call)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return torch.compile(create_block_mask if what == "mask" else flex_attention, dynamic=False)


def attend(q, k, v, mask, scale: float):
    """Attention of q over k/v under `mask`: a dense bool [B, 1, Q, L] (True = attend) -> SDPA, or a `FlexMask`
    -> flex_attention (compiled on CUDA, guarded: never an eager fallback there; eager on CPU, forward only).
    Returns [B, nh, Q, d_v] in q's dtype."""
    if isinstance(mask, FlexMask):
        from torch.nn.attention.flex_attention import flex_attention

        Q, L = q.shape[2], k.shape[2]
        if (Q, L) != (mask.q_len, mask.kv_len):
            raise ValueError(f"flex mask built for {mask.q_len} queries and {mask.kv_len} keys, attention has {Q} "
                             f"and {L}")
        q = F.pad(q, (0, 0, 0, mask.q_bucket - Q))
        k, v = (F.pad(t, (0, 0, 0, mask.kv_bucket - L)) for t in (k, v))
        if q.is_cuda:
            out = _guarded("attention", _compiled("attention"), q, k, v, block_mask=mask.block_mask, scale=scale)
        else:
            out = flex_attention(q, k, v, block_mask=mask.block_mask, scale=scale)
        return out[:, :, :Q]
    if q.is_cuda:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(sdpa_backends()):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
