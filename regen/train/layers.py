"""DSpark draft building blocks: RMSNorm, RoPE with DeepSeek-V3 YaRN, MLA and GQA block attention, SwiGLU,
the Markov and confidence heads. Assembled by `regen.train.model.DSparkDraft`; shapes as in its legend.

Spec: shared/docs/dspark.md §2 (K3 MLA table, DS Qwen3 attention), §3 (Markov head), §4 (confidence head).
Each attention takes block hidden states [B, Q, H] as queries and keys/values over [H_ctx; block] [B, S+Q, H]
with a bool mask [B, 1, Q, S+Q] (True = attend) or None (one block that sees its whole context).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from regen.train.attention import attend

if TYPE_CHECKING:
    from regen.train.draft_config import DSparkConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x.to(dtype)).to(dtype)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """DeepSeek-V3 YaRN attention factor `0.1·mscale·ln(scale) + 1` (1 when scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(dim: int, rope: dict) -> tuple[torch.Tensor, float]:
    """(inv_freq float32[dim/2], cos/sin scale) for `rope_type` default or yarn (DeepSeek-V3 YaRN)."""
    base = float(rope["rope_theta"])  # required: no silent 10,000 (DSparkConfig refuses a config without it)
    exps = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    freq_extra = 1.0 / base**exps
    if rope.get("rope_type", "default") != "yarn":
        return freq_extra.float(), 1.0
    factor = float(rope["factor"])
    orig = float(rope["original_max_position_embeddings"])
    beta_fast, beta_slow = float(rope.get("beta_fast", 32)), float(rope.get("beta_slow", 1))

    def corr_dim(n_rot):
        return dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extra_mask = 1.0 - ramp
    inv = (freq_extra / factor) * (1 - extra_mask) + freq_extra * extra_mask
    m = yarn_get_mscale(factor, rope.get("mscale", 1.0)) / yarn_get_mscale(factor, rope.get("mscale_all_dim", 0.0))
    return inv.float(), m


def softmax_scale(cfg: DSparkConfig, head_dim: int) -> float:
    """`m²/√d` with `m = yarn_get_mscale(factor, mscale_all_dim)` (spec §2: m²/√192 for K3), else 1/√d."""
    scale = head_dim**-0.5
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "yarn" and rope.get("mscale_all_dim"):
        m = yarn_get_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale = scale * m * m
    return scale


def apply_rope(x, cos, sin, interleave: bool):
    """x [..., L, R] rotated at cos/sin [.., L, R/2]; interleaved pairs (2i, 2i+1) or halves (i, i+R/2).

    cos/sin are cast to x's dtype (HF style): fp32 tables would promote bf16 q/k to fp32 and SDPA would refuse
    q/k fp32 with v bf16 wherever no FSDP2 `cast_forward_inputs` casts them (an unwrapped bf16 draft).
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Rotary(nn.Module):
    def __init__(self, dim: int, rope: dict):
        super().__init__()
        inv, self.mscale = rope_inv_freq(dim, rope)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions):
        """positions int64[B, L] -> (cos, sin) float32[B, 1, L, R/2] (broadcast over heads)."""
        ang = positions.float()[..., None] * self.inv_freq.to(positions.device)
        return (ang.cos() * self.mscale)[:, None], (ang.sin() * self.mscale)[:, None]


class MLAAttention(nn.Module):
    """K3 MLA attention (spec §2 table): queries from block tokens, keys/values from [ctx; block]."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.cfg = cfg
        H, nh = cfg.hidden_size, cfg.num_attention_heads
        self.nh, self.dn, self.dr, self.dv = nh, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(H, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(H, nh * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, cfg.kv_lora_rank + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, nh * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(nh * self.dv, H, bias=False)
        self.scale = softmax_scale(cfg, cfg.qk_head_dim)

    def forward(self, blk_BQH, ctx_BSH, rope_q, rope_k, mask):
        B, Q, _ = blk_BQH.shape
        if self.cfg.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(blk_BQH)))
        else:
            q = self.q_proj(blk_BQH)
        q = q.view(B, Q, self.nh, -1).transpose(1, 2)  # [B, nh, Q, dn+dr]
        q_nope, q_pe = q.split([self.dn, self.dr], dim=-1)
        q_pe = apply_rope(q_pe, *rope_q, self.cfg.rope_interleave)
        x = torch.cat([ctx_BSH, blk_BQH], dim=1)  # [B, S+Q, H]
        kv = self.kv_a_proj_with_mqa(x)
        c, k_pe = kv.split([self.cfg.kv_lora_rank, self.dr], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(B, x.shape[1], self.nh, self.dn + self.dv).transpose(1, 2)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        k_pe = apply_rope(k_pe[:, None], *rope_k, self.cfg.rope_interleave)  # one shared rotary key head
        k = torch.cat([k_nope, k_pe.expand(-1, self.nh, -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        o = attend(q, k, v, mask, self.scale)  # dense SDPA (pinned on CUDA) or flex with a BlockMask
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, self.nh * self.dv))


class GQAAttention(nn.Module):
    """DS Qwen3-style attention (spec §2): shared k/v projections for ctx and block, q_norm/k_norm, non-causal."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.cfg = cfg
        H, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(H, nh * hd, bias=False)
        self.k_proj = nn.Linear(H, nkv * hd, bias=False)
        self.v_proj = nn.Linear(H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.scale = softmax_scale(cfg, hd)

    def forward(self, blk_BQH, ctx_BSH, rope_q, rope_k, mask):
        B, Q, _ = blk_BQH.shape
        x = torch.cat([ctx_BSH, blk_BQH], dim=1)
        q = self.q_norm(self.q_proj(blk_BQH).view(B, Q, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, x.shape[1], self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, x.shape[1], self.nkv, self.hd).transpose(1, 2)
        q = apply_rope(q, *rope_q, self.cfg.rope_interleave)
        k = apply_rope(k, *rope_k, self.cfg.rope_interleave)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = attend(q, k, v, mask, self.scale)  # dense SDPA (pinned on CUDA) or flex with a BlockMask
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, H: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg) if cfg.attention_type == "mla" else GQAAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h_BQH, ctx_BSH, rope_q, rope_k, mask):
        # H_ctx is the same (already normed) tensor for every layer (spec §2, P eq. 2)
        h_BQH = h_BQH + self.self_attn(self.input_layernorm(h_BQH), ctx_BSH, rope_q, rope_k, mask)
        return h_BQH + self.mlp(self.post_attention_layernorm(h_BQH))


class MarkovHead(nn.Module):
    """Vanilla low-rank Markov bias `B(x_prev) = W2(W1[x_prev])` (spec §3).

    W1: Embedding(vocab, rank) over target token ids; W2: Linear(rank, out_vocab) onto the draft's output
    vocabulary (= vocab, or the reduced draft vocabulary of `DSparkConfig.draft_vocab_size`).
    """

    def __init__(self, vocab: int, rank: int, out_vocab: int | None = None):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, out_vocab or vocab, bias=False)

    def forward(self, prev_ids):
        return self.markov_w2(self.markov_w1(prev_ids))


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 1)

    def forward(self, x):
        return self.proj(x).squeeze(-1)
