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
    # answers that must never become training data as they are
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

    connect: float = Field(10.0, description="seconds to open a connection (also the `GET /models` check before "
                           "the first request)")
    first_byte: float = Field(900.0, description="seconds from sending to the first body chunk (a non-streamed "
                              "request: the whole generation)")
    between_chunks: float = Field(300.0, description="seconds a stream may stay silent between two chunks")
    total: float = Field(7200.0, description="seconds one request may take in all")


class RetryConfig(BaseModel):
    """Jittered exponential backoff: delay = min(max_s, base_s * 2**(attempt-1)) * U(0.5, 1), at least Retry-After."""

    model_config = ConfigDict(extra="forbid")

    max_attempts: int = Field(6, description="attempts per (prompt, turn) unit, all causes together")
    base_s: float = Field(1.0, description="backoff delay of the first retry, seconds (doubles per attempt, "
                          "jittered x U(0.5, 1))")
    max_s: float = Field(60.0, description="cap on one backoff delay, seconds")
    max_retry_after_s: float = Field(300.0, description="cap on a server's Retry-After, seconds")
    larger_factor: float = Field(2.0, description="policy retry_larger: max_tokens is multiplied by this per "
                                 "attempt ...")
    max_tokens_cap: int = Field(131_072, description="... up to this many tokens")


class HealthConfig(BaseModel):
    """An endpoint leaves the pool after `fail_threshold` consecutive transport failures and comes back when
    `GET {base}/models` answers (< 500) during a probe every `interval_s`."""

    model_config = ConfigDict(extra="forbid")

    fail_threshold: int = Field(5, description="consecutive transport failures that take an endpoint out of the "
                                "pool")
    interval_s: float = Field(5.0, description="seconds between probes (`GET /models`) of an endpoint out of the "
                              "pool")
    probe_timeout_s: float = Field(5.0, description="seconds one probe may take")
    max_wait_s: float = Field(600.0, description="an attempt waits this long for any available endpoint, then "
                              "fails as `connection`")


class ConcurrencyConfig(BaseModel):
    """Bounds and gains of `max_in_flight: auto` (`regen.generate.concurrency.ConcurrencyController`), per endpoint.

    A decision is taken once per window: at least `min_samples` completions (and at least as many as the limit)
    and at least `min_window_s` seconds since the previous decision, after one `settle` turnover.
    """

    model_config = ConfigDict(extra="forbid")

    initial: int = Field(8, description="requests in flight per endpoint at the start")
    min: int = Field(1, description="the lowest in-flight limit per endpoint")
    max: int = Field(1024, description="the highest in-flight limit per endpoint; a process runs endpoints x max "
                     "workers (capped)")
    min_samples: int = Field(16, description="completions in a decision window, at least (and at least the limit)")
    min_window_s: float = Field(1.0, description="seconds between two decisions, at least")
    min_gain: float = Field(0.05, description="a step up must raise output tokens/s by this fraction to be kept")
    backoff: float = Field(0.7, description="multiplicative decrease on 429/503 (AIMD, Chiu & Jain 1989), in (0, 1)")
    latency_tolerance: float = Field(2.0, description="without /metrics: a p50 TTFT above this x the TTFT that "
                                     "last paid is a queue")
    metrics: Literal["auto", "off"] = Field("auto", description="read the server's Prometheus /metrics gauges "
                                            "(vLLM, SGLang) when it has them")
    metrics_poll_s: float = Field(1.0, description="seconds between two reads of /metrics")
    queue_target: float = Field(0.05, description="with /metrics: keep the server's waiting requests at about this "
                                "fraction of its running ones (at least 1, never 0)")

    @model_validator(mode="after")
    def _check_bounds(self) -> "ConcurrencyConfig":
        if not 1 <= self.min <= self.initial <= self.max:
            raise ValueError(f"generate.concurrency needs 1 <= min ({self.min}) <= initial ({self.initial}) "
                             f"<= max ({self.max})")
        if not 0 < self.backoff < 1:
            raise ValueError("generate.concurrency.backoff must be in (0, 1)")
        return self


class ModeConfig(BaseModel):
    """One generation mode (`generate.modes.<name>`): the request settings of the prompts `regen select` gave that
    mode (`select.modes`). Fields left out keep the generate section's value; `extra_body` keys replace its keys
    (e.g. `{thinking: false, thinking_effort: null}`, `{thinking_effort: low}`, `{chat_template_kwargs:
    {enable_thinking: false}}`); a key set to null is removed from the request."""

    model_config = ConfigDict(extra="forbid")

    temperature: float | None = Field(None, description="sampling temperature of this mode's requests")
    top_p: float | None = Field(None, description="nucleus top-p of this mode's requests")
    max_tokens: int | None = Field(None, description="`max_tokens` of a first attempt in this mode")
    extra_body: dict = Field(default_factory=dict, description="keys merged over `generate.extra_body` (a key "
                             "given here replaces the section's; a key set to null removes it)")


class GenerateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field("moonshotai/Kimi-K3", description="the model id sent in every request; each endpoint's "
                       "`GET /models` must list it")
    endpoints: list[str] = Field(default_factory=list, description="OpenAI-compatible base URLs ending in /v1; may "
                                 "use ${ENV_VARS}; `--endpoint URL` adds one")
    api_key_env: str | None = Field(None, description="name of the environment variable holding the API key (the "
                                    "key itself is never in a profile, a log or an output)")
    max_in_flight: int | Literal["auto"] = Field(4096, description="requests in flight per process, or `auto`: each "
                                                 "endpoint's limit found by `concurrency`")
    concurrency: ConcurrencyConfig = Field(default_factory=ConcurrencyConfig,
                                           description="bounds and gains of `max_in_flight: auto`")
    stream: bool = Field(True, description="stream answers (SSE)")
    temperature: float = Field(1.0, description="sampling temperature sent with every request")
    top_p: float = Field(1.0, description="nucleus sampling top-p sent with every request")
    max_tokens: int = Field(32_768, description="`max_tokens` of a first attempt (reasoning + answer)")
    seed: int | None = Field(None, description="sampling seed, sent only when set (some servers reject the field)")
    extra_body: dict = Field(default_factory=dict, description="merged into every request body (e.g. `thinking`, "
                             "`chat_template_kwargs`)")
    return_token_ids: bool = Field(False, description="ask for prompt and completion token ids (vLLM/SGLang); "
                                   "opt-in: servers that do not know the field answer 400")
    served_by: dict | None = Field(None, description="the embedded engine that answers (engine, version, weights), "
                                   "set by the pipeline when `serve.enabled`; part of the request config, so a run "
                                   "is never generated by two engines")
    stream_usage: bool = Field(True, description="ask for `usage` in the stream (`stream_options.include_usage`)")
    reasoning_in_history: bool = Field(True, description="send earlier regenerated turns' `reasoning_content` back "
                                       "in later turns (interleaved thinking)")
    policies: dict[str, str] = Field(default_factory=dict, description="quality class -> policy; classes left out "
                                     "keep their default (table below)",
                                     json_schema_extra={"allowed": "quality class: " + ", ".join(DEFAULT_POLICIES)
                                                        + "; policy: " + ", ".join(POLICY_NAMES)})
    think_markers: list[str] = Field(default_factory=lambda: ["<think>", "</think>"],
                                     description="the open and close think markers checked in content and "
                                     "reasoning (`unbalanced_think`, `reasoning_leak`)")
    end_of_turn_markers: list[str] = Field(default_factory=list, description="the target template's end-of-turn "
                                           "strings (`<|im_end|>` for ChatML): an answer holding one with text after "
                                           "it is `text_after_end`; one echoed at the very end is stripped (flag "
                                           "`end_marker_stripped`); [] = no check")
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig, description="per-request timeouts, seconds")
    retry: RetryConfig = Field(default_factory=RetryConfig, description="retries and their backoff")
    health: HealthConfig = Field(default_factory=HealthConfig, description="when an endpoint leaves and rejoins "
                                 "the pool")
    part_rows: int = Field(1000, description="rows per Parquet part (bounds memory; the journal makes every row "
                           "durable before that)")
    part_interval_s: float = Field(300.0, description="... or a part at least this often, seconds")
    queue_size: int = Field(0, description="conversations queued ahead of the workers; 0 = 2 x max_in_flight")
    ray_actors: int = Field(0, description="with `--ray`: the number of actors; 0 = one per alive node")
    progress_interval_s: float = Field(60.0, ge=0, description="seconds between progress lines (units done, "
                                       "rates, ETA) printed where no progress bar draws: stdout not a terminal, "
                                       "`--no-progress`, the Prefect flow's logs; 0 = none")
    modes: dict[str, ModeConfig] = Field(default_factory=dict, description="generation mode -> its request settings "
                                         "(`generate.modes.<name>.*`); a prompt's `mode` column (select.modes) "
                                         "picks one; {} = every prompt with the section's settings")

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

    def for_mode(self, mode: str | None) -> "GenerateConfig":
        """This config with mode `mode`'s settings applied (`ModeConfig`); itself for None or a profile without
        modes. InputError for a mode the profile does not define (a selection made under other modes)."""
        if mode is None or not self.modes:
            return self
        m = self.modes.get(mode)
        if m is None:
            from regen.errors import InputError

            raise InputError(f"a prompt has generation mode {mode!r}, which generate.modes does not define "
                             f"({sorted(self.modes)}): add it to generate.modes, or select again with the "
                             "profile's select.modes")
        update = {k: v for k, v in (("temperature", m.temperature), ("top_p", m.top_p),
                                    ("max_tokens", m.max_tokens)) if v is not None}
        update["extra_body"] = {k: v for k, v in {**self.extra_body, **m.extra_body}.items() if v is not None}
        update["modes"] = {}
        return self.model_copy(update=update)

    def policy(self, klass: str) -> str:
        """The policy for a quality class: the profile's, else the default."""
        return self.policies.get(klass, DEFAULT_POLICIES[klass])
