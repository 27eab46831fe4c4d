"""The DSpark draft model: tap context path, MLA (or GQA) block backbone, Markov and confidence heads.

Single-device code; parallelism is applied elsewhere (`regen.train.parallel`); building blocks (norms, YaRN RoPE,
MLA/GQA attention, heads) live in `regen.train.layers`. Spec: shared/docs/dspark.md
(DS = deepseek-ai/DeepSpec, TK/TS = the K3 MLA drafts; section numbers below are the spec's).

Shape legend:
    B  batch (sequences)            S  context length (tokens of the sequence)
    N  anchors (blocks) per row     K  block_size slots (7): [anchor, MASK, ...]
    Q  N*K block queries            H  draft hidden size (== target hidden size: embeddings are shared)
    Ht target hidden size           T  number of taps (len(target_layer_ids))
    V  vocabulary (the target's)    Vd output vocabulary: V, or draft_vocab_size when set
    r  markov_rank
    nh attention heads              R  rope dims (qk_rope_head_dim)

Slot k (0-based here, 1-based `k` in the spec) of the block anchored at position a predicts x[a+k+1];
its Markov "previous token" is x[a+k] (the anchor for slot 0; teacher-forced in training, the sampled draft
token at inference, spec §3).

Reduced draft vocabulary (optional, `draft_vocab_size`; EAGLE-3, Li et al. 2025, arXiv 2503.01840, and
SpecForge's `draft_vocab_size`; FR-Spec, arXiv 2502.14856, for the frequency ranking): the output layer keeps
only the lm_head rows of the Vd most frequent supervised tokens of the training data. Buffers follow the
EAGLE-3 checkpoint convention: `d2t` int64[Vd] with target_id = draft_index + d2t[draft_index] and `t2d`
bool[V] marking the target ids in the draft vocabulary; inputs (anchor, mask, Markov previous token) stay
target ids. Off (0) for the K3 presets: the spec's serving contract has the full vocabulary (§8).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from regen.train.draft_config import (  # re-exported: part of this module's API
    CONFIG_NAME,
    FROZEN_PREFIXES,
    WEIGHTS_NAME,
    DSparkConfig,
    kimi_k3_config,
    small_config_for_target,
)
from regen.train.layers import (  # re-exported: part of this module's API
    ConfidenceHead,
    DecoderLayer,
    MarkovHead,
    RMSNorm,
    Rotary,
    apply_rope,
    rope_inv_freq,
    softmax_scale,
    yarn_get_mscale,
)

__all__ = ["DSparkConfig", "DSparkDraft", "kimi_k3_config", "small_config_for_target", "build_meta",
           "count_parameters", "save_draft", "load_draft", "k3_param_report", "RMSNorm", "Rotary", "apply_rope",
           "rope_inv_freq", "softmax_scale", "yarn_get_mscale", "MarkovHead", "ConfidenceHead", "DecoderLayer"]


# ----------------------------------------------------------------------------------------------- the draft


def target_head_weights(target_model, cfg):
    """(embedding weight, lm_head weight) of `target_model`, both [vocab_size, hidden_size] of the draft config
    `cfg`; ValueError when either shape differs."""
    emb = target_model.get_input_embeddings().weight
    head = target_model.get_output_embeddings().weight
    want = (cfg.vocab_size, cfg.hidden_size)
    if tuple(emb.shape) != want or tuple(head.shape) != want:
        raise ValueError(f"target embeddings {tuple(emb.shape)} / lm_head {tuple(head.shape)} != {want}: "
                         "the draft's hidden_size and vocab_size must equal the target's")
    return emb, head


class DSparkDraft(nn.Module):
    """DSpark block drafter (spec §1-§4). Trainable: context path, backbone, Markov and confidence heads;
    `embed_tokens` and `lm_head` are frozen copies of the target's (spec §5).

    Weight names follow the K3 MLA checkpoint (spec §8): `fc_norm.{i}`, `context_proj`, `context_norm`,
    `layers.{l}.self_attn.{q_a_proj,...}`, `final_norm`, `markov_head.markov_w{1,2}`, `confidence_head.proj`.
    """

    attention_impl = "sdpa"  # "sdpa" (dense mask, pinned backend on CUDA) | "flex" (BlockMask); regen.train.attention

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.config = cfg
        T, Ht, H, V, Vd = (cfg.num_target_layers, cfg.target_hidden_size, cfg.hidden_size, cfg.vocab_size,
                           cfg.output_vocab_size)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(Ht, cfg.rms_norm_eps) for _ in range(T))
        self.context_proj = nn.Linear(T * Ht, H, bias=False)
        self.context_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.final_norm = RMSNorm(H, cfg.rms_norm_eps)
        rope_dim = cfg.qk_rope_head_dim if cfg.attention_type == "mla" else cfg.head_dim
        self.rotary = Rotary(rope_dim, cfg.rope_parameters)
        self.embed_tokens = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        if cfg.draft_vocab_size:  # EAGLE-3 buffers, filled by set_draft_vocab or a checkpoint
            self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))
        r = cfg.markov_rank
        self.markov_head = MarkovHead(V, r, Vd) if r > 0 else None
        if cfg.enable_confidence_head:
            extra = r if (cfg.confidence_head_with_markov and r > 0) else 0
            self.confidence_head = ConfidenceHead(H + extra)
        else:
            self.confidence_head = None
        self.apply(self._init_weights)
        for p in (*self.embed_tokens.parameters(), *self.lm_head.parameters()):
            p.requires_grad_(False)

    @staticmethod
    def _init_weights(m):
        # HF post_init: normal(0, 0.02), zero bias (spec §3 "our reading")
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target_model, cfg: DSparkConfig, draft_vocab=None) -> "DSparkDraft":
        """A randomly initialised draft with `embed_tokens`/`lm_head` copied (frozen) from an HF causal LM.

        draft_vocab: int64[Vd] target ids of the reduced output vocabulary (required iff cfg.draft_vocab_size;
        see `regen.train.draft_vocab`). Raises ValueError when the target's embedding shape differs from
        (vocab_size, hidden_size) or the draft vocabulary is missing or invalid.
        """
        draft = cls(cfg)
        if cfg.draft_vocab_size:
            if draft_vocab is None:
                raise ValueError(f"draft_vocab_size={cfg.draft_vocab_size} needs the draft vocabulary's target ids "
                                 "(regen.train.draft_vocab.select_draft_vocab)")
            draft.set_draft_vocab(draft_vocab)
        draft.copy_frozen_from(target_model)
        return draft

    def copy_frozen_from(self, target_model) -> None:
        """Copy the target's embeddings and lm_head (its draft-vocabulary rows when reduced) into this draft."""
        cfg = self.config
        emb, head = target_head_weights(target_model, cfg)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(emb.detach().float())
            rows = head.detach() if not cfg.draft_vocab_size else head.detach()[self.draft_vocab().to(head.device)]
            self.lm_head.weight.copy_(rows.float())

    # -- reduced draft vocabulary (EAGLE-3 d2t/t2d) ----------------------------------------------------------
    def set_draft_vocab(self, target_ids) -> None:
        """Set the reduced output vocabulary: `target_ids` int64[Vd], unique, each in [0, V). Raises ValueError."""
        cfg = self.config
        ids = torch.as_tensor(target_ids, dtype=torch.long).flatten().unique(sorted=True)
        if ids.numel() != cfg.draft_vocab_size or int(ids[0]) < 0 or int(ids[-1]) >= cfg.vocab_size:
            raise ValueError(f"draft vocabulary: {ids.numel()} unique ids in [{int(ids[0])}, {int(ids[-1])}]; "
                             f"want draft_vocab_size={cfg.draft_vocab_size} ids in [0, {cfg.vocab_size})")
        with torch.no_grad():
            self.d2t.copy_(ids.to(self.d2t.device) - torch.arange(ids.numel(), device=self.d2t.device))
            self.t2d.zero_()
            self.t2d[ids.to(self.t2d.device)] = True

    def draft_vocab(self) -> torch.Tensor | None:
        """Target ids of the output rows, int64[Vd] ascending; None with the full vocabulary."""
        if not self.config.draft_vocab_size:
            return None
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Output-row indices (argmax of the logits) -> target token ids (identity with the full vocabulary)."""
        return idx if not self.config.draft_vocab_size else idx + self.d2t[idx]

    def to_draft_index(self, target_ids: torch.Tensor, *, check: bool = True) -> torch.Tensor:
        """Target ids -> output-row indices. Raises ValueError for ids outside the draft vocabulary (mask them
        out of the loss first: `in_draft_vocab`). check=False: the caller checked them already (on the host,
        `regen.train.loss.slot_layout`), so no device value is read here."""
        if not self.config.draft_vocab_size:
            return target_ids
        if check and target_ids.numel() and not bool(self.t2d[target_ids].all()):
            raise ValueError("supervised target tokens outside the draft vocabulary: mask them out of the loss "
                             "with DSparkDraft.in_draft_vocab (regen.train.step.prepare_microbatch does)")
        return torch.cumsum(self.t2d, 0)[target_ids] - 1

    def in_draft_vocab(self, target_ids: torch.Tensor) -> torch.Tensor:
        """bool, same shape: which target ids the draft can propose (all True with the full vocabulary)."""
        if not self.config.draft_vocab_size:
            return torch.ones_like(target_ids, dtype=torch.bool)
        return self.t2d[target_ids]

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    # -- pieces ---------------------------------------------------------------------------------
    def context(self, taps_BSX: torch.Tensor) -> torch.Tensor:
        """taps [B, S, T·Ht] (ascending tap order) -> H_ctx [B, S, H] = context_norm(W_c · concat) (spec §1)."""
        if self.config.fc_norm:
            chunks = taps_BSX.split(self.config.target_hidden_size, dim=-1)
            taps_BSX = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks)], dim=-1)
        x = taps_BSX.to(self.context_proj.weight.dtype)
        return self.context_norm(self.context_proj(x))

    def embed(self, ids):
        return self.embed_tokens(ids) * self.config.embed_scale

    def backbone(self, ctx_BSH, block_ids_BQ, ctx_pos_BS, blk_pos_BQ, mask_BQL=None):
        """Block hidden states, final-normed: [B, Q, H]. `mask_BQL` bool [B, Q, S+Q], True = attend."""
        h = self.embed(block_ids_BQ).to(ctx_BSH.dtype)
        rope_q = self.rotary(blk_pos_BQ)
        rope_k = self.rotary(torch.cat([ctx_pos_BS, blk_pos_BQ], dim=1))
        if isinstance(mask_BQL, torch.Tensor):  # (a flex BlockMask carries the same rule itself)
            # rows with nothing to attend (dummy blocks) attend everywhere: finite, and weighted 0 by the loss
            mask_BQL = mask_BQL | ~mask_BQL.any(-1, keepdim=True)
            mask_BQL = mask_BQL[:, None]
        for layer in self.layers:
            h = layer(h, ctx_BSH, rope_q, rope_k, mask_BQL)
        return self.final_norm(h)

    def forward(self, taps_BSX, input_ids_BS, anchors_BN, keep_BN, position_ids_BS=None, attention_mask_BS=None):
        """Training pass: final-normed hidden [B, N, K, H] for blocks `[x_a, MASK×(K−1)]` at each anchor a.

        Block slot k sits at position `pos[a] + k`; context at `pos[0..S−1]` (default arange). Mask: spec §2.
        """
        from regen.train.loss import create_block_attention_mask

        B, S = input_ids_BS.shape
        N, K = anchors_BN.shape[1], self.config.block_size
        if position_ids_BS is None:
            position_ids_BS = torch.arange(S, device=input_ids_BS.device).expand(B, S)
        block_ids = torch.full((B, N, K), self.config.mask_token_id, dtype=torch.long, device=input_ids_BS.device)
        block_ids[:, :, 0] = input_ids_BS.gather(1, anchors_BN).long()
        blk_pos = position_ids_BS.gather(1, anchors_BN)[..., None] + torch.arange(K, device=anchors_BN.device)
        if self.attention_impl == "flex":  # block-sparse: masked tiles neither computed nor stored
            from regen.train.attention import dspark_block_mask

            mask = dspark_block_mask(anchors_BN, keep_BN, S, K, attention_mask=attention_mask_BS)
        else:
            mask = create_block_attention_mask(anchors_BN, keep_BN, S, K, attention_mask=attention_mask_BS)
        ctx = self.context(taps_BSX)
        h = self.backbone(ctx, block_ids.view(B, N * K), position_ids_BS, blk_pos.view(B, N * K), mask)
        return h.view(B, N, K, -1)

    def base_logits(self, hidden):
        """U = lm_head(hidden): float32[..., Vd], with the target's final logit soft-capping when it has one."""
        logits = self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def markov_bias(self, prev_ids):
        """B(x_prev) float32[..., Vd] for target ids `prev_ids` (spec §3); None when markov_rank == 0."""
        return None if self.markov_head is None else self.markov_head(prev_ids).float()

    def corrected_logits(self, hidden, prev_ids):
        """ℓ = U + W2·W1[x_prev] (teacher forcing: prev_ids are the ground-truth previous tokens)."""
        logits = self.base_logits(hidden)
        bias = self.markov_bias(prev_ids)
        return logits if bias is None else logits + bias

    def confidence_logits(self, hidden, prev_ids):
        """Pre-sigmoid c_k = w·[h_k ; W1[x_{k−1}]] + b (spec §4), or None without a confidence head."""
        if self.confidence_head is None:
            return None
        x = hidden
        if self.config.confidence_head_with_markov and self.markov_head is not None:
            x = torch.cat([hidden, self.markov_head.markov_w1(prev_ids).to(hidden.dtype)], dim=-1)
        return self.confidence_head(x).float()

    # -- inference ------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, taps_SX, anchor_token: int, anchor_pos: int, *, temperature: float = 0.0,
                top_p: float = 1.0, generator: torch.Generator | None = None, position_ids_S=None,
                return_probs: bool = False):
        """One block proposal (spec §2 Inference, DS `draft_ops`): (draft tokens int64[K], confidence f32[K]),
        plus, with `return_probs`, q float32[K, V]: the distribution each token was drawn from, in target ids.

        taps_SX: [a, T·Ht] target features of the committed positions `< anchor_pos` (= a); the block is
        `[anchor, MASK…]` at positions a…a+K−1; one backbone pass gives U_1…U_K, then for k = 1…K
        `ℓ_k = U_k + W2·W1[x_{k−1}]` (x_0 = anchor) and x_k = argmax (T=0) or a draw from
        q_k = `regen.train.sampling.sampling_probs(ℓ_k, T, top_p)` (T > 0), x_{k−1} being the token drawn at slot
        k−1: q_k is the per-slot proposal that rejection sampling needs (`regen.train.sampling`). With a reduced
        draft vocabulary q_k is 0 outside it. At T=0, q_k is one-hot on the argmax.
        """
        from regen.train.sampling import sampling_probs

        cfg, dev = self.config, taps_SX.device
        K, S = cfg.block_size, taps_SX.shape[0]
        ctx_pos = position_ids_S[None] if position_ids_S is not None else torch.arange(S, device=dev)[None]
        blk_pos = (anchor_pos + torch.arange(K, device=dev))[None]
        ids = torch.full((1, K), cfg.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = anchor_token
        h = self.backbone(self.context(taps_SX[None]), ids, ctx_pos, blk_pos, None)[0]  # [K, H]
        U = self.base_logits(h)
        tokens, conf, probs = [], [], []
        prev = torch.tensor(anchor_token, device=dev)
        for k in range(K):
            bias = self.markov_bias(prev)
            logits = U[k] if bias is None else U[k] + bias
            if temperature <= 0:
                x = logits.argmax()
                q = torch.zeros_like(logits).scatter_(-1, x[None], 1.0) if return_probs else None
            else:
                q = sampling_probs(logits, temperature, top_p)
                x = torch.multinomial(q, 1, generator=generator)[0]
            if return_probs:
                probs.append(q if not cfg.draft_vocab_size else
                             torch.zeros(cfg.vocab_size, device=dev).index_copy_(0, self.draft_vocab(), q))
            x = self.to_target_ids(x)
            c = self.confidence_logits(h[k], prev)
            conf.append(torch.sigmoid(c) if c is not None else torch.ones((), device=dev))
            tokens.append(x)
            prev = x
        out = (torch.stack(tokens), torch.stack(conf).float())
        return (*out, torch.stack(probs).float()) if return_probs else out

    @torch.no_grad()
    def propose_batch(self, taps_BSX, input_ids_BS, anchors_BN, keep_BN=None, *, position_ids_BS=None):
        """Greedy proposals for many anchors at once: (tokens int64[B, N, K], confidence f32[B, N, K]).

        Equal to `propose` at each anchor a (features of positions < a, anchor token input_ids[a]), because
        the training mask gives each block exactly that context; the Markov correction is applied slot by
        slot on the block's own argmax tokens. Used by `regen.train.eval` to replay a whole generation in one pass.
        """
        if keep_BN is None:
            keep_BN = torch.ones_like(anchors_BN, dtype=torch.bool)
        h = self(taps_BSX, input_ids_BS, anchors_BN, keep_BN, position_ids_BS)  # [B, N, K, H]
        prev = input_ids_BS.long().gather(1, anchors_BN)
        tokens, conf = [], []
        for k in range(self.config.block_size):
            logits = self.corrected_logits(h[:, :, k], prev)
            c = self.confidence_logits(h[:, :, k], prev)
            conf.append(torch.sigmoid(c) if c is not None else torch.ones_like(prev, dtype=torch.float32))
            prev = self.to_target_ids(logits.argmax(-1))
            tokens.append(prev)
        return torch.stack(tokens, -1), torch.stack(conf, -1).float()


# ----------------------------------------------------------------------------------------------- io


def count_parameters(model: nn.Module) -> dict:
    """Parameter counts by group (works on the meta device): total, frozen (embed_tokens+lm_head), ..."""
    groups = {"total": 0, "embed_tokens": 0, "lm_head": 0, "markov_head": 0, "confidence_head": 0,
              "backbone_and_context": 0, "num_tensors": 0}
    for name, p in model.named_parameters():
        n = p.numel()
        groups["total"] += n
        groups["num_tensors"] += 1
        top = name.split(".")[0]
        groups[top if top in groups else "backbone_and_context"] += n
    groups["serving_without_embed"] = groups["total"] - groups["embed_tokens"]
    return groups


def build_meta(cfg: DSparkConfig) -> DSparkDraft:
    """The draft on the meta device: shapes and parameter counts without allocating any storage."""
    with torch.device("meta"):
        return DSparkDraft(cfg)


def save_draft(draft: DSparkDraft, out_dir: str | Path, *, include_frozen: bool = False) -> None:
    """Write `config.json` + `model.safetensors` (atomic). Frozen embed/lm_head are skipped unless asked:
    they are the target's and `load_draft(..., target_model=)` restores them."""
    from safetensors.torch import save_file

    from schemas.io import write_json_atomic

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()
             if include_frozen or not k.startswith(FROZEN_PREFIXES)}
    tmp = out / (WEIGHTS_NAME + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS_NAME)
    write_json_atomic(draft.config.to_dict(), out / CONFIG_NAME)


def load_draft(draft_dir: str | Path, target_model=None, map_location="cpu") -> DSparkDraft:
    """Load a draft written by `save_draft` (or any checkpoint with these weight names).

    Missing `embed_tokens`/`lm_head` are copied from `target_model`; raises ValueError when they are missing
    and no target is given, or when any other weight is missing or unexpected.
    """
    from safetensors.torch import load_file

    d = Path(draft_dir)
    cfg = DSparkConfig.from_json(d / CONFIG_NAME)
    draft = DSparkDraft(cfg)
    state = load_file(str(d / WEIGHTS_NAME), device=str(map_location))
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (target_model is not None and k.startswith(FROZEN_PREFIXES))]
    if missing or unexpected:
        raise ValueError(f"{d / WEIGHTS_NAME}: missing weights {missing[:8]}, unexpected {unexpected[:8]}")
    if target_model is not None:  # after the d2t/t2d buffers are loaded: lm_head rows follow them
        draft.copy_frozen_from(target_model)
    return draft


def k3_param_report(**overrides) -> dict:
    """Parameter counts of the full-size Kimi-K3 MLA draft built on the meta device (nothing allocated).

    Default = the Inferact layout (prefix stream, no fc_norm, taps [2,23,47,71,89]): 68 serving tensors and
    3,562,312,961 parameters without `embed_tokens` (spec §2: "68 tensors, 3.56B"); `total` adds the
    1,174,405,120-parameter frozen embedding. The TorchSpec layout (`fc_norm=True`) adds 5 × 7168.
    """
    base = dict(fc_norm=False, aux_hidden_stream="prefix", target_layer_ids=(2, 23, 47, 71, 89))
    base.update(overrides)
    cfg = kimi_k3_config(**base)
    counts = count_parameters(build_meta(cfg))
    counts["num_serving_tensors"] = counts["num_tensors"] - 1  # embed_tokens is skipped at serving
    return {"config": cfg.to_dict(), "params": counts}


if __name__ == "__main__":  # python -m regen.train.model: the K3 draft's size, without allocating it
    print(json.dumps(k3_param_report()["params"], indent=2))
