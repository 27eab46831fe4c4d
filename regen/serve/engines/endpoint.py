"""A served endpoint that regen does not start: its speculative-decoding counters (Prometheus `/metrics`), the
model it serves (`/v1/models`) and streamed `/v1/chat/completions` requests.

    snapshot(metrics_url, engine) -> Counters          the engine's own cumulative counters, now
    after - before -> Counters                          the counters of what ran in between (EndpointError when one
                                                        went backwards: the server restarted)
    check_model(base_url, model)                        EndpointError when the endpoint serves another model
    stream_chat(base_url, body) -> Answer               one streamed request, its usage and timings

Metric names per engine, each from the engine's released code at the pinned version (tests/serve/
test_endpoint_eval.py reads them there, so a rename fails loudly):
- vLLM 0.32 (`vllm/v1/spec_decode/metrics.py`): counters `vllm:spec_decode_num_drafts`, `_num_draft_tokens`,
  `_num_accepted_tokens`, `_num_accepted_tokens_per_pos{position}`;
- TokenSpeed 0.1.1 (`tokenspeed/runtime/metrics/collector.py`): `tokenspeed:spec_decode_num_drafts`,
  `_num_draft_tokens`, `_num_accepted_tokens` (no per-position counter);
- llama.cpp b11549 (the xllamacpp wheel's server): `llamacpp:spec_decode_num_drafts_total`, `_num_draft_tokens_total`,
  `_num_accepted_tokens_total`, `_num_accepted_tokens_per_pos_total{position}`;
- SGLang 0.5.23 (`sglang/srt/observability/metrics_collector.py`): no accepted-token counter (its
  `sglang:spec_accept_length` is a most-recent gauge, useless for attribution); the counters are
  `sglang:spec_verify_calls_total` (verify rounds, per request) and `sglang:generation_tokens_total`, so accepted
  drafts = generated tokens - rounds - one prefill token per request (each round commits accepted + 1).
acc_len = 1 + accepted / drafts (the bonus counted, the prefill token not: regen eval's convention, spec §7).
A counter is the sum of its samples over every label set but `position` (vLLM labels per engine and model).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from regen.errors import InputError

ENGINE_COUNTERS = {
    "vllm": {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
             "accepted": "vllm:spec_decode_num_accepted_tokens",
             "per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos"},
    "tokenspeed": {"drafts": "tokenspeed:spec_decode_num_drafts",
                   "draft_tokens": "tokenspeed:spec_decode_num_draft_tokens",
                   "accepted": "tokenspeed:spec_decode_num_accepted_tokens"},
    "llama.cpp": {"drafts": "llamacpp:spec_decode_num_drafts", "draft_tokens": "llamacpp:spec_decode_num_draft_tokens",
                  "accepted": "llamacpp:spec_decode_num_accepted_tokens",
                  "per_pos": "llamacpp:spec_decode_num_accepted_tokens_per_pos"},
    "sglang": {"drafts": "sglang:spec_verify_calls", "generated": "sglang:generation_tokens"},
}
PREFIXES = {"vllm:": "vllm", "tokenspeed:": "tokenspeed", "llamacpp:": "llama.cpp", "sglang:": "sglang"}


class EndpointError(InputError):
    """The endpoint cannot be measured as asked: the message names the URL, the metric or model, and the fix."""


@dataclass(frozen=True)
class Counters:
    """Cumulative counters of one engine (`snapshot`), or the difference of two. `generated`: SGLang only."""

    engine: str
    drafts: float = 0.0
    draft_tokens: float | None = None
    accepted: float | None = None
    per_pos: dict = field(default_factory=dict)
    generated: float | None = None

    def __sub__(self, before: "Counters") -> "Counters":
        def d(name, a, b):
            if a is None or b is None:
                return None
            if a < b:
                raise EndpointError(f"the engine's counter {name} went backwards ({b:g} -> {a:g}): the server "
                                    "restarted while it was measured; run the measurement again")
            return a - b

        return Counters(self.engine, d("drafts", self.drafts, before.drafts),
                        d("draft_tokens", self.draft_tokens, before.draft_tokens),
                        d("accepted", self.accepted, before.accepted),
                        {k: d(f"accepted_per_pos[{k}]", v, before.per_pos.get(k, 0.0))
                         for k, v in self.per_pos.items()},
                        d("generated", self.generated, before.generated))

    def with_requests(self, num_requests: int) -> "Counters":
        """SGLang: the accepted drafts of a difference from its generated tokens (module docstring)."""
        if self.engine != "sglang" or self.generated is None:
            return self
        return Counters(self.engine, self.drafts, None, max(0.0, self.generated - self.drafts - num_requests),
                        {}, self.generated)


def detect_engine(text: str) -> str:
    """The engine whose metric prefix `/metrics` shows (EndpointError when none of the four)."""
    found = {engine for prefix, engine in PREFIXES.items() if f"\n{prefix}" in "\n" + text}
    if len(found) != 1:
        raise EndpointError(f"/metrics shows the metrics of {sorted(found) or 'no known engine'}: give --engine "
                            f"({', '.join(ENGINE_COUNTERS)})")
    return found.pop()


def parse_counters(text: str, engine: str, source: str = "/metrics") -> Counters:
    """The engine's counters from Prometheus exposition `text`. EndpointError naming the missing metric (an
    engine started without speculative decoding or metrics exposes none of them)."""
    from prometheus_client.parser import text_string_to_metric_families

    names = ENGINE_COUNTERS.get(engine)
    if names is None:
        raise EndpointError(f"--engine {engine!r}: choose one of {', '.join(ENGINE_COUNTERS)}")
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    pos_name = names.get("per_pos")
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            base = s.name.removesuffix("_total")
            if pos_name and base == pos_name:
                k = int(s.labels["position"])
                per_pos[k] = per_pos.get(k, 0.0) + float(s.value)
            elif s.name.endswith("_total"):  # a counter's value (not its `_created` timestamp)
                totals[base] = totals.get(base, 0.0) + float(s.value)
    needs = {"launch": "--speculative-config with method dspark" if engine == "vllm" else "speculative decoding",
             "metrics": {"vllm": "(vLLM serves /metrics by default)", "tokenspeed": "--enable-metrics",
                         "sglang": "--enable-metrics", "llama.cpp": "--metrics"}[engine]}
    missing = [n for k, n in names.items() if k != "per_pos" and n not in totals]
    if missing:
        raise EndpointError(f"{source} has no {missing[0]} (the {engine} counter regen reads): start the server "
                            f"with {needs['launch']} and {needs['metrics']}, or give the engine it runs (--engine)")
    return Counters(engine, totals[names["drafts"]], totals.get(names.get("draft_tokens", "")),
                    totals.get(names.get("accepted", "")), per_pos, totals.get(names.get("generated", "")))


def get(url: str, timeout_s: float = 30.0):
    import httpx

    try:
        r = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise EndpointError(f"{url}: {type(exc).__name__}: {exc}; is the server up and the URL right?") from None
    if r.status_code != 200:
        raise EndpointError(f"{url} answered {r.status_code}: {r.text[:300]}")
    return r


def snapshot(metrics_url: str, engine: str | None = None) -> Counters:
    """The engine's counters now (`parse_counters` of GET metrics_url); engine None: detected from the prefixes."""
    text = get(metrics_url).text
    return parse_counters(text, engine or detect_engine(text), metrics_url)


def settled(metrics_url: str, engine: str | None = None, *, interval_s: float = 0.2, max_reads: int = 10
            ) -> Counters:
    """The counters once two reads `interval_s` apart agree (at most `max_reads` reads): an engine may record a
    request's counters just after its last chunk is sent (vLLM's stat loggers run in the output loop)."""
    last = snapshot(metrics_url, engine)
    for _ in range(max_reads - 1):
        time.sleep(interval_s)
        now = snapshot(metrics_url, engine)
        if now == last:
            return now
        last = now
    return last


def served_models(base_url: str) -> list[str]:
    """The model ids GET `<base>/v1/models` lists."""
    return [str(m.get("id")) for m in (get(base_url.rstrip("/") + "/v1/models").json().get("data") or [])]


def check_model(base_url: str, model: str) -> None:
    """EndpointError when the endpoint does not serve `model` (the profile's generate.model or --model)."""
    ids = served_models(base_url)
    if model not in ids:
        raise EndpointError(f"{base_url} serves {ids}, not {model!r}: point --endpoint at the server of that model, "
                            "or give the id it serves with --model")


@dataclass(frozen=True)
class Answer:
    """One streamed answer: `completion_tokens` (the usage the server reports; None when it reports none),
    seconds to the first content and in all, the finish reason and the text length in characters."""

    completion_tokens: int | None
    first_token_s: float | None
    total_s: float
    finish_reason: str | None
    num_chars: int


def stream_chat(base_url: str, body: dict, *, timeout_s: float = 600.0) -> Answer:
    """POST `<base>/v1/chat/completions` with `body` streamed (`stream_options.include_usage`). EndpointError on a
    non-200 answer or a stream that ends without a finish reason."""
    import httpx

    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, finish, usage, chars = None, None, None, 0
    url = base_url.rstrip("/") + "/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=timeout_s) as r:
        if r.status_code != 200:
            raise EndpointError(f"{url} answered {r.status_code}: {r.read().decode(errors='replace')[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices") or []:
                delta = c.get("delta") or {}
                text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                if text and first is None:
                    first = time.perf_counter() - t0
                chars += len(text)
                finish = c.get("finish_reason") or finish
    if finish is None:
        raise EndpointError(f"{url}: the stream ended without a finish_reason (the server dropped the request)")
    return Answer((usage or {}).get("completion_tokens"), first, time.perf_counter() - t0, finish, chars)
