"""Sub-config of `regen train` / `regen eval` (owned by the trainer).

Draft presets: `small` builds a draft sized from the target's config (`regen.train.model.small_config_for_target`,
spec §9); `kimi-k3` is the full-size K3 MLA draft (`regen.train.model.kimi_k3_config`, spec §2/§8). `draft` holds
DSparkConfig field overrides applied on top of either (e.g. `{hidden_size: 7168, num_hidden_layers: 5}`).
Training defaults follow the DS Qwen3-4B recipe (spec §6): AdamW, warmup 4 %, cosine, grad clip 1.0, wd 0.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def _bytes(value):
    from regen.config.units import parse_bytes

    try:
        return parse_bytes(value)
    except ValueError as exc:  # InputError is a ValueError: pydantic reports it with the field's name
        raise ValueError(str(exc)) from None


Bytes = Annotated[int, BeforeValidator(_bytes)]


class StoreConfig(BaseModel):
    """The Mooncake store that carries feature objects (regen.train.features.store)."""

    model_config = ConfigDict(extra="forbid")

    master: str = Field("local", description="`local`: regen starts a mooncake_master on 127.0.0.1 for this run "
                        "and stops it; else host:port of an existing master (a cluster's), may use ${ENV}")
    metrics_url: str | None = Field("auto", description="the master's Prometheus URL for the store's own resident "
                                    "bytes; auto = the local master's, or port 9003 (mooncake_master's default) of "
                                    "an external master's host; null = not measured")
    protocol: Literal["tcp", "rdma"] = Field("tcp", description="Mooncake transfer protocol (rdma on GPU clusters)")
    device: str = Field("", description="RDMA device names for protocol rdma (Mooncake `rdma_devices`)")
    hostname: str = Field("auto", description="the address this process's Mooncake client announces; auto = "
                          "127.0.0.1 with a master on loopback, else this host's address")
    segment_bytes_per_rank: Bytes | None = Field(None, ge=0, description="memory each trainer rank mounts into the "
                                               "store; null = its share of budget_bytes plus one object; 0 = store "
                                               "nodes (`regen features store`) hold the objects")
    local_buffer_bytes: Bytes | None = Field(None, ge=0, description="each client's Mooncake transfer buffer; null "
                                           "= twice the largest object")
    put_release_s: float = Field(15.0, gt=0, description="how long bytes of a producer that died mid-put stay "
                                 "counted (Mooncake's put_start_release_timeout_sec; 600 on a default master)")


class ProducersConfig(BaseModel):
    """The feature producer pool (`train.features: producers`, regen.train.features)."""

    model_config = ConfigDict(extra="forbid")

    num_local: int = Field(2, ge=0, description="producers this job starts itself on this machine (transformers, "
                           "train.target); 0 = only producers started elsewhere (`regen features produce`)")
    local_threads: int = Field(1, ge=0, description="torch threads of each local producer (0 = torch's default)")
    local_device: str = Field("cpu", description="device of the local producers: cpu | cuda:N | auto")
    local_max_len: int = Field(0, ge=0, description="longest row a local producer runs (0 = the model's "
                               "max_position_embeddings); longer micro-batches fail back to the dispatcher")
    budget_bytes: Bytes = Field(0, ge=0, description="bytes of feature objects produced ahead and not yet consumed, "
                              "leases included (0 = 8 of the largest objects)")
    max_ahead: int = Field(64, ge=1, description="micro-batches planned ahead of the trainer at most")
    max_attempts: int = Field(3, ge=1, description="attempts (failures or producer deaths) before a micro-batch's "
                              "features count as failed")
    on_failure: Literal["error", "zero_loss"] = Field("error", description="a micro-batch that failed on every "
                                                      "attempt: stop naming it, or zero its loss mask (counted in "
                                                      "train/summary.json) so every rank stays in step")
    heartbeat_s: float = Field(1.0, gt=0, description="producer heartbeat period")
    lease_timeout_s: float = Field(15.0, gt=0, description="a producer silent this long is dead; its leases go "
                                   "back to the pool")
    no_producer_timeout_s: float = Field(120.0, gt=0, description="every producer gone this long: the trainer "
                                         "stops with a clear error (its last checkpoint intact)")
    startup_timeout_s: float = Field(600.0, gt=0, description="no producer registered this long after start: "
                                     "the same error (a large target loads for minutes)")
    dispatcher_host: str = Field("127.0.0.1", description="address rank 0's dispatcher binds; a cluster's "
                                 "producers must reach it: auto = this host's address")
    dispatcher_port: int = Field(0, ge=0, le=65535, description="its port (0 = a free one, written to "
                                 "<train dir>/features/dispatcher.json)")
    store: StoreConfig = Field(default_factory=StoreConfig)


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    # target and feature contract (spec §1)
    target: str | None = None  # local path of the target model (transformers directory); may use ${ENV}
    features: Literal["in_process", "producers"] = Field(
        "in_process", description="where tap features come from: the whole target in every trainer rank "
        "(small targets), or a producer pool through a Mooncake store (README \"Training at scale\")")
    producers: ProducersConfig = Field(default_factory=ProducersConfig)
    target_head_keys: dict[str, str] = Field(default_factory=dict, description="tensor names {embed, norm, "
                                             "lm_head} of the target head, for architectures transformers cannot "
                                             "build (regen.train.target_head)")
    target_layer_ids: list[int] = Field(default_factory=list)  # empty = the default rule for 3 taps (spec §1)
    aux_hidden_stream: str = "prefix"  # prefix | attn_res
    fc_norm: bool = False
    target_dtype: str = "auto"  # auto (bf16 on cuda and CPUs with native bf16, else fp32) | float32 | bfloat16
    # draft (spec §2-§4, §8)
    draft_preset: str = "small"  # small | kimi-k3
    attention_type: str = "mla"  # mla | gqa
    block_size: int = 7
    num_draft_layers: int = 5
    markov_rank: int = 256
    enable_confidence_head: bool = True
    mask_token_id: int | None = None  # null = the preset's (small: vocab_size - 1)
    # the draft's RoPE base θ (written to config.json, checked by `regen eval` against the checkpoint's);
    # null = the preset's: small 10,000, kimi-k3 50,000 (spec §2 table)
    rope_theta: float | None = Field(default=None, gt=0)
    # reduced output vocabulary (EAGLE-3 d2t/t2d, regen.train.draft_vocab): the N most frequent supervised tokens of
    # the training shards; targets outside it leave the loss. 0 = the target's full vocabulary (K3 serving).
    draft_vocab_size: int = Field(default=0, ge=0)
    draft: dict = Field(default_factory=dict)  # DSparkConfig field overrides
    # objective (spec §5)
    num_anchors: int = 512
    loss_decay_gamma: float = 4.0
    loss_weights: list[float] = Field(default_factory=lambda: [0.1, 0.9, 1.0])  # CE, L1, confidence
    # optimisation (spec §6)
    lr: float = 6e-4
    weight_decay: float = 0.0
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.95])
    adam_eps: float = 1e-8
    warmup_frac: float = 0.04
    min_lr_frac: float = 0.0  # cosine decays to lr * min_lr_frac
    grad_clip: float = 1.0
    max_steps: int = 0  # optimizer steps = the schedule's length; 0 = `epochs` passes (required with --follow)
    epochs: int = 1  # passes over the data (training ends at the first of max_steps and epochs); 0 = no limit
    grad_accum: int = 1  # micro-batches per rank per optimizer step
    # how an optimizer step weighs its micro-batches (README "The trainer"): "step" = Σ w·term / Σ w over the
    # whole step (any world size x accumulation equals one big batch); "micro_batch" = each micro-batch by its own
    # Σ w over ranks, then the mean over the accumulation steps (the reference, DS trainer)
    loss_normalization: Literal["step", "micro_batch"] = "step"
    seed: int | None = None  # null = the profile's seed
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # draft compute: auto (bf16 on cuda and CPUs with native bf16, else fp32) | float32 | bfloat16
    # data feed (regen.train.feed)
    max_len: int = 4096  # tokens per row (longer rows are truncated)
    truncate: str = "right"  # right: keep a long row's first max_len tokens (DS); left: keep its last max_len
    max_tokens: int = 16384  # padded tokens per micro-batch
    max_batch: int = 8  # rows per micro-batch
    shuffle_buffer: int = 1024
    bucket_window: int = 256
    min_loss_tokens: int = 14
    heldout_fraction: float = 0.05  # prompts kept out of training for `regen eval` (regen.train.eval.is_heldout)
    on_bad_shard: str = "error"  # error | skip
    follow_poll_s: float = 10.0
    follow_timeout_s: float = 0.0  # 0 = wait for the finished marker without limit
    # checkpoints and logs
    checkpoint_every: int = 500  # steps; a checkpoint is also written at the end
    keep_checkpoints: int = 2
    log_every: int = 10
    log_samples: bool = False  # write train/samples-rank{R}.jsonl: the sample_ids of every step (audit, tests)
    # the main job's last step (`regen run`): `regen eval` of the trained draft against an untrained one
    eval_prompts: int = 0  # held-out prompts to measure acc_len on after training; 0 = no eval step
    eval_max_new_tokens: int = 64
