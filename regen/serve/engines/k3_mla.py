"""The K3 MLA DSpark draft as the `K3DSparkModel` folder that TokenSpeed and vLLM load beside a Kimi-K3 target.

Contract (TokenSpeed 0.1.1 `runtime/configs/kimi_k3_dspark_config.py` and `runtime/models/kimi_k3_dspark.py`;
vLLM 0.32 `transformers_utils/configs/k3_dspark.py` and `models/kimi_k3/nvidia/dspark_mla.py`; the published
TorchSpec K3 config `configs/draft_models/kimi_k3_dspark_mla.json`; shared/docs/serving-engines.md §1.1, §1.2, §3):
- config.json: `architectures: ["K3DSparkModel"]`, `model_type: "k3_dspark"` and the K3 fields under the same names
  regen uses (MLA dims with `q_lora_rank` > 0, `mla_use_nope`/`mla_use_output_gate` false, `target_layer_ids` as
  0-indexed layer outputs, `num_target_layers` = the number of taps, `mask_token_id`, `markov_rank` > 0,
  `markov_head_type`, the confidence head, `fc_norm`, `aux_hidden_stream`, `block_size`, YaRN `rope_parameters` with
  `rope_theta` also at the top level), `draft_vocab_size` = `vocab_size` (both engines share the target's head;
  neither reads `d2t`), `num_key_value_heads` = `num_attention_heads` as in the published config (MLA has no KV
  head groups; regen's GQA default would be misleading);
- tensors: regen's names unchanged (spec §8 is this layout): `fc_norm.{i}`, `context_proj`, `context_norm`,
  `layers.N.self_attn.{q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}`,
  norms, MLP, `final_norm`, `markov_head.markov_w{1,2}`, `confidence_head.proj`.
"""
from __future__ import annotations

from regen.serve.engines.draft import DraftCheckpoint, Refusal

ARCHITECTURE = "K3DSparkModel"
MODEL_TYPE = "k3_dspark"


def refusals(engine: str, cfg) -> list[Refusal]:
    """What the K3DSparkModel layout cannot hold of `cfg` (both engines); engine-specific limits are the caller's."""
    out = []

    def no(field, value, reason, remedy):
        out.append(Refusal(engine, field, value, reason, remedy))

    if cfg.attention_type != "mla":
        no("attention_type", cfg.attention_type, "K3DSparkModel is MLA attention", "serve a GQA draft with vLLM "
           "(Qwen3DSparkModel), SGLang or llama.cpp")
        return out  # the MLA fields below mean nothing for another attention
    if not cfg.q_lora_rank:
        no("q_lora_rank", cfg.q_lora_rank, "K3DSparkModel stores q_a_proj/q_b_proj, not one q_proj (TokenSpeed: "
           "\"K3 DSpark draft requires a q-LoRA rank\"; vLLM: q_lora_rank=None unsupported)", "train with "
           "train.draft: {q_lora_rank: N} (the K3 preset uses 1536)")
    if cfg.draft_vocab_size and cfg.draft_vocab_size != cfg.vocab_size:
        no("draft_vocab_size", cfg.draft_vocab_size, "the K3 draft shares the target's full lm_head; d2t/t2d are "
           "unexpected weights (TokenSpeed) and a reduced vocabulary is rejected (vLLM)", "train with "
           "train.draft_vocab_size: 0")
    if cfg.markov_rank <= 0:
        no("markov_rank", cfg.markov_rank, "the K3 draft needs its Markov head (markov_rank > 0)", "train with "
           "train.markov_rank > 0 (the K3 preset uses 256)")
    if cfg.markov_head_type != "vanilla":
        no("markov_head_type", cfg.markov_head_type, "only the vanilla head is served", "train a vanilla head")
    if not cfg.rope_interleave:
        no("rope_interleave", False, "the engines' DeepSeek-V3 MLA rotates interleaved pairs", "train the mla draft "
           "without a rope_interleave override")
    if cfg.hidden_size != cfg.target_hidden_size:
        no("hidden_size", cfg.hidden_size, "the draft shares the target's embeddings", "keep the draft's hidden size "
           "equal to the target's")
    if cfg.embed_scale != 1.0 or cfg.final_logit_softcapping:
        no("embed_scale", cfg.embed_scale, "the K3 draft neither scales the shared embedding nor soft-caps logits",
           "serve a K3-style target")
    return out


def config_dict(cfg) -> dict:
    """config.json of the layout (module docstring)."""
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads, "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
        "mla_use_nope": False, "mla_use_output_gate": False, "hidden_act": "silu",
        "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta,
        "rope_parameters": dict(cfg.rope_parameters), "tie_word_embeddings": False, "torch_dtype": "float32",
        "num_target_layers": cfg.num_target_layers, "target_hidden_size": cfg.target_hidden_size,
        "target_num_hidden_layers": cfg.target_num_hidden_layers, "target_layer_ids": list(cfg.target_layer_ids),
        "mask_token_id": cfg.mask_token_id, "markov_rank": cfg.markov_rank, "markov_head_type": cfg.markov_head_type,
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": cfg.confidence_head_with_markov, "fc_norm": cfg.fc_norm,
        "aux_hidden_stream": cfg.aux_hidden_stream, "block_size": cfg.block_size,
        "eos_token_id": list(cfg.eos_token_id) or None, "pad_token_id": cfg.pad_token_id,
    }


def tensors(ckpt: DraftCheckpoint) -> dict:
    """The draft's trainable tensors under their own names (embed_tokens/lm_head/d2t/t2d left out)."""
    return {k: v for k, v in ckpt.tensors.items()
            if not k.startswith(("embed_tokens.", "lm_head.")) and k not in ("d2t", "t2d")}
