"""The GQA DSpark draft as a Hugging Face folder of the DFlash family (`Qwen3DSparkModel`): the layout vLLM and
SGLang load for a Qwen3-style DSpark draft (`--speculative-config '{"method":"dspark",...}'`).

Contract (vLLM 0.32 `model_executor/models/qwen3_dspark.py` on `qwen3_dflash.py`; SGLang 0.5.23
`srt/models/dspark.py` on `srt/models/dflash.py` and `srt/speculative/dflash_utils.py`; z-lab/dflash's `Qwen3Config`
checkpoints; shared/docs/serving-engines.md §1.2, §1.3, §3.4):
- config.json: a `qwen3` config (hidden/intermediate sizes, layers, heads, kv heads, head_dim, rms_norm_eps,
  rope_theta) with `architectures: ["Qwen3DSparkModel"]`, `dflash_config: {target_layer_ids, mask_token_id,
  block_size}`, `target_hidden_size`, `num_target_layers` = the *target's* layer count (the DFlash meaning, which
  SGLang compares with the running target; regen's own config means the number of taps), the DSpark heads
  (`markov_rank`, `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`,
  `sample_from_anchor: true`) and `draft_vocab_size`;
- taps: both engines read `target_layer_ids` as "after layer L" ids and capture before layer L+1 (vLLM
  `eagle3_utils.get_eagle3_aux_layers_from_config`, SGLang `set_dflash_layers_to_capture`): regen's ids unchanged;
- tensors: `fc` (regen context_proj), `hidden_norm` (context_norm), `norm` (final_norm), `layers.N.*` with Qwen3
  names unchanged, `markov_head.markov_w{1,2}`, `confidence_head.proj.{weight,bias}`; with a reduced vocabulary
  `d2t` (EAGLE-3 offsets, as regen keeps them) and the draft's own `lm_head.weight` (the target's rows); `t2d` is
  dropped (training only).
"""
from __future__ import annotations

from regen.serve.engines.draft import DraftCheckpoint, Refusal

ARCHITECTURE = "Qwen3DSparkModel"
RENAMES = {"context_proj.weight": "fc.weight", "context_norm.weight": "hidden_norm.weight",
           "final_norm.weight": "norm.weight"}


def refusals(engine: str, cfg, *, reduced_vocab: bool) -> list[Refusal]:
    """What the Qwen3 DSpark layout cannot hold of `cfg`, for `engine`; reduced_vocab: the engine takes `d2t`."""
    out = []

    def no(field, value, reason, remedy):
        out.append(Refusal(engine, field, value, reason, remedy))

    if cfg.attention_type != "gqa":
        no("attention_type", cfg.attention_type, "the Qwen3 DSpark layout is GQA attention", "serve an MLA draft "
           "with TokenSpeed (K3DSparkModel) or vLLM's K3 draft")
        return out  # the GQA fields below mean nothing for another attention
    if cfg.fc_norm:
        no("fc_norm", True, "the DFlash encoder is fc then hidden_norm; a per-tap RMSNorm has no weight slot and "
           "cannot be folded into fc", "train with train.fc_norm: false")
    if cfg.markov_rank <= 0:
        no("markov_rank", cfg.markov_rank, "a DSpark draft needs its Markov head (without it the file is DFlash, "
           "whose slots are read one position off from regen's)", "train with train.markov_rank > 0")
    if cfg.draft_vocab_size and not reduced_vocab:
        no("draft_vocab_size", cfg.draft_vocab_size, "this engine's DSpark Markov head spans the full vocabulary "
           "and it reads no d2t", "train with train.draft_vocab_size: 0, or serve with vLLM or llama.cpp")
    if cfg.hidden_size != cfg.target_hidden_size:
        no("hidden_size", cfg.hidden_size, "the draft shares the target's embeddings", "keep the draft's hidden "
           "size equal to the target's")
    if cfg.enable_confidence_head and not cfg.confidence_head_with_markov and cfg.markov_rank > 0:
        no("confidence_head_with_markov", False, "the layout's confidence head reads [h; W1[prev]]", "train with "
           "confidence_head_with_markov: true")
    if cfg.aux_hidden_stream != "prefix":
        no("aux_hidden_stream", cfg.aux_hidden_stream, "Qwen3-family targets expose the prefix stream only",
           "train with train.aux_hidden_stream: prefix")
    if cfg.rope_interleave:
        no("rope_interleave", True, "Qwen3 rotates half-split (NeoX) pairs", "train a gqa draft without a "
           "rope_interleave override")
    if (cfg.rope_parameters or {}).get("rope_type", "default") != "default":
        no("rope_parameters.rope_type", cfg.rope_parameters.get("rope_type"), "the layout writes rope_theta only",
           "train with the small preset's default RoPE")
    if cfg.embed_scale != 1.0 or cfg.final_logit_softcapping:
        no("embed_scale", cfg.embed_scale, "no engine scales the shared embedding or soft-caps the draft's logits",
           "serve a target without embedding scaling or logit soft-capping")
    return out


def config_dict(cfg) -> dict:
    """config.json of the layout (module docstring)."""
    return {
        "architectures": [ARCHITECTURE], "model_type": "qwen3",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "attention_bias": False, "attention_dropout": 0.0,
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "eos_token_id": list(cfg.eos_token_id) or None, "pad_token_id": cfg.pad_token_id,
        "target_hidden_size": cfg.target_hidden_size, "num_target_layers": cfg.target_num_hidden_layers,
        "block_size": cfg.block_size,
        "dflash_config": {"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id,
                          "block_size": cfg.block_size},
        "markov_rank": cfg.markov_rank, "markov_head_type": cfg.markov_head_type,
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": cfg.confidence_head_with_markov, "sample_from_anchor": True,
        "draft_vocab_size": cfg.output_vocab_size,
    }


def tensors(ckpt: DraftCheckpoint, target_lm_head=None) -> dict:
    """{name: tensor} of the layout. target_lm_head float[V, H]: required with a reduced vocabulary."""
    import torch

    cfg = ckpt.config
    out = {}
    for name, t in ckpt.tensors.items():
        if name.startswith(("embed_tokens.", "lm_head.")) or name == "t2d":
            continue
        out[RENAMES.get(name, name)] = t
    if cfg.draft_vocab_size:
        if target_lm_head is None:
            raise ValueError("a reduced-vocabulary draft needs the target's lm_head for lm_head.weight")
        ids = ckpt.tensors["d2t"].long() + torch.arange(cfg.draft_vocab_size)
        out["lm_head.weight"] = target_lm_head[ids].float().contiguous()
        out["d2t"] = ckpt.tensors["d2t"].long()
    return out
