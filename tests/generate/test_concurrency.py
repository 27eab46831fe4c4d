"""`max_in_flight: auto`: the pure controller fed literal observations (its decisions asserted), then closed
loop against a simulated server of N decode slots with a queue beyond."""
from __future__ import annotations

import heapq
import math

import pytest

from regen.config.generate import ConcurrencyConfig, GenerateConfig
from regen.generate.concurrency import ConcurrencyController


def cfg(**kw) -> ConcurrencyConfig:
    base = {"initial": 4, "min": 1, "max": 256, "min_samples": 4, "min_window_s": 1.0}
    return ConcurrencyConfig(**{**base, **kw})


def window(ctl: ConcurrencyController, t: float, *, tokens_per_s: float, ttft: float = 0.01, latency: float = 0.5,
           n: int | None = None, binding: bool = True, tokens: int | None = None) -> float:
    """Feed one full window of completions starting at t (after the settle time); returns the end time. With
    `tokens`, every answer has that many and the window holds as many answers as the rate delivers."""
    t = max(t, ctl._settle_until)
    n = n or max(ctl.cfg.min_samples, ctl.limit)
    duration = max(ctl.cfg.min_window_s, latency) * 1.01
    if tokens:
        n = max(n, math.ceil(tokens_per_s * duration / tokens))
        duration = n * tokens / tokens_per_s
    ctl.on_start(ctl.limit if binding else max(0, ctl.limit - 2))
    for i in range(n):
        ctl.on_done(t + duration * (i + 1) / n, latency_s=latency, ttft_s=ttft,
                    output_tokens=tokens or round(tokens_per_s * duration / n))
    return t + duration


def test_slow_start_doubles_while_throughput_grows_and_undoes_a_step_that_did_not_pay():
    ctl = ConcurrencyController(cfg(), now=0.0)
    t = 0.0
    limits = [ctl.limit]
    for rate in (100, 200, 400):  # rate proportional to the limit: keep doubling
        t = window(ctl, t, tokens_per_s=rate)
        limits.append(ctl.limit)
    assert limits == [4, 8, 16, 32]
    t = window(ctl, t, tokens_per_s=410)  # 32 in flight gave nothing over 16: back to 16, slow start over
    assert ctl.limit == 16 and not ctl.slow_start
    assert ctl.history[-1][1] == 16 and ctl.history[-1][2].endswith("no gain")
    for _ in range(3):  # held at 16 for HOLD_WINDOWS windows ...
        t = window(ctl, t, tokens_per_s=400)
        assert ctl.limit == 16
    t = window(ctl, t, tokens_per_s=400)  # ... then probed by +limit/8
    assert ctl.limit == 18


def feed(ctl: ConcurrencyController, t: float, seconds: float, n: int, *, tokens: int = 10, ttft: float = 0.01,
         latency: float = 0.5) -> float:
    """n completions spread over `seconds` from t, with the limit binding; returns the end time."""
    ctl.on_start(ctl.limit)
    for i in range(n):
        ctl.on_done(t + seconds * (i + 1) / n, latency_s=latency, ttft_s=ttft, output_tokens=tokens)
    return t + seconds


def test_slow_start_windows_last_one_turnover_then_min_window_s_applies():
    ctl = ConcurrencyController(cfg(min_window_s=5.0), now=0.0)
    feed(ctl, 0.0, 0.6, 8, tokens=10)  # the first window: no latency known yet, enough samples decide
    changed_at = ctl.history[-1][0]
    assert ctl.limit == 8 and ctl._settle_until == pytest.approx(changed_at + 0.5)  # one p50 latency, not 5 s
    feed(ctl, ctl._settle_until, 0.6, 16, tokens=20)  # a 0.6 s window (> p50 0.5 s) decides in slow start
    assert ctl.limit == 16
    feed(ctl, ctl._settle_until, 0.6, 16, tokens=20)  # 16 in flight gave nothing over 8: undo, slow start over
    assert ctl.limit == 8 and not ctl.slow_start
    assert ctl._settle_until == pytest.approx(ctl.history[-1][0] + 5.0)
    hist = len(ctl.history)
    feed(ctl, ctl._settle_until, 4.0, 64, tokens=50)  # past slow start a window lasts min_window_s: no decision
    assert len(ctl.history) == hist and ctl.limit == 8


def test_slow_start_doubles_on_one_turnover_but_ends_only_on_min_samples():
    ctl = ConcurrencyController(cfg(initial=4, min_samples=16, min_window_s=0.1), now=0.0)
    feed(ctl, 0.0, 0.5, 4, tokens=50)  # 4 answers (one turnover at limit 4, fewer than min_samples) decide
    assert ctl.limit == 8
    feed(ctl, ctl._settle_until, 0.5, 8, tokens=50)  # 800 tok/s vs 400: gained, doubled on 8 answers
    assert ctl.limit == 16
    ctl = ConcurrencyController(cfg(initial=4, min_samples=16, min_window_s=0.1), now=0.0)
    feed(ctl, 0.0, 0.5, 4, tokens=50)
    t = feed(ctl, ctl._settle_until, 0.5, 8, tokens=26)  # 416 tok/s vs 400: no gain on 8 < 16 answers: wait
    assert ctl.limit == 8 and ctl.slow_start
    feed(ctl, t, 0.5, 8, tokens=26)  # 16 answers, still no gain: slow start ends, back to 4
    assert ctl.limit == 4 and not ctl.slow_start and ctl.history[-1][2].endswith("no gain")


@pytest.mark.parametrize("ttft,expected", [(0.26, 24), (0.185, 26), (0.9, 16)])
def test_a_queue_that_ends_slow_start_goes_down_to_what_the_server_was_serving(ttft, expected):
    ctl = ConcurrencyController(cfg(initial=16), now=0.0)
    t = window(ctl, 0.0, tokens_per_s=400, ttft=0.01, latency=1.0)  # base TTFT 0.01 s; 16 paid: doubled
    assert ctl.limit == 32 and ctl.slow_start
    # at 32 no gain, and the mean TTFT holds (ttft - 0.01) s of queue in a 1 s request: 32 x (1 - wait) were
    # being served, never below 16, the last limit that paid
    window(ctl, t, tokens_per_s=410, ttft=ttft, latency=1.0)
    assert ctl.limit == expected and not ctl.slow_start and "queued" in ctl.history[-1][2]


def test_gauge_mode_slow_start_decides_on_one_reading_and_one_turnover():
    ctl = ConcurrencyController(cfg(initial=8, min_samples=16, min_window_s=0.1), now=0.0)
    ctl.on_gauges(0.05, 8, 0, None)  # one reading: an empty queue
    feed(ctl, 0.0, 0.5, 8)  # 8 answers (one turnover, < min_samples) while the limit binds: doubled
    assert ctl.limit == 16 and ctl.history[-1][2].startswith("queue 0.0")
    ctl = ConcurrencyController(cfg(initial=8, min_samples=16, min_window_s=0.1), now=0.0)
    ctl.slow_start = False
    ctl.on_gauges(0.05, 8, 0, None)
    feed(ctl, 0.0, 0.5, 8)  # past slow start one reading and 8 answers decide nothing
    assert ctl.limit == 8 and len(ctl.history) == 1


def test_a_queue_that_ends_slow_start_in_gauge_mode_may_halve():
    ctl = ConcurrencyController(cfg(initial=64, queue_target=0.05), now=0.0)
    gauges(ctl, 0.0, running=32, waiting=32)  # (32 + 1.6) / 64 = 0.525: below backoff 0.7, allowed in slow start
    assert ctl.limit == int(64 * 0.525) and not ctl.slow_start
    ctl = ConcurrencyController(cfg(initial=64, queue_target=0.05), now=0.0)
    ctl.slow_start = False
    gauges(ctl, 0.0, running=32, waiting=32)  # past slow start the backoff bounds one step
    assert ctl.limit == int(64 * 0.7)


def test_additive_probe_kept_when_it_pays():
    ctl = ConcurrencyController(cfg(initial=16), now=0.0)
    ctl.slow_start = False
    t = window(ctl, 0.0, tokens_per_s=1000)
    assert ctl.limit == 18
    t = window(ctl, t, tokens_per_s=1100)  # +10% >= min_gain 5%: keep climbing
    assert ctl.limit == 20
    t = window(ctl, t, tokens_per_s=1120)  # +1.8%: undo to 18
    assert ctl.limit == 18


@pytest.mark.parametrize("how", [{"error_class": "rate_limited"}, {"error_class": "server_error", "status": 503},
                                 {"error_class": "connection", "status": 429}])
def test_429_and_503_back_off_multiplicatively_at_once(how):
    ctl = ConcurrencyController(cfg(initial=40), now=0.0)
    changed = ctl.on_done(0.1, **how)  # no need to wait for the window
    assert changed and ctl.limit == 28  # 40 x 0.7
    assert ctl.history[-1] == (0.1, 28, "overload (429/503)")
    assert ctl.hold == 3


def test_other_failures_do_not_back_off():
    ctl = ConcurrencyController(cfg(initial=40), now=0.0)
    for k in ("timeout", "connection", "bad_request"):
        assert not ctl.on_done(0.1, error_class=k, status=500 if k == "connection" else None)
    assert ctl.limit == 40


def test_never_below_min_nor_above_max():
    ctl = ConcurrencyController(cfg(initial=2, min=2, max=5), now=0.0)
    for i in range(5):
        ctl.on_done(10.0 * i + ctl._settle_until, error_class="rate_limited")
    assert ctl.limit == 2
    ctl = ConcurrencyController(cfg(initial=4, max=5), now=0.0)
    t = 0.0
    for rate in (100, 200, 400, 800):
        t = window(ctl, t, tokens_per_s=rate)
    assert ctl.limit == 5


def test_a_limit_that_never_binds_does_not_grow():
    ctl = ConcurrencyController(cfg(initial=8), now=0.0)
    t = 0.0
    for rate in (100, 200, 400):
        t = window(ctl, t, tokens_per_s=rate, binding=False)
    assert ctl.limit == 8 and ctl.history == [(0.0, 8, "initial")]


def test_rising_time_to_first_token_steps_down():
    ctl = ConcurrencyController(cfg(initial=32), now=0.0)
    ctl.slow_start = False
    t = window(ctl, 0.0, tokens_per_s=1000, ttft=0.02, latency=1.0)  # base TTFT 0.02 s
    limit = ctl.limit
    window(ctl, t, tokens_per_s=1000, ttft=0.4, latency=1.4)  # 20x base and 0.38 s > 10% of p50 latency
    assert ctl.limit == int(limit - max(1, limit / 8))
    assert "queued" in ctl.history[-1][2]


def test_ttft_jitter_below_a_tenth_of_the_latency_is_not_a_queue():
    ctl = ConcurrencyController(cfg(initial=32), now=0.0)
    ctl.slow_start = False
    t = window(ctl, 0.0, tokens_per_s=1000, ttft=0.002, latency=1.0)
    limit = ctl.limit
    window(ctl, t, tokens_per_s=1000, ttft=0.02, latency=1.0)  # 10x, but 18 ms of a 1 s request
    assert "queued" not in ctl.history[-1][2] and ctl.limit <= limit


# ---------------------------------------------------------------- synthetic servers: one window per decision


def batching_server(c: int, cap: int = 32, tokens: int = 128) -> tuple[float, float, float, int]:
    """A CPU-bound continuous-batching server (after the embedded target, transformers serve on 2 cores): a decode
    step of the batch takes 48 ms + 3 ms x batch, every request sharing the compute; newcomers' prompts are
    prefilled one after another between steps (0.1 s each at batch 1, slower as the batch grows), so TTFT grows
    faster than the batch; at most `cap` in the batch, a queue beyond. Tokens/s grows sublinearly to a plateau at
    `cap`. Returns (output tokens/s, TTFT s, latency s, tokens per answer) with c requests in flight (closed loop:
    Little's law)."""
    b = min(c, cap)
    step = 0.048 + 0.003 * b
    decode = tokens * step
    latency = (0.1 * b * step / 0.051 + decode) * c / b
    return c * tokens / latency, latency - decode, latency, tokens


def slots_server(c: int, slots: int = 32, tokens: int = 96) -> tuple[float, float, float, int]:
    """The test server's capacity model (`regen.testing.capacity`, as `bench/saturate.py` runs it): `slots` decode
    slots at 4 ms x (1 + running / slots) per token after a 5 ms prefill, a FIFO queue beyond."""
    b = min(c, slots)
    service = 0.005 + tokens * 0.004 * (1 + b / slots)
    latency = service * c / b
    return c * tokens / latency, latency - service + 0.005, latency, tokens


def drive(ctl: ConcurrencyController, server, num_windows: int, t: float = 0.0) -> tuple[float, list[int]]:
    """One window per decision at the server's figures for the current limit; returns (end time, limits after each)."""
    limits = []
    for _ in range(num_windows):
        rate, ttft, latency, tokens = server(ctl.limit)
        t = window(ctl, t, tokens_per_s=rate, ttft=ttft, latency=latency, tokens=tokens)
        limits.append(ctl.limit)
    return t, limits


def test_a_batching_server_whose_ttft_grows_with_the_batch_is_climbed_to_its_plateau():
    best = max(batching_server(c)[0] for c in range(1, 129))
    ctl = ConcurrencyController(cfg(initial=2, max=128, min_samples=8, min_window_s=5.0), now=0.0)
    _, limits = drive(ctl, batching_server, 40)
    # each doubling more than doubles TTFT (16 -> 32: 3.0 s -> 9.0 s) but gains tokens/s: not a queue, slow start
    # goes on to 64, where the queue beyond the batch gains nothing and Little's law brings it back to 32
    assert [h[1] for h in ctl.history[:7]] == [2, 4, 8, 16, 32, 64, 32], ctl.history
    assert "queued" in ctl.history[6][2]
    tail = limits[-20:]  # the best region of the plateau (within 5% of its tokens/s), not half of it nor the queue
    assert all(batching_server(c)[0] >= 0.95 * best for c in tail), ctl.history
    assert max(tail) <= 40 and min(tail) >= 20, ctl.history


def test_a_server_with_a_queue_beyond_its_slots_stops_near_them_and_backs_off_a_queue_without_gain():
    ctl = ConcurrencyController(cfg(initial=4, min_samples=16), now=0.0)
    t, limits = drive(ctl, slots_server, 40)
    assert [h[1] for h in ctl.history[:6]] == [4, 8, 16, 32, 64, 32], ctl.history  # 64: all queue, Little's law
    assert all(30 <= c <= 36 for c in limits[-20:]), ctl.history  # at the slots, never a queue of more than 4
    # half the slots go to another job: TTFT grows, tokens/s does not: a queue, stepped down to the 16 left
    num_changes = len(ctl.history)
    _, limits = drive(ctl, lambda c: slots_server(c, slots=16), 30, t)
    assert "queued" in ctl.history[num_changes][2] and ctl.history[num_changes][1] < limits[0] + 4
    assert all(14 <= c <= 20 for c in limits[-10:]), ctl.history


@pytest.mark.parametrize("server", ["batching", "queue", "unstreamed"])
def test_a_gain_with_a_queue_is_batching_only_when_decoding_slowed_too(server):
    ctl = ConcurrencyController(cfg(initial=16), now=0.0)
    first_token = 1.0 if server == "unstreamed" else 0.01  # unstreamed: the first token comes with the answer
    t = window(ctl, 0.0, tokens_per_s=400, ttft=first_token, latency=1.0, tokens=25)  # 41 ms per token
    assert ctl.limit == 32
    # +25% tokens/s with half of the latency before the first token (50x the TTFT that paid)
    if server == "batching":  # and every request decodes 17% slower: the batch grew, no queue: doubled
        window(ctl, t, tokens_per_s=500, ttft=0.5, latency=2.0, tokens=32)
        assert ctl.limit == 64 and ctl.slow_start and ctl.paid_ttft == 0.5
    elif server == "queue":  # decoding no slower (33 ms): the extra requests waited, the gain is the turnover
        window(ctl, t, tokens_per_s=500, ttft=0.5, latency=1.0, tokens=16)
        assert ctl.limit == 16 and "queued" in ctl.history[-1][2] and not ctl.slow_start
    else:  # no time per token to tell: the latency guard as before
        window(ctl, t, tokens_per_s=500, ttft=2.5, latency=2.5, tokens=32)
        assert ctl.limit == 16 and "queued" in ctl.history[-1][2] and not ctl.slow_start


def gauges(ctl, t, running, waiting, cache=None):
    """Two readings 0.6 s apart: the window (min_window_s 1) decides at the second."""
    t = max(t, ctl._settle_until)
    ctl.on_start(ctl.limit)
    for i in range(2):
        ctl.on_gauges(t + 0.6 * (i + 1), running, waiting, cache)
    return t + 1.2


def test_gauges_keep_the_queue_short_but_not_empty():
    ctl = ConcurrencyController(cfg(initial=8, queue_target=0.05), now=0.0)
    t = gauges(ctl, 0.0, running=8, waiting=0)  # slow start: doubles while the queue is empty
    t = gauges(ctl, t, running=16, waiting=0)
    assert ctl.limit == 32
    t = gauges(ctl, t, running=32, waiting=2)  # a first queue (q* = 1.6, hold band): slow start ends
    assert ctl.limit == 32 and not ctl.slow_start
    ctl = ConcurrencyController(cfg(initial=64, queue_target=0.05), now=0.0)
    ctl.slow_start = False
    t = gauges(ctl, 0.0, running=64, waiting=0)  # queue empty: grow by limit/8
    assert ctl.limit == 72
    t = gauges(ctl, t, running=64, waiting=3)  # q* = 3.2: between q*/2 and 2q*: hold
    assert ctl.limit == 72
    t = gauges(ctl, t, running=64, waiting=40)  # far too long: scale by (64 + 3.2) / (64 + 40) = 0.646 -> 0.7 floor
    assert ctl.limit == int(72 * 0.7)
    t = gauges(ctl, t, running=64, waiting=8)  # (64 + 3.2) / 72 = 0.933 -> at most 0.9
    assert ctl.limit == int(int(72 * 0.7) * 0.9)
    t = gauges(ctl, t, running=40, waiting=5)  # q* = 1 (floor): 5 > 2 -> (40 + 1) / 45 = 0.911 -> 0.9
    assert ctl.limit == int(int(int(72 * 0.7) * 0.9) * 0.9)


def test_a_full_kv_cache_with_a_queue_backs_off_and_gauges_idle_limit_does_not_grow():
    ctl = ConcurrencyController(cfg(initial=64), now=0.0)
    gauges(ctl, 0.0, running=60, waiting=2, cache=0.99)  # the queue is short but the cache is full
    assert ctl.limit == int(64 * 0.9)
    ctl = ConcurrencyController(cfg(initial=64), now=0.0)
    t = max(0.0, ctl._settle_until)
    ctl.on_start(10)  # the client never used more than 10 of 64
    for i in range(3):
        ctl.on_gauges(t + i, 10, 0, 0.1)
    assert ctl.limit == 64


def test_config_bounds_and_auto_value():
    assert GenerateConfig(max_in_flight="auto").in_flight_cap(8) == 8 * 1024
    assert GenerateConfig(max_in_flight=12).in_flight_cap(8) == 12
    for bad in ({"initial": 0}, {"min": 8, "initial": 4}, {"initial": 9, "max": 8}, {"backoff": 1.0}):
        with pytest.raises(ValueError, match="concurrency"):
            ConcurrencyConfig(**bad)
    with pytest.raises(ValueError):
        GenerateConfig(max_in_flight="many")


# ---------------------------------------------------------------- closed loop on a simulated server


def simulate(slots: int, limit_of, seconds: float = 300.0, tokens: int = 100, itl_s: float = 0.01,
             load_factor: float = 1.0, gauges_every: float | None = None, ctl: ConcurrencyController | None = None):
    """Event simulation: a client keeping `limit_of()` requests outstanding against a server of `slots` decode
    slots (FIFO queue beyond); a request's service time is tokens x itl_s x (1 + load_factor x running/slots).
    Returns (output tokens/s, p50 latency) over the second half."""
    t, seq = 0.0, 0
    events: list = []  # (time, seq, kind, request)
    queue: list = []
    running = 0
    outstanding = 0
    done: list[tuple[float, float]] = []  # (end, latency)

    def admit(now):
        nonlocal running, seq
        while queue and running < slots:
            start = queue.pop(0)
            running += 1
            service = tokens * itl_s * (1 + load_factor * running / slots)
            seq += 1
            heapq.heappush(events, (now + service, seq, "end", (start, now)))

    def fill(now):
        nonlocal outstanding
        while outstanding < limit_of():
            outstanding += 1
            if ctl:
                ctl.on_start(outstanding)
            queue.append(now)
        admit(now)

    if gauges_every:
        heapq.heappush(events, (gauges_every, -1, "gauges", None))
    fill(0.0)
    while events:
        t, _, kind, req = heapq.heappop(events)
        if t > seconds:
            break
        if kind == "gauges":
            ctl.on_gauges(t, running, len(queue), None)
            heapq.heappush(events, (t + gauges_every, -1, "gauges", None))
        else:
            start, admitted = req
            running -= 1
            outstanding -= 1
            done.append((t, t - start))
            if ctl:
                ctl.on_done(t, latency_s=t - start, ttft_s=admitted - start + 0.001, output_tokens=tokens)
            admit(t)
        fill(t)
    half = [d for d in done if d[0] >= seconds / 2]
    lat = sorted(d[1] for d in half)
    return len(half) * tokens / (seconds / 2), lat[len(lat) // 2]


@pytest.mark.parametrize("slots", [12, 48])
@pytest.mark.parametrize("with_gauges", [False, True])
def test_auto_reaches_the_best_fixed_concurrency_on_a_simulated_server(slots, with_gauges):
    fixed = {c: simulate(slots, lambda c=c: c) for c in (4, 8, 16, 32, 64, 128)}
    best_c = max(fixed, key=lambda c: fixed[c][0])
    best_rate, best_p50 = fixed[best_c]
    ctl = ConcurrencyController(cfg(initial=4, min_samples=16), now=0.0)
    rate, p50 = simulate(slots, lambda: ctl.limit, gauges_every=0.5 if with_gauges else None, ctl=ctl)
    assert rate >= 0.95 * best_rate, (rate, best_rate, ctl.history)
    assert p50 <= 1.5 * best_p50, (p50, best_p50, ctl.history)
    assert slots <= ctl.limit <= 1.5 * slots + 2, ctl.history
