"""Sub-config of `regen generate` (owned by the regeneration client).

Every field has a default; profiles set only what differs. Times are seconds. Quality classes and their
policies are defined in `regen.generate.checks` (QUALITY_CLASSES, POLICIES).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

POLICY_NAMES = ("retry", "retry_larger", "keep_flagged", "drop")

DEFAULT_POLICIES = {
    "empty_body": "retry",
    "malformed": "retry",
    "empty_content": "retry",
    "truncated": "retry_larger",
    "reasoning_leak": "keep_flagged",
    "unbalanced_think": "retry",
    "invalid_tool_args": "retry",
    # issue 20: answers that must never become training data as they are
    "content_filter": "drop",  # the server's filter stopped the answer; a retry rarely differs
    "unfinished": "retry",  # finish_reason outside the allow-list (abort, null, ...): a partial answer
    "text_after_end": "retry",  # text after the end-of-turn marker: a new sample usually stops
    "over_max_tokens": "retry",  # more completion tokens than max_tokens: the server ran past its limit
    "usage_inconsistent": "keep_flagged",  # reasoning_tokens > completion_tokens: accounting, the text is whole
}
# classes whose answer is partial, filtered or runs past its end: keeping it (keep_flagged, retry_larger) would
# make training data of it
RESTRICTED_POLICIES = {
    "content_filter": ("drop", "retry"),
    "unfinished": ("retry", "drop"),
    "text_after_end": ("retry", "drop"),
}


class TimeoutConfig(BaseModel):
    """Per-request timeouts (seconds). `first_byte` runs from sending to the first body chunk (for a
    non-streamed request that is the whole generation); `between_chunks` bounds a stalled stream."""

    model_config = ConfigDict(extra="forbid")

    connect: float = 10.0
    first_byte: float = 900.0
    between_chunks: float = 300.0
    total: float = 7200.0


class RetryConfig(BaseModel):
    """Jittered exponential backoff: delay = min(max_s, base_s * 2**(attempt-1)) * U(0.5, 1), at least Retry-After."""

    model_config = ConfigDict(extra="forbid")

    max_attempts: int = 6  # per (prompt, turn), all causes together
    base_s: float = 1.0
    max_s: float = 60.0
    max_retry_after_s: float = 300.0  # cap on a server's Retry-After
    larger_factor: float = 2.0  # retry_larger: max_tokens *= factor per attempt ...
    max_tokens_cap: int = 131_072  # ... up to this


class HealthConfig(BaseModel):
    """An endpoint leaves the pool after `fail_threshold` consecutive transport failures and comes back when
    `GET {base}/models` answers (< 500) during a probe every `interval_s`."""

    model_config = ConfigDict(extra="forbid")

    fail_threshold: int = 5
    interval_s: float = 5.0
    probe_timeout_s: float = 5.0
    max_wait_s: float = 600.0  # an attempt waits this long for any available endpoint, then fails as `connection`


class ConcurrencyConfig(BaseModel):
    """Bounds and gains of `max_in_flight: auto` (`regen.generate.concurrency.ConcurrencyController`), per endpoint.

    A decision is taken once per window: at least `min_samples` completions (and at least as many as the limit)
    and at least `min_window_s` seconds since the previous decision, after one `settle` turnover.
    """

    model_config = ConfigDict(extra="forbid")

    initial: int = 8  # requests in flight per endpoint at the start
    min: int = 1
    max: int = 1024  # per endpoint; also the number of workers of a process is endpoints x max (capped)
    min_samples: int = 16
    min_window_s: float = 1.0
    min_gain: float = 0.05  # a step up must raise output tokens/s by this fraction to be kept
    backoff: float = 0.7  # multiplicative decrease on 429/503 (AIMD, Chiu & Jain 1989)
    latency_tolerance: float = 2.0  # no-gauge mode: p50 TTFT above this x the TTFT that last paid is a queue
    metrics: Literal["auto", "off"] = "auto"  # read the server's Prometheus /metrics gauges when it has them
    metrics_poll_s: float = 1.0
    queue_target: float = 0.05  # gauge mode: keep waiting ~ this fraction of running (at least 1, never 0)

    @model_validator(mode="after")
    def _check_bounds(self) -> "ConcurrencyConfig":
        if not 1 <= self.min <= self.initial <= self.max:
            raise ValueError(f"generate.concurrency needs 1 <= min ({self.min}) <= initial ({self.initial}) "
                             f"<= max ({self.max})")
        if not 0 < self.backoff < 1:
            raise ValueError("generate.concurrency.backoff must be in (0, 1)")
        return self


class GenerateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = "moonshotai/Kimi-K3"
    endpoints: list[str] = Field(default_factory=list)  # base URLs ending in /v1; may use ${ENV_VARS}
    api_key_env: str | None = None  # name of the environment variable holding the API key
    max_in_flight: int | Literal["auto"] = 4096  # or "auto": per-endpoint limit found by `concurrency`
    concurrency: ConcurrencyConfig = Field(default_factory=ConcurrencyConfig)
    stream: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 32_768
    seed: int | None = None  # sent only when set: some servers reject the field
    extra_body: dict = Field(default_factory=dict)  # merged into every request body (e.g. thinking, chat_template_kwargs)
    return_token_ids: bool = False  # opt-in: servers that do not know the field answer 400
    # The embedded engine that answers (regen.serve.server.engine_identity: engine, version, weights), set by the
    # pipeline when `serve.enabled`; part of the request config, so a run is never generated by two engines.
    served_by: dict | None = None
    stream_usage: bool = True  # stream_options.include_usage when streaming
    reasoning_in_history: bool = True  # send earlier regenerated turns' reasoning_content back (interleaved thinking)
    policies: dict[str, str] = Field(default_factory=dict)  # quality class -> retry|retry_larger|keep_flagged|drop
    think_markers: list[str] = Field(default_factory=lambda: ["<think>", "</think>"])  # open, close
    # the target template's end-of-turn strings (e.g. ["<|im_end|>"] for ChatML): an answer holding one with text
    # after it is `text_after_end`; one echoed at the very end is stripped (flag end_marker_stripped). [] = no check
    end_of_turn_markers: list[str] = Field(default_factory=list)
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    part_rows: int = 1000  # rows per Parquet part (bounds memory; the journal makes every row durable before that)
    part_interval_s: float = 300.0  # ... or a part at least this often
    queue_size: int = 0  # conversations queued ahead of the workers; 0 = 2 * max_in_flight
    ray_actors: int = 0  # with --ray: number of actors; 0 = one per alive node

    @field_validator("policies")
    @classmethod
    def _check_policies(cls, value: dict[str, str]) -> dict[str, str]:
        for klass, policy in value.items():
            if klass not in DEFAULT_POLICIES:
                raise ValueError(f"unknown quality class {klass!r}; allowed: {sorted(DEFAULT_POLICIES)}")
            if policy not in POLICY_NAMES:
                raise ValueError(f"policy {policy!r} for {klass!r} is not one of {list(POLICY_NAMES)}")
            allowed = RESTRICTED_POLICIES.get(klass, POLICY_NAMES)
            if policy not in allowed:
                raise ValueError(f"policy {policy!r} for {klass!r}: such an answer must not become a row; use one "
                                 f"of {list(allowed)}")
        return value

    @field_validator("end_of_turn_markers")
    @classmethod
    def _check_markers(cls, value: list[str]) -> list[str]:
        if any(not m or m.isspace() for m in value):
            raise ValueError("end_of_turn_markers: every marker must be a non-blank string, e.g. '<|im_end|>'")
        return value

    @field_validator("max_in_flight")
    @classmethod
    def _check_in_flight(cls, value: int | str) -> int | str:
        if value != "auto" and value < 1:
            raise ValueError("max_in_flight must be >= 1")
        return value

    @property
    def auto_in_flight(self) -> bool:
        return self.max_in_flight == "auto"

    def in_flight_cap(self, num_endpoints: int) -> int:
        """Requests in flight at most for one process: the fixed number, or (auto) endpoints x concurrency.max."""
        if self.max_in_flight == "auto":
            return max(1, num_endpoints) * self.concurrency.max
        return self.max_in_flight

    def policy(self, klass: str) -> str:
        """The policy for a quality class: the profile's, else the default."""
        return self.policies.get(klass, DEFAULT_POLICIES[klass])
