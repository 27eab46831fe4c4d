"""SGLang: a GQA draft as `Qwen3DSparkModel` (regen.serve.engines.hf_gqa), served with `--speculative-algorithm
DSPARK`.

Contract pinned at the PyPI wheel sglang==0.5.23 (shared/docs/serving-engines.md §1.3): the draft's fields are read
by `srt/speculative/dspark_components/dspark_config.py` (`parse_dspark_draft_config` on the DFlash parser: nested
`dflash_config`, `markov_rank` > 0, `markov_head_type`) and `resolve_runtime_config` (gamma = num_draft_tokens - 1;
a different gamma than the checkpoint's block_size is only a warning, so the launch states it); `srt/models/dspark.py`
loads `markov_head.markov_w{1,2}` with w2 over the *full* vocabulary (no `d2t`) and the confidence head. SGLang has
no K3 MLA DSpark draft, and refuses DSpark on a `cpu` device (CUDA, NPU or XPU only).
"""
from __future__ import annotations

from pathlib import Path

from regen.serve.engines import hf_gqa
from regen.serve.engines.draft import DraftCheckpoint, EngineRefused, Refusal, verification_record, write_export

ENGINE = "sglang"
PACKAGE = "sglang"
PINNED_VERSION = "0.5.23"
METRICS = ("sglang:spec_accept_length", "sglang:spec_verify_calls_total")
# the served protocol (srt/arg_groups/fields/spec.py, srt/environ.py): DSPARK drafts are sampled from the draft
# unless SGLANG_DSPARK_USE_GREEDY_DRAFT=1; --speculative-use-block-verification switches token-level to block
BLOCK_FLAG = "--speculative-use-block-verification"
GREEDY_DRAFT_ENV = "SGLANG_DSPARK_USE_GREEDY_DRAFT"


def refusals(cfg) -> list[Refusal]:
    """What SGLang 0.5.23 cannot serve of this DSparkConfig (empty: it can)."""
    return hf_gqa.refusals(ENGINE, cfg, reduced_vocab=False)


def launch(cfg, draft_dir: str = "DRAFT_DIR", target: str = "TARGET") -> dict:
    n = cfg.block_size
    return {
        "engine": ENGINE, "engine_version": f"{PACKAGE}=={PINNED_VERSION}",
        "command": ["sglang", "serve", "--model-path", target, "--speculative-algorithm", "DSPARK",
                    "--speculative-draft-model-path", draft_dir, "--speculative-num-draft-tokens", str(n + 1),
                    BLOCK_FLAG, "--enable-metrics"],
        "widths": {"block_size": n, "gamma": n, "speculative_num_draft_tokens": n + 1,
                   "rule": "gamma = speculative_num_draft_tokens - 1 must equal the trained block_size; SGLang "
                           "only warns on a mismatch"},
        "tap_stream": {"aux_hidden_stream": cfg.aux_hidden_stream, "target_layer_ids": list(cfg.target_layer_ids),
                       "how": "dflash_config.target_layer_ids: SGLang captures before layer L+1"},
        "env": {},
        "acceptance": {"metrics": list(METRICS), "acc_len": "sglang:spec_accept_length (accepted + bonus per "
                       "verify); per request meta_info.spec_accept_length", "needs": "--enable-metrics"},
        "verification": verification_record(
            {"probabilistic": {"draft_sample_method": "probabilistic", "rejection_sample_method": "block",
                               "flags": [BLOCK_FLAG], "env": {}},
             "greedy": {"draft_sample_method": "greedy", "rejection_sample_method": "block", "flags": [BLOCK_FLAG],
                        "env": {GREEDY_DRAFT_ENV: "1"}}},
            f"{BLOCK_FLAG} (off: token-level rejection sampling); the environment {GREEDY_DRAFT_ENV}=1 drafts the "
            "argmax (accepted as a one-hot draft), otherwise DSPARK samples its drafts"),
        "notes": ["SGLang 0.5.23 refuses DSpark on a cpu device: CUDA, NPU or XPU"],
    }


def export(ckpt: DraftCheckpoint, out: Path, **_) -> dict:
    refused = refusals(ckpt.config)
    if refused:
        raise EngineRefused(ENGINE, refused, str(ckpt.path))
    return write_export(ckpt, out, hf_gqa.config_dict(ckpt.config), hf_gqa.tensors(ckpt),
                        launch(ckpt.config, str(Path(out).resolve())))
