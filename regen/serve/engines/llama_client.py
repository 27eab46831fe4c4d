"""Talking to llama.cpp's server for the round trip: token-id completions and the speculative-decoding counters.

    complete(base, prompt_ids, n_predict, n_probs=0) -> Completion   POST /completion with a token-id prompt
    spec_counters(base) -> SpecCounters                               GET /metrics, the `llamacpp:spec_decode_*` counters

The prompt goes in as token ids (llama.cpp's native `/completion` takes an array of ids), so the engine reads
exactly the ids `regen eval` reads: no template, no tokenizer between them. At temperature 0 llama.cpp's sampler
takes the argmax (the server runs `temperature;top_p`, regen.target.llama_cpp). `n_probs` > 0 asks for the top
`n_probs` log-probabilities of the raw logits at every generated position (`post_sampling_probs: false`).

Counters (llama.cpp server, shared/docs/serving-engines.md §6.6): `spec_decode_num_drafts_total` (verification
rounds that carried a draft), `spec_decode_num_draft_tokens_total`, `spec_decode_num_accepted_tokens_total`,
`spec_decode_num_accepted_tokens_per_pos_total{position=k}`. acc_len = 1 + accepted / drafts (the bonus token
counted, the prefill token not: the same convention as regen eval, spec §7).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Completion:
    """One answer: generated `tokens` (the stop token excluded), `stop_type` ("eos", "limit", "word"),
    `draft_n`/`draft_n_accepted` (this request's drafted and accepted tokens), `predicted_n`/`predicted_ms`
    (decode tokens and milliseconds), `top` (per position: [(id, logprob), ...] best first; empty unless asked)."""

    tokens: list[int]
    stop_type: str
    draft_n: int
    draft_n_accepted: int
    predicted_n: int
    predicted_ms: float
    prompt_ms: float
    top: list = field(default_factory=list)


@dataclass(frozen=True)
class SpecCounters:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: dict = field(default_factory=dict)

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        keys = set(self.accepted_per_pos) | set(other.accepted_per_pos)
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted - other.accepted,
                            {k: self.accepted_per_pos.get(k, 0.0) - other.accepted_per_pos.get(k, 0.0) for k in keys})


def server_root(base_url: str) -> str:
    """`http://host:port` of an OpenAI base URL (`.../v1`)."""
    return base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url.rstrip("/")


def complete(base_url: str, prompt_ids: list[int], n_predict: int, *, n_probs: int = 0, cache_prompt: bool = False,
             timeout_s: float = 600.0) -> Completion:
    """Greedy completion of a token-id prompt. `cache_prompt`: reuse the slot's KV cache for the longest common
    prefix with the previous request (only the new tokens are computed). Raises RuntimeError with the server's
    answer on a non-200."""
    import httpx

    body = {"prompt": [int(t) for t in prompt_ids], "n_predict": int(n_predict), "temperature": 0.0, "top_p": 1.0,
            "return_tokens": True, "cache_prompt": bool(cache_prompt), "stream": False}
    if n_probs:
        body.update(n_probs=int(n_probs), post_sampling_probs=False)
    r = httpx.post(server_root(base_url) + "/completion", json=body, timeout=timeout_s)
    if r.status_code != 200:
        raise RuntimeError(f"llama.cpp /completion answered {r.status_code}: {r.text[:400]}")
    j = r.json()
    t = j.get("timings") or {}
    top = []
    for p in j.get("completion_probabilities") or []:
        top.append([(int(c["id"]), float(c["logprob"])) for c in p.get("top_logprobs") or []])
    return Completion([int(x) for x in j.get("tokens") or []], str(j.get("stop_type", "")),
                      int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0)), int(t.get("predicted_n", 0)),
                      float(t.get("predicted_ms", 0.0)), float(t.get("prompt_ms", 0.0)), top)


def spec_counters(base_url: str) -> SpecCounters:
    """The server's speculative-decoding counters from `/metrics` (zeros before the first draft)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server_root(base_url) + "/metrics", timeout=30.0).text
    vals, per_pos = {}, {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name.removeprefix("llamacpp:")
            if name == "spec_decode_num_accepted_tokens_per_pos_total":
                per_pos[int(s.labels["position"])] = float(s.value)
            elif name.startswith("spec_decode_"):
                vals[name.removesuffix("_total")] = float(s.value)
    return SpecCounters(vals.get("spec_decode_num_drafts", 0.0), vals.get("spec_decode_num_draft_tokens", 0.0),
                        vals.get("spec_decode_num_accepted_tokens", 0.0), per_pos)
