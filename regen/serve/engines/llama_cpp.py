"""llama.cpp: a regen GQA draft as a GGUF of architecture `dflash` that llama.cpp's DSpark speculative decoding
(`--spec-type draft-dspark`, llama.cpp PR #25173) loads beside its target.

Contract (llama.cpp `src/models/dflash.cpp` and `common/speculative.cpp` as built into the wheel
`xllamacpp==2026.10.11549`, llama.cpp b11549; shared/docs/serving-engines.md §1.4 and §6):
- metadata `dflash.*`: context/embedding/block/feed-forward sizes, head counts, `attention.key_length` and
  `value_length` (= head_dim: the default would be hidden/heads), RMS epsilon, `rope.freq_base` (NeoX rotary over
  head_dim), `target_layers` (INT32[T], required), `target_hidden_size`, `block_size` (required with a Markov head),
  `sample_from_anchor` (true: slot 0 predicts the token after the anchor, as regen trains), `has_confidence_head`,
  `attention.causal` (false: a bidirectional block); the target GGUF's `tokenizer.ggml.*` keys unchanged (llama.cpp
  compares draft and target vocabularies token by token) plus `tokenizer.ggml.mask_token_id` (the block's mask);
- tensors (GGUF shapes are torch's reversed: a torch [out, in] weight is written as is): `fc` (context_proj),
  `enc.output_norm` (context_norm), `blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, attn_q_norm,
  attn_k_norm, ffn_norm, ffn_gate, ffn_up, ffn_down}`, `output_norm` (final_norm), `markov_w1` [V, r] and
  `markov_w2` [Vd, r] (their presence makes the file DSpark), `conf_proj.{weight,bias}` over [h; W1[prev]];
- taps: llama.cpp reads the residual stream *entering* target layer v, regen's tap L is the output of layer L, so
  `target_layers = target_layer_ids + 1`;
- a reduced vocabulary: `d2t` int64[Vd] of *absolute* target ids (the graph scatters with them; regen keeps EAGLE-3
  offsets, so `d2t + arange(Vd)`) and `output.weight` = the target's lm_head rows of those ids (llama.cpp requires
  the draft's own head with d2t); with the full vocabulary both are left out and the target's head is shared.

What the graph has no place for is refused (`refusals`): MLA attention, `fc_norm` (a per-tap RMSNorm is not
linear, so it cannot be folded into `fc`), no Markov head, a draft hidden size other than the target's, a
confidence head without the Markov term, YaRN or interleaved RoPE, the AttnRes tap stream, Gemma's embedding
scale and logit soft-capping.
"""
from __future__ import annotations

from pathlib import Path

from regen.serve.engines.draft import (
    DraftCheckpoint,
    Refusal,
    provenance,
    replace_dir,
    staging_dir,
    verification_record,
    write_launch,
)

ENGINE = "llama.cpp"
PACKAGE = "xllamacpp"
PINNED_VERSION = "2026.10.11549"  # the wheel regen's setup installs: llama.cpp build b11549
ARCH = "dflash"
GGUF_NAME = "draft-dspark.gguf"
METRICS = ("llamacpp:spec_decode_num_drafts_total", "llamacpp:spec_decode_num_accepted_tokens_total",
           "llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position=k}")

_TOP = {"context_proj.weight": "fc.weight", "context_norm.weight": "enc.output_norm.weight",
        "final_norm.weight": "output_norm.weight", "markov_head.markov_w1.weight": "markov_w1.weight",
        "markov_head.markov_w2.weight": "markov_w2.weight", "confidence_head.proj.weight": "conf_proj.weight",
        "confidence_head.proj.bias": "conf_proj.bias"}
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
          "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
          "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
          "self_attn.k_norm.weight": "attn_k_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight"}


def refusals(cfg) -> list[Refusal]:
    """What llama.cpp's `dflash` graph cannot represent in this DSparkConfig (empty: it can)."""
    out = []

    def no(field, value, reason, remedy):
        out.append(Refusal(ENGINE, field, value, reason, remedy))

    if cfg.attention_type != "gqa":
        no("attention_type", cfg.attention_type, "llama.cpp's DSpark draft graph is Qwen3-style GQA only (its other "
           "DSpark graph is DeepSeek-V4's)", "train with train.attention_type: gqa, or serve an MLA draft with "
           "TokenSpeed or vLLM on GPUs")
    if cfg.fc_norm:
        no("fc_norm", True, "the dflash encoder is fc then one RMSNorm; a per-tap RMSNorm has no slot and cannot be "
           "folded into fc", "train with train.fc_norm: false")
    if cfg.markov_rank <= 0:
        no("markov_rank", cfg.markov_rank, "without markov_w1 the file is plain DFlash, whose slots are read one "
           "position off from regen's", "train with train.markov_rank > 0")
    if cfg.hidden_size != cfg.target_hidden_size:
        no("hidden_size", cfg.hidden_size, f"the draft shares the target's embeddings and head, so its hidden size "
           f"must be the target's {cfg.target_hidden_size}", "remove the hidden_size override from train.draft")
    if cfg.enable_confidence_head and not cfg.confidence_head_with_markov and cfg.markov_rank > 0:
        no("confidence_head_with_markov", False, "conf_proj is sized hidden + markov_rank", "train with "
           "confidence_head_with_markov: true or without a confidence head")
    if cfg.aux_hidden_stream != "prefix":
        no("aux_hidden_stream", cfg.aux_hidden_stream, "llama.cpp extracts the residual stream entering a layer "
           "(the prefix stream) only", "train with train.aux_hidden_stream: prefix")
    if cfg.rope_interleave:
        no("rope_interleave", True, "the dflash graph rotates NeoX half-split pairs", "train a gqa draft (half-split "
           "RoPE) without a rope_interleave override")
    if (cfg.rope_parameters or {}).get("rope_type", "default") != "default":
        no("rope_parameters.rope_type", cfg.rope_parameters.get("rope_type"), "the export writes rope.freq_base "
           "only", "train the small preset's default RoPE (train.draft without rope_parameters)")
    if cfg.embed_scale != 1.0:
        no("embed_scale", cfg.embed_scale, "llama.cpp does not scale the shared embedding in the draft",
           "serve a target without embedding scaling (Gemma's sqrt(H) has no llama.cpp DSpark path)")
    if cfg.final_logit_softcapping:
        no("final_logit_softcapping", cfg.final_logit_softcapping, "the draft head has no soft-capping",
           "serve a target without logit soft-capping")
    return out


def _tokenizer_fields(target_gguf: Path):
    import gguf

    reader = gguf.GGUFReader(str(target_gguf))
    arch = reader.fields["general.architecture"].contents()
    shape = {k: reader.fields[f"{arch}.{k}"].contents() for k in ("block_count", "embedding_length")
             if f"{arch}.{k}" in reader.fields}
    fields = [f for f in reader.fields.values() if f.name.startswith("tokenizer.ggml.")]
    return arch, shape, fields


def check_target_gguf(cfg, target_gguf: Path) -> list[Refusal]:
    """The served target GGUF must be the target the draft was trained on: its layer count and hidden size."""
    from regen.errors import InputError

    if not Path(target_gguf).is_file():
        raise InputError(f"--target-gguf {target_gguf}: not found; give the GGUF llama.cpp serves the target from "
                         "(the local profile's: data/models/<name>/engine-q8_0.gguf, written by scripts/setup.sh)")
    arch, shape, fields = _tokenizer_fields(Path(target_gguf))
    out = []
    if shape.get("block_count") not in (None, cfg.target_num_hidden_layers):
        out.append(Refusal(ENGINE, "target_num_hidden_layers", cfg.target_num_hidden_layers,
                           f"{target_gguf} has {shape['block_count']} layers", "give the GGUF of the target the draft "
                           "was trained on"))
    if shape.get("embedding_length") not in (None, cfg.target_hidden_size):
        out.append(Refusal(ENGINE, "target_hidden_size", cfg.target_hidden_size,
                           f"{target_gguf} has hidden size {shape['embedding_length']}", "give the GGUF of the "
                           "target the draft was trained on"))
    if not any(f.name == "tokenizer.ggml.tokens" for f in fields):
        out.append(Refusal(ENGINE, "target_gguf", str(target_gguf), "it has no tokenizer.ggml.tokens (llama.cpp "
                           "checks the draft's vocabulary against the target's)", "give the target's full GGUF"))
    elif len(next(f for f in fields if f.name == "tokenizer.ggml.tokens").contents()) != cfg.vocab_size:
        out.append(Refusal(ENGINE, "vocab_size", cfg.vocab_size, f"{target_gguf}'s vocabulary differs",
                           "give the GGUF of the target the draft was trained on"))
    return out


def gguf_tensors(ckpt: DraftCheckpoint, target_lm_head=None) -> dict:
    """{GGUF tensor name: numpy array} of the draft. target_lm_head: the target's lm_head float[V, H] (required
    with a reduced vocabulary: the draft's `output.weight` rows). Raises KeyError for a tensor with no GGUF name."""
    import numpy as np
    import torch

    cfg = ckpt.config
    out = {}
    for name, t in ckpt.tensors.items():
        if name.startswith(("embed_tokens.", "lm_head.")) or name in ("d2t", "t2d"):
            continue
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            gname = f"blk.{i}.{_LAYER[rest]}"
        else:
            gname = _TOP[name]
        out[gname] = np.ascontiguousarray(t.float().numpy(), dtype=np.float32)
    if cfg.draft_vocab_size:
        if target_lm_head is None:
            raise ValueError("a reduced-vocabulary draft needs the target's lm_head for output.weight")
        ids = ckpt.tensors["d2t"].long() + torch.arange(cfg.draft_vocab_size)  # EAGLE-3 offsets -> absolute ids
        out["d2t"] = np.ascontiguousarray(ids.numpy(), dtype=np.int64)
        out["output.weight"] = np.ascontiguousarray(target_lm_head[ids].float().numpy(), dtype=np.float32)
    return out


def write_gguf(ckpt: DraftCheckpoint, path: Path, target_gguf: Path, target_lm_head=None) -> None:
    """The draft GGUF (module docstring) at `path`, tokenizer keys copied from `target_gguf`."""
    import gguf

    cfg = ckpt.config
    w = gguf.GGUFWriter(str(path), arch=ARCH)
    a = ARCH
    w.add_uint32(f"{a}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{a}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{a}.block_count", cfg.num_hidden_layers)
    w.add_uint32(f"{a}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{a}.attention.head_count", cfg.num_attention_heads)
    w.add_uint32(f"{a}.attention.head_count_kv", cfg.num_key_value_heads)
    w.add_uint32(f"{a}.attention.key_length", cfg.head_dim)
    w.add_uint32(f"{a}.attention.value_length", cfg.head_dim)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_bool(f"{a}.attention.causal", False)
    w.add_float32(f"{a}.rope.freq_base", cfg.rope_theta)
    w.add_uint32(f"{a}.rope.dimension_count", cfg.head_dim)
    w.add_array(f"{a}.target_layers", [int(i) + 1 for i in cfg.target_layer_ids])
    w.add_uint32(f"{a}.target_hidden_size", cfg.target_hidden_size)
    w.add_uint32(f"{a}.block_size", cfg.block_size)
    w.add_bool(f"{a}.sample_from_anchor", True)
    w.add_bool(f"{a}.has_confidence_head", bool(cfg.enable_confidence_head))
    _, _, fields = _tokenizer_fields(Path(target_gguf))
    for f in fields:
        if f.name == "tokenizer.ggml.mask_token_id":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), vtype, sub_type=sub)
    w.add_uint32("tokenizer.ggml.mask_token_id", cfg.mask_token_id)
    for name, arr in gguf_tensors(ckpt, target_lm_head).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def launch(cfg, draft_file: str = GGUF_NAME, target_gguf: str = "TARGET.gguf") -> dict:
    """llama-server's command line for this draft (and regen's own server: `python -m regen.target.llama_cpp`)."""
    n = cfg.block_size
    return {
        "engine": ENGINE, "engine_version": f"{PACKAGE}=={PINNED_VERSION} (llama.cpp b11549)",
        "command": ["llama-server", "-m", target_gguf, "--model-draft", draft_file, "--spec-type", "draft-dspark",
                    "--spec-draft-n-max", str(n), "--spec-draft-p-min", "0", "--metrics", "--host", "127.0.0.1",
                    "--port", "8080"],
        "widths": {"block_size": n, "spec_draft_n_max": n, "verified_tokens_per_round": n + 1},
        "tap_stream": {"aux_hidden_stream": cfg.aux_hidden_stream, "target_layer_ids": list(cfg.target_layer_ids),
                       "dflash.target_layers": [int(i) + 1 for i in cfg.target_layer_ids],
                       "how": "written into the GGUF: llama.cpp captures the input of each listed target layer"},
        "env": {},
        "acceptance": {"metrics": list(METRICS), "acc_len": "1 + accepted_tokens_total / drafts_total",
                       "per_response": "timings.draft_n, timings.draft_n_accepted"},
        "verification": verification_record(
            {"greedy": {"draft_sample_method": "greedy", "rejection_sample_method": "standard"}},
            "not configurable: llama.cpp drafts the argmax block and the server samples the target at every "
            "drafted position, keeping drafts while the sample equals them (common_sampler_sample_and_accept_n): "
            "token-level rejection sampling against a one-hot draft; no block verification"),
        "notes": ["--spec-draft-n-max must equal the trained block_size: a shorter block drafts fewer tokens than "
                  "trained, a longer one is capped by dflash.block_size",
                  "--spec-draft-p-min 0 proposes the full block, as regen eval does; a positive value cuts the block "
                  "at the first slot whose confidence is below it",
                  "regen's embedded server: python -m regen.target.llama_cpp ... --draft draft-dspark.gguf "
                  "(regen engine-eval starts it)"],
    }


def export(ckpt: DraftCheckpoint, out: Path, *, target_gguf: Path, target_path: str | None = None, **_) -> dict:
    """Write `out/draft-dspark.gguf` + launch.json + launch.sh; return the launch record.

    Raises EngineRefused (nothing written) when the draft or the target GGUF does not fit (`refusals`,
    `check_target_gguf`). target_path: the target's HF checkpoint (its lm_head rows, for a reduced vocabulary)."""
    from regen.serve.engines.draft import EngineRefused

    cfg = ckpt.config
    refused = refusals(cfg) + check_target_gguf(cfg, Path(target_gguf))
    if refused:
        raise EngineRefused(ENGINE, refused, str(ckpt.path))
    head = None
    if cfg.draft_vocab_size:
        head = target_lm_head(target_path or ckpt.training.get("target"))
    tmp = staging_dir(Path(out))
    write_gguf(ckpt, tmp / GGUF_NAME, Path(target_gguf), head)
    record = {**launch(cfg, str(Path(out).resolve() / GGUF_NAME), str(target_gguf)), "draft": provenance(ckpt),
              "files": [GGUF_NAME, "launch.json", "launch.sh"]}
    write_launch(tmp, record)
    replace_dir(tmp, Path(out))
    return record


def target_lm_head(target_path):
    """The target's lm_head weight float32[V, H], read alone from its safetensors (regen.train.target_head)."""
    import torch

    from regen.config import resolve_path
    from regen.errors import InputError
    from regen.train.target_head import TargetHead

    if not target_path:
        raise InputError("a reduced-vocabulary draft (draft_vocab_size > 0) needs the target's lm_head rows for "
                         "the GGUF's output.weight: give --target (the target's HF checkpoint directory)")
    head = TargetHead.from_pretrained(resolve_path(str(target_path)), dtype=torch.float32)
    try:
        return head.model.get_output_embeddings().weight.detach().float().cpu()
    finally:
        head.close()
