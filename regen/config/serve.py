"""Sub-config of the embedded target server (`regen serve-target`, and `regen run` when `enabled`).

The server is `transformers serve` (see README, "The embedded target"): a real OpenAI-compatible server from the
same library the trainer uses, bound to loopback only.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = False  # start the embedded target before `generate` when true
    model_dir: str = "data/models/smollm2-135m"  # made by `python -m regen.serve.prepare_model` (scripts/setup.sh)
    host: str = "127.0.0.1"  # loopback only
    port: int = 0  # 0 = a free ephemeral port chosen at start
    device: str = "cpu"
    continuous_batching: bool = True  # batch concurrent requests (paged attention)
    cb_num_blocks: int | None = 16  # KV capacity in 256-token whole-model blocks (16 -> 4K tokens per step read)
    cb_max_batch_tokens: int | None = 256  # tokens per forward step (prefill chunk); bounds the mask memory
    ready_timeout_s: float = 300.0  # start -> /v1/models lists the model
    warmup: bool = True  # one 1-token request before use (the first request initializes the batching cache)
    log_level: str = "info"  # `info` logs one access line per request (the request log)
    extra_args: list[str] = Field(default_factory=list)  # appended to the `transformers serve` command line

    @field_validator("host")
    @classmethod
    def _loopback(cls, value: str) -> str:
        if value not in LOOPBACK_HOSTS:
            raise ValueError(f"serve.host must be a loopback address {LOOPBACK_HOSTS}, got {value!r}")
        return value
