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
                          "127.0.0.1 with a master on loopback, else the address routing toward the master (refused if loopback)")
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
    read_ahead: int = Field(2, ge=0, description="feature objects a rank reads out of the store ahead of the "
                            "micro-batch computing, in a reader thread, across step boundaries (the store's reads "
                            "overlap compute; host slots: read_ahead on a GPU, + 1 on CPU); 0 = every object of a "
                            "step read before its first forward (host slots: train.grad_accum)")
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
                                 "producers must reach it: auto = the address routing toward the store's master "
                                 "(127.0.0.1 with a master on loopback; a loopback answer otherwise is refused)")
    dispatcher_port: int = Field(0, ge=0, le=65535, description="its port (0 = a free one, written to "
                                 "<train dir>/features/dispatcher.json)")
    store: StoreConfig = Field(default_factory=StoreConfig, description="the Mooncake store that carries the "
                               "feature objects")


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="`regen run` trains after render (and evaluates when eval_prompts > 0)")
    # target and feature contract (spec §1)
    target: str | None = Field(None, description="local path of the target model (a transformers directory); may "
                               "use ${ENV}")
    features: Literal["in_process", "producers"] = Field(
        "in_process", description="where tap features come from: the whole target in every trainer rank "
        "(small targets), or a producer pool through a Mooncake store (docs/train.md, \"Training at scale\")")
    producers: ProducersConfig = Field(default_factory=ProducersConfig, description="the feature producer pool "
                                       "(features: producers)")
    feature_cache_gib: float = Field(0.0, ge=0, allow_inf_nan=False, description="host memory (GiB) for the in-process target's "
                                     "features, kept per row after its first forward and read on every later epoch "
                                     "(regen.train.feature_cache); per rank (each keeps its own rows); for a small "
                                     "target trained over many epochs; 0 = off; not used with features: producers")
    target_head_keys: dict[str, str] = Field(default_factory=dict, description="tensor names {embed, norm, "
                                             "lm_head} of the target head, for architectures transformers cannot "
                                             "build (regen.train.target_head)")
    target_layer_ids: list[int] = Field(default_factory=list, description="the target's tap layers; empty = the "
                                        "default rule for 3 taps (spec §1)")
    aux_hidden_stream: Literal["prefix", "attn_res"] = Field("prefix", description="which hidden stream the taps "
                                                             "read (spec §1)")
    fc_norm: bool = Field(False, description="a per-tap RMSNorm before the draft's fc (taps differ in scale across "
                          "depth)")
    target_dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="the target's dtype; auto = "
                                                                 "bf16 on CUDA and on CPUs with native bf16, else "
                                                                 "fp32")
    # draft (spec §2-§4, §8)
    draft_preset: Literal["small", "kimi-k3"] = Field("small", description="small: sized from the target's config "
                                                      "(spec §9); kimi-k3: the full-size K3 MLA draft (spec §2, §8)")
    attention_type: Literal["mla", "gqa"] = Field("mla", description="the draft's attention")
    block_size: int = Field(7, description="draft tokens per block (spec §2)")
    num_draft_layers: int = Field(5, description="the draft's decoder layers")
    markov_rank: int = Field(256, description="rank of the Markov head (a low-rank bigram of the previous token; 0 "
                             "= none)")
    enable_confidence_head: bool = Field(True, description="train the confidence head (spec §4)")
    mask_token_id: int | None = Field(None, description="the mask token of the draft's block; null = the preset's "
                                      "(small: vocab_size - 1)")
    rope_theta: float | None = Field(default=None, gt=0, description="the draft's RoPE base θ, written to "
                                     "config.json and checked by `regen eval` against the checkpoint's; null = the "
                                     "preset's (small 10,000, kimi-k3 50,000, spec §2 table)")
    draft_vocab_size: int = Field(default=0, ge=0, description="a reduced output vocabulary (EAGLE-3 d2t/t2d): the N "
                                  "most frequent supervised tokens of the training shards; targets outside it leave "
                                  "the loss; 0 = the target's full vocabulary (K3 serving)")
    serve_engines: list[Literal["tokenspeed", "vllm", "sglang", "llama.cpp"]] = Field(
        default_factory=list, description="the serving engines the trained draft must load in: preflight and `regen "
        "plan` stop a profile whose draft one of them cannot represent (docs/serve.md); empty: only a draft no "
        "engine serves is a problem")
    draft: dict = Field(default_factory=dict, description="DSparkConfig field overrides on top of the preset (e.g. "
                        "`{hidden_size: 7168, num_hidden_layers: 5}`)")
    # objective (spec §5)
    num_anchors: int = Field(512, description="anchor positions drawn per row (spec §5)")
    loss_decay_gamma: float = Field(4.0, description="γ of the per-slot loss decay (spec §5)")
    loss_weights: list[float] = Field(default_factory=lambda: [0.1, 0.9, 1.0], description="weights of CE, L1 and "
                                      "the confidence loss")
    # optimisation (spec §6)
    lr: float = Field(6e-4, description="AdamW peak learning rate")
    weight_decay: float = Field(0.0, description="AdamW weight decay")
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.95], description="AdamW betas")
    adam_eps: float = Field(1e-8, description="AdamW epsilon")
    warmup_frac: float = Field(0.04, description="share of the steps in linear warmup")
    min_lr_frac: float = Field(0.0, description="the cosine decays to lr x min_lr_frac")
    grad_clip: float = Field(1.0, description="gradient norm clip")
    max_steps: int = Field(0, description="optimizer steps = the schedule's length; 0 = `epochs` passes (required "
                           "with --follow)")
    epochs: int = Field(1, description="passes over the data (training ends at the first of max_steps and epochs); "
                        "0 = no limit")
    grad_accum: int = Field(1, description="micro-batches per rank per optimizer step")
    loss_normalization: Literal["step", "micro_batch"] = Field(
        "step", description="how an optimizer step weighs its micro-batches: step = Σ w·term / Σ w over the whole "
        "step (any world size x accumulation equals one big batch); micro_batch = each micro-batch by its own Σ w "
        "over ranks, then the mean over the accumulation steps (the reference's, DS trainer)")
    seed: int | None = Field(None, description="the trainer's seed; null = the profile's seed")
    device: str = Field("auto", description="auto | cpu | cuda; cuda stops with an error where torch sees no CUDA "
                        "device or LOCAL_RANK is beyond the visible ones; auto falls back to cpu with a warning")
    attention: Literal["sdpa", "flex"] = Field("sdpa", description="the draft's attention: sdpa = dense mask, "
                                               "memory-efficient backend pinned on CUDA; flex = flex_attention "
                                               "with a block mask (masked tiles skipped; CUDA only)")
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="the draft's compute dtype; auto = "
                                                          "bf16 on CUDA and on CPUs with native bf16, else fp32")
    # data feed (regen.train.feed)
    max_len: int = Field(4096, description="tokens per row (longer rows are truncated, see truncate)")
    truncate: Literal["right", "left"] = Field("right", description="right: keep a long row's first max_len tokens "
                                               "(DS); left: keep its last max_len (the supervised end)")
    max_tokens: int = Field(16384, description="padded tokens per micro-batch")
    max_batch: int = Field(8, description="rows per micro-batch")
    shuffle_buffer: int = Field(1024, description="rows in the feed's shuffle buffer")
    bucket_window: int = Field(256, description="samples per window sorted by length and cut "
                               "into micro-batches")
    min_loss_tokens: int = Field(14, description="rows with fewer supervised tokens after "
                                 "truncation are left out (spec §5)")
    heldout_fraction: float = Field(0.05, description="share of prompts kept out of training for `regen eval` "
                                    "(regen.train.heldout.is_heldout)")
    heldout_per_cell: int = Field(0, ge=0, description="held-out prompts wanted per category x length band x mode "
                                  "cell of the first selection, added to the fraction's where it has fewer (at most "
                                  "half a cell, or its one prompt; regen.train.heldout.cell_picks); 0 = the "
                                  "fraction alone")
    on_bad_shard: Literal["error", "skip"] = Field("error", description="a shard whose checksum or rows do not match "
                                                   "its manifest: stop, or leave it out on every rank")
    follow_poll_s: float = Field(10.0, description="--follow: seconds between looks for new shards")
    follow_timeout_s: float = Field(0.0, description="--follow: seconds to wait for the finished marker; 0 = no "
                                    "limit")
    # checkpoints and logs
    checkpoint_every: int = Field(500, description="steps between checkpoints; one is also written at the end")
    keep_checkpoints: int = Field(2, description="checkpoints kept (older ones are removed)")
    log_every: int = Field(10, description="steps between training log lines")
    log_samples: bool = Field(False, description="write train/samples-rank{R}.jsonl: the sample_ids of every step "
                              "(audit, tests)")
    # the main job's last step (`regen run`): `regen eval` of the trained draft against an untrained one
    eval_prompts: int = Field(0, description="`regen run`: held-out prompts to measure acc_len on after training; "
                              "0 = no eval step")
    eval_max_new_tokens: int = Field(64, description="`regen run`'s eval: new tokens per prompt")
    # during training: the held-out estimate, the best checkpoint, tracking, warm start
    eval_every: int = Field(0, ge=0, description="steps between held-out acc_len estimates during training "
                            "(`regen.train.periodic_eval`: teacher-forced on held-out rows' recorded answers, "
                            "labelled an estimate); 0 = none")
    eval_rows: int = Field(16, ge=1, description="held-out rows of each estimate during training")
    keep_best: bool = Field(True, description="with eval_every: keep the checkpoint of the best estimate in "
                            "<train>/best/ beside the latest")
    tracking: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["tensorboard"], description="where training and evaluation figures go besides "
        "log.jsonl: TensorBoard event files in <train>/tensorboard/; `wandb` and `mlflow` only where installed "
        "(asking for one that is not is an error)")
    tracking_project: str = Field("regen", description="the W&B project / MLflow experiment name")
    progress_interval_s: float = Field(60.0, ge=0, description="seconds between training progress lines on "
                                       "stdout (step, loss, rate, ETA); 0 = none")
    init_from: str | None = Field(None, description="start training from this draft checkpoint (a step folder, a "
                                  "training directory with latest.json, or an exported draft folder), checked "
                                  "against the profile; ignored when the run resumes its own checkpoint")
