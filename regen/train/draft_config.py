"""The DSpark draft's config: every field serving reads from `config.json` (spec §8) plus the training knobs (§5).

`DSparkConfig` is what `regen.train.model.DSparkDraft` is built from and what a checkpoint's `config.json`
holds; `kimi_k3_config` is the full-size K3 draft, `small_config_for_target` a small draft for a small HF
target. Spec: shared/docs/dspark.md.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from regen.errors import InputError
from regen.train.target import default_target_layer_ids

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FROZEN_PREFIXES = ("embed_tokens.", "lm_head.")
# The `model_type` of regen's own folders (trainer step folders, `save_draft`): a type no serving engine registers,
# and no `architectures` entry, so an engine pointed at a trainer folder refuses it at once ("unrecognized model
# type") instead of loading it into a model of its own that happens to share a name (vLLM 0.32 reroutes an unknown
# DSpark architecture to its DeepSeek-V4 draft; shared/docs/serving-engines.md §0). Engines get their own layout from
# `regen export-draft` (regen.serve.engines). Folders written before (model_type "k3_dspark", architectures
# ["DSparkDraft"]) still load.
REGEN_MODEL_TYPE = "regen_dspark"
LEGACY_MODEL_TYPES = ("k3_dspark",)
LEGACY_ARCHITECTURES = (["DSparkDraft"],)


@dataclass(frozen=True)
class DSparkConfig:
    """Every field serving needs (spec §8, K3 MLA style `k3_dspark`) plus the training knobs of §5.

    `num_target_layers` is derived (= number of taps, the K3 meaning; DS uses it for the target's layer count,
    which is `target_num_hidden_layers` here). Raises ValueError on an invalid combination.
    """

    model_type: str = REGEN_MODEL_TYPE
    attention_type: str = "mla"  # "mla" (K3, spec §2 table) | "gqa" (DS/Qwen3 style)
    block_size: int = 7
    num_hidden_layers: int = 5  # draft layers
    hidden_size: int = 7168
    intermediate_size: int = 14336
    num_attention_heads: int = 64
    # MLA dims (spec §2 table); q_lora_rank 0 = plain q_proj
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # GQA dims (attention_type "gqa")
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {
        "rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "original_max_position_embeddings": 32768,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    # RoPE pair layout: None = the attention type's convention, resolved at construction and written to
    # config.json: "mla" interleaved pairs (2i, 2i+1) as the K3 MLA drafts (spec §2 table; DeepSeek-V3
    # `apply_rotary_emb`), "gqa" half-split pairs (i, i+R/2) as the reference's Qwen3 draft (DS `qwen3/modeling.py`,
    # HF `rotate_half`). A config.json that states it (every checkpoint this product wrote) keeps its value.
    rope_interleave: bool | None = None
    max_position_embeddings: int = 1048576
    vocab_size: int = 163840
    # target contract (spec §1, §8)
    target_hidden_size: int = 7168
    target_num_hidden_layers: int = 93
    target_layer_ids: tuple[int, ...] = (7, 31, 47, 63, 87)
    aux_hidden_stream: str = "prefix"  # "prefix" | "attn_res"
    norm_convention: str = "final_norm"  # p_t = softmax(lm_head(final_norm(h_last))), spec §1
    fc_norm: bool = False
    mask_token_id: int = 163837
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    eos_token_id: tuple[int, ...] = (163586,)
    pad_token_id: int | None = 163839
    draft_vocab_size: int = 0  # 0 = the target's full vocabulary; else the reduced output vocabulary (d2t/t2d)
    embed_scale: float = 1.0  # Gemma-style targets scale embeddings by sqrt(H)
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = False
    # training (spec §5)
    num_anchors: int = 512
    loss_decay_gamma: float = 4.0

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.rope_interleave is None:
            object.__setattr__(self, "rope_interleave", self.attention_type == "mla")
        theta = (self.rope_parameters or {}).get("rope_theta")
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
            raise ValueError(f"rope_parameters.rope_theta={theta!r}: state the RoPE base explicitly (a positive "
                             "number, e.g. 50000.0 for the K3 draft); no default is assumed (a draft trainer that "
                             "dropped the base trained at 10,000 whatever its config declared, and served wrong)")
        eos = self.eos_token_id
        object.__setattr__(self, "eos_token_id", tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),))
        ids = self.target_layer_ids
        if not ids or list(ids) != sorted(set(ids)):
            raise ValueError(f"target_layer_ids {list(ids)} must be non-empty, unique and ascending (spec §8)")
        if ids[0] < -1 or ids[-1] >= self.target_num_hidden_layers - 1:
            raise ValueError(
                f"target_layer_ids {list(ids)}: each id must be in [-1, {self.target_num_hidden_layers - 2}]; "
                "a tap on the last layer is refused (its HF hidden state is already final-normed, spec §1)")
        if self.attention_type not in ("mla", "gqa"):
            raise ValueError(f"attention_type {self.attention_type!r}: use 'mla' or 'gqa'")
        nh, nkv = self.num_attention_heads, self.num_key_value_heads
        if self.attention_type == "gqa" and (nkv < 1 or nh % nkv):
            # each key/value head serves nh // nkv query heads: with nkv > nh that is 0, empty keys and values, and
            # an attention that silently outputs zeros
            raise ValueError(f"num_attention_heads={nh} is not a multiple of num_key_value_heads={nkv}: GQA needs "
                             "num_key_value_heads to divide num_attention_heads (set num_key_value_heads)")
        if self.aux_hidden_stream not in ("prefix", "attn_res"):
            raise ValueError(f"aux_hidden_stream {self.aux_hidden_stream!r}: use 'prefix' or 'attn_res'")
        if self.markov_head_type != "vanilla":
            raise ValueError(f"markov_head_type {self.markov_head_type!r}: only 'vanilla' is supported (spec §3)")
        if self.block_size < 1 or self.markov_rank < 0 or not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError("block_size >= 1, markov_rank >= 0 and 0 <= mask_token_id < vocab_size required")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in [0, vocab_size "
                             f"{self.vocab_size}] (0 = the full vocabulary)")

    @property
    def output_vocab_size(self) -> int:
        """Vd: rows of the draft's lm_head (draft_vocab_size, or vocab_size when it is 0)."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def num_target_layers(self) -> int:
        """Number of taps (K3 meaning, spec §8)."""
        return len(self.target_layer_ids)

    @property
    def rope_theta(self) -> float:
        """The RoPE base θ of the draft's own rotary embedding (`rope_parameters["rope_theta"]`)."""
        return float(self.rope_parameters["rope_theta"])

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["eos_token_id"] = list(self.eos_token_id)
        d["num_target_layers"] = self.num_target_layers
        d["rope_theta"] = self.rope_theta  # top level too: serving code that reads `config.rope_theta` (vLLM's
        # DeepSeek-V2/V3 path) would otherwise fall back to 10,000
        d["regen_note"] = ("a regen trainer folder, not a serving checkpoint: serve it with the folder `regen "
                           "export-draft --engine ENGINE --draft THIS_FOLDER` writes (docs/serve.md)")
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "DSparkConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known - {"num_target_layers", "architectures", "rope_theta", "regen_note"}
        if unknown:
            raise ValueError(f"unknown DSparkConfig fields {sorted(unknown)}")
        if "architectures" in d and d["architectures"] not in LEGACY_ARCHITECTURES:
            raise ValueError(f"architectures {d['architectures']}: this is an engine's folder, not a regen draft "
                             "folder; give the trainer's step folder (runs/<name>/train/checkpoints/step-N)")
        d = {**d, "model_type": REGEN_MODEL_TYPE} if d.get("model_type") in LEGACY_MODEL_TYPES else d
        if d.get("model_type", REGEN_MODEL_TYPE) != REGEN_MODEL_TYPE:
            raise ValueError(f"model_type {d['model_type']!r}: not a regen draft folder (model_type "
                             f"{REGEN_MODEL_TYPE!r}); give the trainer's step folder")
        cfg = cls(**{k: v for k, v in d.items() if k in known})
        if "rope_theta" in d and float(d["rope_theta"]) != cfg.rope_theta:
            raise ValueError(f"rope_theta {d['rope_theta']} differs from rope_parameters.rope_theta "
                             f"{cfg.rope_theta}: the config states two RoPE bases; keep one value")
        return cfg

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "DSparkConfig":
        p = Path(text_or_path) if not str(text_or_path).lstrip().startswith("{") else None
        return cls.from_dict(json.loads(p.read_text() if p is not None else str(text_or_path)))


def check_rope_theta(cfg: DSparkConfig, expected: float | None, *, checkpoint: str, expected_from: str) -> None:
    """Raise InputError when the checkpoint's RoPE base differs from the one `expected_from` (a profile's
    `train.rope_theta`, a serving config) expects; `expected` None checks nothing. Part of the serving contract:
    a draft served at another θ than it was trained at loses acceptance silently."""
    if expected is not None and float(expected) != cfg.rope_theta:
        raise InputError(f"{checkpoint}: the checkpoint's rope_theta is {cfg.rope_theta:g}, {expected_from} expects "
                         f"{float(expected):g}; evaluate/serve it with rope_theta {cfg.rope_theta:g} or retrain the "
                         "draft at the expected base")


def kimi_k3_config(**overrides) -> DSparkConfig:
    """The full-size K3 MLA draft (spec §2 table, TS taps `[7,31,47,63,87]` with fc_norm + attn_res, §6/§8)."""
    base = dict(fc_norm=True, aux_hidden_stream="attn_res", target_layer_ids=(7, 31, 47, 63, 87))
    base.update(overrides)
    return DSparkConfig(**base)


def small_config_for_target(target_config, *, target_layer_ids, num_hidden_layers: int = 1,
                            markov_rank: int = 32, block_size: int = 7, mask_token_id: int | None = None,
                            attention_type: str = "mla", **overrides) -> DSparkConfig:
    """A small MLA draft for a (small) HF target config: H = target hidden, dims scaled down (spec §9).

    `target_config` is a transformers text config (hidden_size, num_hidden_layers, vocab_size, ...).
    """
    tc = getattr(target_config, "text_config", None) or target_config
    H = tc.hidden_size
    heads = max(1, min(8, H // 32))
    kv_heads = max(d for d in range(1, heads // 2 + 1) if heads % d == 0) if heads > 1 else 1  # divides heads
    eos = getattr(tc, "eos_token_id", None)
    eos = [] if eos is None else (list(eos) if isinstance(eos, (list, tuple)) else [eos])
    emb_scale = math.sqrt(H) if "gemma" in str(getattr(tc, "model_type", "")) else 1.0
    mask_id = mask_token_id if mask_token_id is not None else tc.vocab_size - 1
    cfg = dict(
        attention_type=attention_type, block_size=block_size, num_hidden_layers=num_hidden_layers,
        hidden_size=H, intermediate_size=getattr(tc, "intermediate_size", 4 * H), num_attention_heads=heads,
        q_lora_rank=0, kv_lora_rank=max(16, H // 4), qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        num_key_value_heads=kv_heads, head_dim=32, rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=getattr(tc, "max_position_embeddings", 4096), vocab_size=tc.vocab_size,
        target_hidden_size=H, target_num_hidden_layers=tc.num_hidden_layers, target_layer_ids=tuple(target_layer_ids),
        mask_token_id=mask_id, markov_rank=markov_rank, eos_token_id=tuple(eos),
        pad_token_id=getattr(tc, "pad_token_id", None), embed_scale=emb_scale,
        final_logit_softcapping=getattr(tc, "final_logit_softcapping", None), num_anchors=64,
    )
    cfg.update(overrides)
    return DSparkConfig(**cfg)


def build_draft_config(cfg, target_config) -> DSparkConfig:
    """The DSparkConfig of a profile's `train` section (a TrainConfig) for a target's HF config (`text_config`
    or the config itself): presets `small` and `kimi-k3`, then `cfg.draft`'s overrides, then `cfg.rope_theta`.
    Raises InputError for an unknown `train.draft_preset`, ValueError for an invalid combination."""
    tc = getattr(target_config, "text_config", None) or target_config
    ids = cfg.target_layer_ids or default_target_layer_ids(tc.num_hidden_layers, 3)
    common = dict(target_layer_ids=tuple(ids), aux_hidden_stream=cfg.aux_hidden_stream, fc_norm=cfg.fc_norm,
                  block_size=cfg.block_size, markov_rank=cfg.markov_rank, num_anchors=cfg.num_anchors,
                  enable_confidence_head=cfg.enable_confidence_head, loss_decay_gamma=cfg.loss_decay_gamma,
                  attention_type=cfg.attention_type, draft_vocab_size=cfg.draft_vocab_size)
    if cfg.mask_token_id is not None:
        common["mask_token_id"] = cfg.mask_token_id
    if cfg.draft_preset == "kimi-k3":
        dc = kimi_k3_config(num_hidden_layers=cfg.num_draft_layers, target_hidden_size=tc.hidden_size,
                            target_num_hidden_layers=tc.num_hidden_layers, vocab_size=tc.vocab_size,
                            **common, **cfg.draft)
    elif cfg.draft_preset == "small":
        dc = small_config_for_target(tc, num_hidden_layers=cfg.num_draft_layers, **common, **cfg.draft)
    else:
        raise InputError(f"train.draft_preset={cfg.draft_preset!r}: allowed values are 'small' and 'kimi-k3'")
    if cfg.rope_theta is not None:  # the profile states the base: it wins over the preset's
        dc = replace(dc, rope_parameters={**dc.rope_parameters, "rope_theta": float(cfg.rope_theta)})
    return dc
