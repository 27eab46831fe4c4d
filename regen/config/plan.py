"""Sub-config `plan:` of a profile: the stated assumptions `regen plan` (and preflight's free-space check) use
where nothing was measured. Every value is an assumption until a pilot (`regen plan --pilot N`) measures it;
`regen plan` labels each figure with where it came from (`measured`, `pilot`, `assumed`).
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PlanConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # generation
    output_tokens: dict[str, int] = Field(default_factory=lambda: {"default": 512})  # per unit, by category or "default"
    requests_per_unit: float = 1.05  # attempts per (prompt, turn) unit: retries included
    keep_fraction: float = 0.95  # share of units that become shard rows (response filters + render rejects)
    prompt_tokens: int = 1024  # per unit, only before a selection exists (preflight's free-space estimate)
    units_per_prompt: float = 1.2  # ditto
    shard_bytes_per_token: float = 4.0  # Parquet bytes per shard token (int32 ids: 4 before compression)
    free_space_factor: float = 1.5  # preflight wants this x the planned shard bytes free
    # cluster
    servers: int = 1  # inference servers (one per endpoint or replica)
    server_output_tokens_per_s: float = 1000.0  # output tokens/s of one server at the run's concurrency
    # training
    world_size: int = 1  # training GPUs (FSDP2 ranks)
    gpu_peak_tflops: float = 989.0  # dense bf16 peak per GPU (H100 SXM: 989)
    mfu: float = 0.3  # model FLOPs utilisation assumed for training time
    target_active_params: float = 0.0  # parameters active per token in the target's forward (0: from its config)
    # feature producers (train.features: producers; regen.plan_features): stated assumptions until measured
    target_total_params: float = Field(0.0, description="all of the target's parameters (its memory in a rank "
                                       "when features are computed in process)")
    trainer_seconds_per_row: float = Field(0.0, ge=0, description="one trainer GPU's time per row (draft forward "
                                           "and backward at train.num_anchors), assumed")
    producer_prefill_tokens_per_s: float = Field(0.0, ge=0, description="prefill tokens/s of one producer engine "
                                                 "with hidden-state capture, assumed")
    producer_gpus_per_engine: int = Field(1, ge=1, description="GPUs one producer engine owns (TP x PP)")
    note: str = ""  # where the assumptions come from (printed with the plan)
