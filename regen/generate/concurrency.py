"""`generate.max_in_flight: auto`: how many requests one endpoint gets at once, found from its own signals.

`ConcurrencyController` is pure (no clock, no I/O: the caller passes `now` in seconds) and there is one per
endpoint, so a multi-endpoint run adapts to each server. The client feeds it every attempt's start
(`on_start`: requests now outstanding at that endpoint) and end (`on_done`: latency_s, ttft_s, output tokens,
error class), and, where the server exposes Prometheus `/metrics`, its gauges (`on_gauges`: requests running,
waiting, KV-cache usage in [0, 1]). It answers with `limit` (int, in [cfg.min, cfg.max]) and keeps `history`,
a list of (t_s, limit, reason) at every change.

The law, taken once per window (after one turnover `settle` following a change: at least `min_samples`
completions, at least `limit` of them, and at least max(min_window_s, p50 latency) seconds; in slow start the
settle and the window last one p50 latency, without min_window_s, and a doubling needs only `limit` completions
(with gauges: one reading and `limit` completions, or two readings), while ending slow start on "no gain" still
needs `min_samples`, so the ramp costs a few turnovers), first match wins:

1. Overload: a 429 or 503 in the window -> limit *= backoff (multiplicative decrease of AIMD, Chiu & Jain 1989,
   as TCP Reno on loss); probing pauses for `HOLD_WINDOWS` windows.
2. Gauges (fresh `on_gauges` in the window): a queue target, as TCP Vegas keeps between alpha and beta packets
   queued at the bottleneck (Brakmo & Peterson 1995), but the queue is read from the server instead of being
   estimated from round-trip times. Target q* = max(1, queue_target x running), mean over the window:
   waiting > 2 q* (or KV cache >= 0.98 with a queue): limit *= clip((running + q*) / (running + waiting), backoff, 0.9)
   (floor 0.5 instead of backoff when the queue ends slow start: a doubling overshoots by 2x at most);
   waiting < q* / 2 (the queue runs empty, so decode slots may idle) and the limit binds: limit x 2 until the
   first queue is seen (slow start), then limit += step; otherwise hold. A short queue that never empties keeps every
   decode slot busy without growing latency.
3. No gauges: hill climbing on output tokens/s, the probe of BBR ("did more in flight deliver more?", Cardwell
   et al. 2016), with TCP's slow start then additive increase: while a step up raises tokens/s by at least
   `min_gain`, step up again (x2 in slow start, then + step); a step that did not pay is undone (back to the
   best limit; slow start ends) and probing pauses for `HOLD_WINDOWS` windows. A queue guard, as TCP Vegas's
   BaseRTT: when the window's p50 time to first token exceeds `latency_tolerance` x the reference TTFT and that
   excess is over 10% of the p50 latency (queueing, not jitter), limit -= step; in slow start (the doubling
   overshot) the limit goes down to the requests the server was serving, limit x (1 - mean queue wait / mean
   latency) by Little's law (wait: TTFT - reference), not below the last limit that paid, and slow start ends.
   The reference is what the server's batching costs: the p50 TTFT of slow start's last window that paid, fixed
   once slow start ends (so additive steps cannot carry a queue into it); the first window, with no gain to show,
   is read against the lowest single TTFT in it, so a start above the server's capacity still finds the
   unqueued TTFT.
   A gain excuses a queue. On a continuous-batching server bound by its compute (transformers serve on 2 CPU
   cores) TTFT and latency grow with the batch, every request sharing the compute, with no queue, while tokens/s
   still grows by far more than `min_gain`; a guard against the lowest TTFT ever seen backed off there (2 -> 4
   -> 8 -> 16 -> 8: 0.67x the best fixed concurrency's tokens/s). So a window whose tokens/s grew by `min_gain`
   over the best is not backed off when its p50 time per output token after the first also grew by `min_gain`:
   decoding slowed, so the batch grew, and latency that buys throughput is batching. A queue delays only first
   tokens; a gain read while decoding went no slower is noise or the turnover (the first window after a doubling
   counts the answers of the cohort before it: in a simulation of the test server a doubling past its slots read
   +24% for no gain), and the window counts as one without a gain (so does any window of answers not streamed,
   which have no time per token). A window without a gain whose TTFT grew (a
   plateau where latency still grows: a queue) is backed off as before.

step = max(1, limit / 8). A window where the limit never bound (fewer requests to send than the limit: the
client, not the server, was the bottleneck) decides nothing, so the limit does not grow past what is used.
"""
from __future__ import annotations

import statistics

from regen.config.generate import ConcurrencyConfig

HOLD_WINDOWS = 3  # windows without probing after a backoff or an undone step


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


class ConcurrencyController:
    """One endpoint's in-flight limit under `generate.max_in_flight: auto` (see the module doc for the law)."""

    def __init__(self, cfg: ConcurrencyConfig, now: float = 0.0):
        self.cfg = cfg
        self._limit = float(cfg.initial)
        self.slow_start = True
        self.hold = 0
        self.best_rate: float | None = None  # output tokens/s of the best window
        self.best_limit = cfg.initial
        self.best_tpot: float | None = None  # p50 time per output token of the best window (s)
        self.base_ttft: float | None = None  # lowest single TTFT seen (BaseRTT of TCP Vegas)
        self.paid_ttft: float | None = None  # p50 TTFT of slow start's last gain: the batch that paid for it
        self.p50_latency: float | None = None
        self.history: list[tuple[float, int, str]] = [(now, self.limit, "initial")]
        self._new_window(now, settle=False)

    @property
    def limit(self) -> int:
        return int(self._limit)

    # -- observations
    def on_start(self, outstanding: int) -> None:
        """An attempt started; `outstanding` counts it with the others in flight at this endpoint."""
        if outstanding > self._peak:
            self._peak = outstanding

    def on_done(self, now: float, *, latency_s: float | None = None, ttft_s: float | None = None,
                output_tokens: int = 0, error_class: str | None = None, status: int | None = None) -> bool:
        """An attempt ended (error_class None = answered). Returns True when the limit changed."""
        if now < self._settle_until:
            return False
        if error_class == "rate_limited" or status in (429, 503):
            self._overloads += 1
        elif error_class is None:
            self._samples += 1
            self._tokens += output_tokens
            if latency_s is not None:
                self._latencies.append(latency_s)
            if ttft_s is not None:
                self._ttfts.append(ttft_s)
                if latency_s is not None and output_tokens > 1:  # time per output token after the first
                    self._tpots.append((latency_s - ttft_s) / (output_tokens - 1))
        return self._maybe_decide(now)

    def on_gauges(self, now: float, running: float, waiting: float, cache_usage: float | None = None) -> bool:
        """The server's gauges (requests running and waiting, KV-cache usage 0..1). True when the limit changed."""
        if now < self._settle_until:
            return False
        self._gauges.append((running, waiting, cache_usage))
        return self._maybe_decide(now)

    # -- decisions
    def _min_window(self) -> float:
        """Seconds a window lasts at least: one p50 latency (a turnover) in slow start, else also min_window_s."""
        turnover = self.p50_latency or 0.0
        return turnover if self.slow_start else max(self.cfg.min_window_s, turnover)

    def _new_window(self, now: float, settle: bool = True) -> None:
        wait = self._min_window() if settle else 0.0
        self._settle_until = now + wait
        self._t0 = now + wait
        self._samples = self._tokens = self._overloads = 0
        self._peak = 0
        self._latencies: list[float] = []
        self._ttfts: list[float] = []
        self._tpots: list[float] = []
        self._gauges: list[tuple] = []

    def _maybe_decide(self, now: float) -> bool:
        elapsed = now - self._t0
        if self._overloads:
            return self._set(now, self._limit * self.cfg.backoff, "overload (429/503)", hold=True)
        if elapsed < self._min_window():
            return False
        if self._gauges:
            # two readings, or enough answers: min_samples, or in slow start one turnover's (limit)
            enough = self.limit if self.slow_start else self.cfg.min_samples
            if len(self._gauges) >= 2 or self._samples >= enough:
                return self._decide_gauges(now)
            return False
        # slow start may double on one turnover's samples (a doubling's gain is large next to the noise); ending
        # it on "no gain" waits for min_samples (see _decide_climb)
        enough = self.limit if self.slow_start else max(self.cfg.min_samples, self.limit)
        if self._samples < enough or elapsed < (self.p50_latency or 0.0):
            return False
        return self._decide_climb(now, elapsed)

    def _step(self) -> float:
        return max(1.0, self._limit / 8)

    def _binds(self) -> bool:
        return self._peak >= self.limit

    def _decide_gauges(self, now: float) -> bool:
        n = len(self._gauges)
        running = sum(g[0] for g in self._gauges) / n
        waiting = sum(g[1] for g in self._gauges) / n
        caches = [g[2] for g in self._gauges if g[2] is not None]
        cache = max(caches) if caches else 0.0
        target = max(1.0, self.cfg.queue_target * running)
        self._remember_latency()
        if waiting > 2 * target or (cache >= 0.98 and waiting > 0):
            floor = 0.5 if self.slow_start else self.cfg.backoff  # a doubling overshoots by 2x at most
            factor = max(floor, min(0.9, (running + target) / max(1e-9, running + waiting)))
            self.slow_start = False
            return self._set(now, self._limit * factor, f"queue {waiting:.1f} > {2 * target:.1f}")
        if waiting < target / 2 and self._binds():
            up = self._limit * 2 if self.slow_start else self._limit + self._step()
            return self._set(now, up, f"queue {waiting:.1f} empty")
        self.slow_start = False
        return self._set(now, self._limit, "hold")

    def _decide_climb(self, now: float, elapsed: float) -> bool:
        rate = self._tokens / max(1e-9, elapsed)
        ttft, tpot = _median(self._ttfts), _median(self._tpots)
        self._remember_latency()
        if self._ttfts and (self.base_ttft is None or min(self._ttfts) < self.base_ttft):
            self.base_ttft = min(self._ttfts)  # the lowest single TTFT: a request that found a free slot
        if not self._binds():
            return self._set(now, self._limit, "not binding")
        first = self.best_rate is None
        gain = 0.0 if first else rate / self.best_rate - 1
        gained = first or gain >= self.cfg.min_gain
        # a queue is TTFT beyond what the batch that paid cost (the first window has no gain to show: the lowest
        # single TTFT in it)
        ref = self.base_ttft if first else self.paid_ttft
        queued = (ttft is not None and ref is not None and self.p50_latency
                  and ttft > self.cfg.latency_tolerance * ref and ttft - ref > 0.1 * self.p50_latency)
        if queued and gained and not first:
            # latency that bought throughput is batching when decoding slowed too (every request shares the
            # compute); when it did not, the extra requests waited: a queue, and the gain was noise or turnover
            if self._decode_slowed(tpot):
                queued = False
            else:
                gained = False
        if queued and self.limit > self.cfg.min:
            # slow start overshot: down to the requests the server was serving (not below the last limit that
            # paid), else one step down
            down = max(self.best_limit, self._serving(ref)) if self.slow_start else self._limit - self._step()
            self.slow_start = False
            if first:  # the queue holds what the initial limit gained
                self.best_rate, self.best_limit, self.best_tpot, self.paid_ttft = rate, int(down), tpot, ref
            return self._set(now, down, f"ttft {ttft:.3g}s queued", hold=True)
        if gained:
            if self.slow_start or self.paid_ttft is None:  # after slow start, additive steps move it no more
                self.paid_ttft = ttft
            self.best_rate, self.best_limit, self.best_tpot = rate, self.limit, tpot
            up = self._limit * 2 if self.slow_start else self._limit + self._step()
            return self._set(now, up, f"{rate:.0f} tok/s gained")
        if self.slow_start and self._samples < self.cfg.min_samples:
            return False  # too few samples to end slow start on: the window goes on
        if self.limit > self.best_limit:  # the step bought nothing: undo it
            self.slow_start = False
            return self._set(now, self.best_limit, f"{rate:.0f} tok/s no gain", hold=True)
        # at (or below) the best limit: track the server's current rate, probe again after the hold
        self.best_rate, self.best_limit = 0.5 * (self.best_rate + rate), self.limit
        self.best_tpot = tpot or self.best_tpot
        if self.hold > 0:
            self.hold -= 1
            return self._set(now, self._limit, "hold")
        return self._set(now, self._limit + self._step(), "probe")

    def _decode_slowed(self, tpot: float | None) -> bool:
        """Whether the window's p50 time per output token grew by `min_gain` over the best window's: the batch
        grew (every request decodes slower when they share the compute), where a queue only delays first tokens.
        False without a time per token (answers not streamed: TTFT is the latency)."""
        return bool(tpot and self.best_tpot and tpot >= (1 + self.cfg.min_gain) * self.best_tpot)

    def _serving(self, ref: float | None) -> float:
        """Requests the server was serving, by Little's law: the window's limit x the share of a request's time
        not spent queued, 1 - mean(TTFT - ref) / mean latency (the queue holds the rest; ref: the unqueued TTFT)."""
        if not self._ttfts or not self._latencies or ref is None:
            return self._limit - self._step()
        wait = max(0.0, statistics.fmean(self._ttfts) - ref)
        return self._limit * max(0.0, 1 - wait / max(1e-9, statistics.fmean(self._latencies)))

    def _remember_latency(self) -> None:
        p50 = _median(self._latencies)
        if p50 is not None:
            self.p50_latency = p50

    def _set(self, now: float, value: float, reason: str, hold: bool = False) -> bool:
        old = self.limit
        self._limit = min(float(self.cfg.max), max(float(self.cfg.min), value))
        if hold:
            self.hold = HOLD_WINDOWS
        changed = self.limit != old
        if changed:
            self.history.append((now, self.limit, reason))
        self._new_window(now, settle=changed)
        return changed


# Prometheus gauge names: (running, waiting, cache usage 0..1), first family found wins.
# vLLM: docs "Production Metrics" (vllm:gpu_cache_usage_perc before v0.10); SGLang: docs "Production Metrics".
GAUGE_NAMES = (
    ("vllm:num_requests_running", "vllm:num_requests_waiting", ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
    ("sglang:num_running_reqs", "sglang:num_queue_reqs", ("sglang:token_usage",)),
)


def parse_gauges(text: str) -> tuple[float, float, float | None] | None:
    """Prometheus text exposition -> (requests running, requests waiting, KV-cache usage 0..1 or None), each
    summed over label sets (a server may serve several models); None when neither vLLM's nor SGLang's gauges are
    there. Parsed with `prometheus_client.parser` (the reference parser of the format)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    except (ValueError, TypeError):
        return None
    for running, waiting, caches in GAUGE_NAMES:
        if running in values and waiting in values:
            cache = next((values[c] for c in caches if c in values), None)
            return values[running], values[waiting], cache
    return None
