"""TokenSpeed: the K3 MLA draft as `K3DSparkModel` (regen.serve.engines.k3_mla), with `fc_norm` and the tap stream
(`aux_hidden_stream`) read from config.json, launched with `--speculative-algorithm DSPARK`.

Contract pinned at the PyPI wheel tokenspeed==0.1.1 (shared/docs/serving-engines.md §1.1): `KimiK3DSparkConfig` and
`validate_k3_dspark_config` (taps ascending, distinct, below the target's layer count; mask token in the vocabulary;
markov_rank > 0; q_lora_rank > 0; no NoPE, no output gate), `K3DSparkModel.load_weights` (fused q_a/kv_a, stacked
gate/up, `fc_norm.N` since 0.1.1; any other tensor is "unexpected"). Widths: a DSpark checkpoint that declares
`block_size` must run `--speculative-num-steps block_size --speculative-num-draft-tokens block_size + 1`
(`runtime/utils/spec_block_geometry.py`); others raise. The AttnRes stream comes from the config field only in
0.1.1 (`TOKENSPEED_DFLASH_AUX_STREAM` is not read by the wheel). TokenSpeed has no CPU platform: NVIDIA or AMD GPUs.
"""
from __future__ import annotations

from pathlib import Path

from regen.serve.engines import k3_mla
from regen.serve.engines.draft import DraftCheckpoint, EngineRefused, Refusal, verification_record, write_export

ENGINE = "tokenspeed"
PACKAGE = "tokenspeed"
PINNED_VERSION = "0.1.1"
METRICS = ("tokenspeed:spec_decode_num_drafts", "tokenspeed:spec_decode_num_accepted_tokens")


def refusals(cfg) -> list[Refusal]:
    """What TokenSpeed 0.1.1 cannot serve of this DSparkConfig (empty: it can)."""
    out = k3_mla.refusals(ENGINE, cfg)
    if cfg.num_hidden_layers <= 0:
        out.append(Refusal(ENGINE, "num_hidden_layers", cfg.num_hidden_layers, "the draft needs a layer", "train "
                           "with train.num_draft_layers >= 1"))
    return out


def launch(cfg, draft_dir: str = "DRAFT_DIR", target: str = "TARGET") -> dict:
    n = cfg.block_size
    return {
        "engine": ENGINE, "engine_version": f"{PACKAGE}=={PINNED_VERSION}",
        "command": ["tokenspeed", "serve", "--model", target, "--speculative-algorithm", "DSPARK",
                    "--speculative-draft-model-path", draft_dir, "--speculative-num-steps", str(n),
                    "--speculative-num-draft-tokens", str(n + 1), "--enable-metrics"],
        "speculative_config": {"method": "dspark", "model": draft_dir, "num_speculative_tokens": n + 1},
        "widths": {"block_size": n, "speculative_num_steps": n, "speculative_num_draft_tokens": n + 1,
                   "rule": "DSpark: num_steps = block_size, num_draft_tokens = block_size + 1 "
                           "(tokenspeed runtime/utils/spec_block_geometry.py); other widths raise at launch"},
        "tap_stream": {"aux_hidden_stream": cfg.aux_hidden_stream, "target_layer_ids": list(cfg.target_layer_ids),
                       "how": "read from the draft's config.json (aux_hidden_stream); TokenSpeed 0.1.1 does not "
                              "read TOKENSPEED_DFLASH_AUX_STREAM"},
        "env": {},
        "acceptance": {"metrics": list(METRICS), "acc_len": "1 + spec_decode_num_accepted_tokens / "
                       "spec_decode_num_drafts", "needs": "--enable-metrics"},
        "verification": verification_record(
            {"greedy": {"draft_sample_method": "greedy", "rejection_sample_method": "standard"}},
            "not configurable in TokenSpeed 0.1.1: DSPARK is a block drafter (runtime/utils/spec_block_geometry.py "
            "BLOCK_SPEC_ALGORITHMS) that proposes its block greedily, and --enable-speculative-sampling is refused "
            "for it (server_args.py _validate_speculative_sampling); the target-only rule accepts d with probability "
            "p_t(d): token-level rejection sampling against a one-hot draft; no block verification"),
        "notes": ["with --speculative-config, num_speculative_tokens is the verify width (block_size + 1 = "
                  f"{n + 1}), not the draft length: {n} would fail the width check",
                  "the confidence head is loaded but unused by TokenSpeed 0.1.1: every round verifies the full block",
                  "needs NVIDIA or AMD GPUs and a K3 deployment of the target (no CPU platform)"],
    }


def export(ckpt: DraftCheckpoint, out: Path, **_) -> dict:
    """config.json + model.safetensors + launch.{json,sh} in `out`. EngineRefused (nothing written) when it does
    not fit."""
    refused = refusals(ckpt.config)
    if refused:
        raise EngineRefused(ENGINE, refused, str(ckpt.path))
    return write_export(ckpt, out, k3_mla.config_dict(ckpt.config), k3_mla.tensors(ckpt),
                        launch(ckpt.config, str(Path(out).resolve())))
