"""Sub-config `plan:` of a profile: the stated assumptions `regen plan` (and preflight's free-space check) use
where nothing was measured. Every value is an assumption until a pilot (`regen plan --pilot N`) measures it;
`regen plan` labels each figure with where it came from (`measured`, `pilot`, `assumed`).
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PlanConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # generation
    output_tokens: dict[str, int] = Field(default_factory=lambda: {"default": 512}, description="output tokens per "
                                          "unit, by category or `default`")
    mode_output_factor: dict[str, float] = Field(default_factory=dict, description="generation mode -> its "
                                                 "units' output tokens as a multiple of their category's "
                                                 "`output_tokens` (modes left out: 1.0)")
    requests_per_unit: float = Field(1.05, description="attempts per (prompt, turn) unit, retries included")
    keep_fraction: float = Field(0.95, description="share of units that become shard rows (response filters and "
                                 "render rejects)")
    prompt_tokens: int = Field(1024, description="prompt tokens per unit, used only before a selection exists "
                               "(preflight's free-space estimate)")
    units_per_prompt: float = Field(1.2, description="units per prompt, used only before a selection exists")
    shard_bytes_per_token: float = Field(4.0, description="Parquet bytes per shard token (int32 ids: 4 before "
                                         "compression)")
    free_space_factor: float = Field(1.5, description="preflight wants this x the planned shard bytes free on the "
                                     "run directory")
    # cluster
    servers: int = Field(1, description="inference servers (one per endpoint or replica)")
    server_output_tokens_per_s: float = Field(1000.0, description="output tokens/s of one server at the run's "
                                              "concurrency")
    # training
    world_size: int = Field(1, description="training GPUs (FSDP2 ranks)")
    gpu_peak_tflops: float = Field(989.0, description="dense bf16 peak TFLOPS per GPU (H100 SXM: 989)")
    mfu: float = Field(0.3, description="model FLOPs utilisation assumed for training time")
    target_active_params: float = Field(0.0, description="parameters active per token in the target's forward "
                                        "(0: from its config)")
    # feature producers (train.features: producers; regen.plan_features): stated assumptions until measured
    target_total_params: float = Field(0.0, description="all of the target's parameters (its memory in a rank "
                                       "when features are computed in process)")
    trainer_seconds_per_row: float = Field(0.0, ge=0, description="one trainer GPU's time per row (draft forward "
                                           "and backward at train.num_anchors), assumed")
    producer_prefill_tokens_per_s: float = Field(0.0, ge=0, description="prefill tokens/s of one producer engine "
                                                 "with hidden-state capture, assumed")
    producer_gpus_per_engine: int = Field(1, ge=1, description="GPUs one producer engine owns (TP x PP)")
    note: str = Field("", description="where the assumptions come from (printed with the plan)")
