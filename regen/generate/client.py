"""The async transport: one aiohttp session per process, a pool of endpoints, timeouts, backoff, cooldown.

`ChatClient.complete(body)` sends ONE attempt of an OpenAI `/v1/chat/completions` request and returns a
`regen.generate.checks.Completion` or raises `regen.generate.checks.RequestFailure` with a class decided by exception type and
HTTP status (what the answer's bytes mean, 200 or not: `regen.generate.wire`). Retrying is the caller's job
(`regen.generate.stage`), with `backoff_delay`.

* In flight: at most `max_in_flight` attempts at once (a semaphore); the pool routes each to the healthy
  endpoint with the fewest outstanding requests (least-outstanding-requests).
* Health: `fail_threshold` consecutive transport failures take an endpoint out; a probe of
  `GET {base}/models` every `interval_s` puts it back when it answers below 500.
* 429: the endpoint cools down for Retry-After (or the backoff base) and its concurrency limit halves
  (once per cooldown window); each success raises the limit by one (it doubles per round trip, as TCP slow
  start) until it passes `max_in_flight` and is removed. A storm of 429s drains instead of being hammered.
* No endpoint available: an attempt waits while some endpoint is healthy (cooling down or at its limit);
  when none is healthy for `max_wait_s`, it fails as `connection` (and is retried by the caller).
* Each attempt carries the header `X-Regen-Request-Key: <request key>` so server logs can be joined with rows.
* Timeouts (seconds): connect; first byte (sending -> first body chunk); between stream chunks (the
  first-byte deadline is moved forward at most once a second, so the cost per chunk stays flat); total.

aiohttp was chosen over httpx / the openai SDK by measurement (`bench/generate.py`): its raw `iter_any()` reads
plus our own line splitter and orjson cost a fraction of the CPU per streamed token.
"""
from __future__ import annotations

import asyncio
import collections
import random
import time

import aiohttp

from regen.config.generate import ConcurrencyConfig, HealthConfig, RetryConfig, TimeoutConfig
from regen.generate.checks import Completion, RequestFailure, classify_status
from regen.generate.concurrency import ConcurrencyController, parse_gauges
from regen.generate.wire import dumps, http_failure, normalize, parse_body, parse_retry_after, read_stream  # noqa: F401


def backoff_delay(attempt: int, cfg: RetryConfig, retry_after_s: float | None = None) -> float:
    """Seconds to wait before attempt `attempt + 1` (attempt >= 1): min(max_s, base_s * 2**(attempt-1))
    times U(0.5, 1) ("equal jitter", AWS architecture blog, 2015), and never less than the server's
    Retry-After (capped at max_retry_after_s; times U(1, 1.5) so retries spread out)."""
    delay = min(cfg.max_s, cfg.base_s * 2 ** max(0, attempt - 1)) * random.uniform(0.5, 1.0)
    if retry_after_s is not None:  # spread over [1, 1.5] x Retry-After, so retries do not arrive in lockstep
        delay = max(delay, min(retry_after_s, cfg.max_retry_after_s) * random.uniform(1.0, 1.5))
    return delay


def redact_url(url: str) -> str:
    """A URL without credentials (`user:password@` and the query string dropped), fit for rows and logs."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


class Endpoint:
    """One base URL (`http://host:port/v1`) with its routing state; `name` is the URL without credentials."""

    def __init__(self, base_url: str):
        self.base_url = base_url.rstrip("/")
        self.name = redact_url(self.base_url)
        self.url = self.base_url + "/chat/completions"
        self.outstanding = 0
        self.healthy = True
        self.fails = 0
        self.cooldown_until = 0.0
        self.limit: float | None = None  # AIMD concurrency cap after 429s; None = uncapped
        self.num_requests = 0
        self.num_failures = 0
        self.num_429 = 0
        self.controller: ConcurrencyController | None = None  # max_in_flight: auto

    def available(self, now: float) -> bool:
        return (self.healthy and now >= self.cooldown_until and (self.limit is None or self.outstanding < self.limit)
                and (self.controller is None or self.outstanding < self.controller.limit))

    def summary(self) -> dict:
        return {"endpoint": self.name, "healthy": self.healthy, "requests": self.num_requests,
                "failures": self.num_failures, "rate_limited": self.num_429}


class EndpointPool:
    """Least-outstanding-requests routing over healthy, not cooling-down endpoints."""

    def __init__(self, base_urls: list[str], health: HealthConfig, max_in_flight: int, base_cooldown_s: float = 1.0):
        if not base_urls:
            raise ValueError("EndpointPool needs at least one endpoint")
        self.endpoints = [Endpoint(u) for u in base_urls]
        self.health = health
        self.max_in_flight = max_in_flight
        self.base_cooldown_s = base_cooldown_s
        self._waiters: collections.deque[asyncio.Future] = collections.deque()  # FIFO: fair

    def _pick(self, now: float) -> Endpoint | None:
        best = None
        for ep in self.endpoints:
            if ep.available(now) and (best is None or ep.outstanding < best.outstanding):
                best = ep
        return best

    def _wake(self, n: int = 1) -> None:
        while n > 0 and self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                n -= 1

    async def acquire(self, max_wait_s: float) -> Endpoint:
        """The endpoint for the next attempt (its `outstanding` incremented). Waits while none is available;
        raises RequestFailure("connection") after `max_wait_s` without one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max_wait_s
        while True:
            now = loop.time()
            ep = self._pick(now)
            if ep is not None:
                ep.outstanding += 1
                ep.num_requests += 1
                if ep.controller is not None:
                    ep.controller.on_start(ep.outstanding)
                return ep
            if any(e.healthy for e in self.endpoints):
                deadline = now + max_wait_s  # cooling down or at its limit: wait, the endpoint is alive
            elif now >= deadline:
                raise RequestFailure("connection", "no healthy endpoint available")
            cooling = [e.cooldown_until for e in self.endpoints if e.healthy and e.cooldown_until > now]
            wait = min(cooling) - now + random.uniform(0, 0.5) if cooling else self.health.interval_s
            fut = loop.create_future()
            self._waiters.append(fut)
            try:
                await asyncio.wait_for(fut, max(0.01, min(wait, deadline - now)))
            except TimeoutError:
                pass

    def release(self, ep: Endpoint, error_class: str | None, retry_after_s: float | None = None) -> None:
        """Account the outcome of one attempt: None = success, else its error class."""
        ep.outstanding -= 1
        now = asyncio.get_running_loop().time()
        if error_class is None or error_class in ("bad_request", "context_overflow", "malformed"):
            ep.fails = 0  # the server answered
            if ep.limit is not None and error_class is None:
                ep.limit += 1.0  # +1 per success: the limit doubles per round trip (TCP slow start)
                if ep.limit >= self.max_in_flight:
                    ep.limit = None
        elif error_class == "rate_limited":
            ep.num_429 += 1
            cool = retry_after_s if retry_after_s is not None else self.base_cooldown_s
            if now >= ep.cooldown_until:  # halve once per cooldown window
                ep.limit = max(1.0, min(ep.limit or float("inf"), ep.outstanding + 1) / 2)
            ep.cooldown_until = max(ep.cooldown_until, now + cool)
        else:
            ep.num_failures += 1
            ep.fails += 1
            if ep.fails >= self.health.fail_threshold and ep.healthy:
                ep.healthy = False
        self._wake(1)

    def mark_healthy(self, ep: Endpoint) -> None:
        ep.healthy, ep.fails = True, 0
        self._wake(len(self._waiters))

    @property
    def outstanding(self) -> int:
        return sum(e.outstanding for e in self.endpoints)


class ChatClient:
    """One per process. Use as `async with ChatClient(...) as client: c = await client.complete(body)`.

    `api_key` goes only into the Authorization header; it is never logged nor put in any exception.
    """

    def __init__(self, endpoints: list[str], *, max_in_flight: int = 4096, timeouts: TimeoutConfig | None = None,
                 health: HealthConfig | None = None, api_key: str | None = None, max_wait_s: float | None = None,
                 base_cooldown_s: float = 1.0, auto: ConcurrencyConfig | None = None):
        """`auto`: adapt each endpoint's in-flight limit (`regen.generate.concurrency`) under `max_in_flight`."""
        self.timeouts = timeouts or TimeoutConfig()
        self.health = health or HealthConfig()
        self.pool = EndpointPool(endpoints, self.health, max_in_flight, base_cooldown_s)
        self.auto = auto
        if auto is not None:
            for ep in self.pool.endpoints:
                ep.controller = ConcurrencyController(auto, time.monotonic())
        self.max_in_flight = max_in_flight
        self.max_wait_s = max_wait_s if max_wait_s is not None else max(60.0, 4 * self.health.interval_s)
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._sem = asyncio.Semaphore(max_in_flight)
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None
        self.in_flight = 0
        self.peak_in_flight = 0

    async def __aenter__(self) -> "ChatClient":
        connector = aiohttp.TCPConnector(limit=self.max_in_flight + 8, limit_per_host=0, enable_cleanup_closed=True)
        timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=self.timeouts.connect, sock_read=None)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=True)
        self._health_task = asyncio.create_task(self._health_loop())
        self._gauge_task = None
        if self.auto is not None and self.auto.metrics == "auto":
            self._gauge_task = asyncio.create_task(self._gauge_loop())
        return self

    async def __aexit__(self, *exc) -> None:
        if getattr(self, "_gauge_task", None):
            self._gauge_task.cancel()
        if self._health_task:
            self._health_task.cancel()
            try:
                await self._health_task
            except (asyncio.CancelledError, Exception):
                pass
        if self._session:
            await self._session.close()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health.interval_s)
            for ep in self.pool.endpoints:
                if not ep.healthy and await self.probe(ep):
                    self.pool.mark_healthy(ep)

    async def _gauge_loop(self) -> None:
        """max_in_flight auto: poll each endpoint's Prometheus `/metrics` (next to `/v1`) every metrics_poll_s and
        feed its queue and cache gauges to the endpoint's controller; an endpoint without them (3 misses in a
        row, e.g. 404) is not asked again."""
        misses = {ep.name: 0 for ep in self.pool.endpoints}
        while True:
            await asyncio.sleep(self.auto.metrics_poll_s)
            for ep in self.pool.endpoints:
                if misses[ep.name] >= 3:
                    continue
                url = ep.base_url.removesuffix("/v1") + "/metrics"
                gauges = None
                try:
                    async with asyncio.timeout(self.health.probe_timeout_s):
                        async with self._session.get(url, headers=self._headers) as resp:
                            if resp.status == 200:
                                gauges = parse_gauges(await resp.text())
                except (aiohttp.ClientError, OSError, TimeoutError, UnicodeDecodeError):
                    pass
                if gauges is None:
                    misses[ep.name] += 1
                    continue
                misses[ep.name] = 0
                self._limit_moved(ep, ep.controller.on_gauges(time.monotonic(), *gauges))

    def _limit_moved(self, ep: Endpoint, changed: bool) -> None:
        if changed:
            self.pool._wake(len(self.pool._waiters))  # a raised limit admits waiters at once

    def _observe(self, ep: Endpoint, c: Completion | None, error_class: str | None, status: int | None) -> None:
        """Feed one finished attempt to the endpoint's controller (max_in_flight: auto)."""
        if c is None and error_class is None:
            return  # cancelled: no observation
        if c is not None:
            changed = ep.controller.on_done(time.monotonic(), latency_s=c.latency_s, ttft_s=c.ttft_s,
                                            output_tokens=c.num_completion_tokens or c.num_chunks)
        else:
            changed = ep.controller.on_done(time.monotonic(), error_class=error_class, status=status)
        self._limit_moved(ep, changed)

    def limits(self) -> dict[str, int] | None:
        """Current in-flight limit per endpoint name (auto), else None."""
        if self.auto is None:
            return None
        return {ep.name: ep.controller.limit for ep in self.pool.endpoints}

    def limit_history(self) -> dict[str, list] | None:
        """(t_s since the client started, limit, reason) per endpoint name at every change (auto), else None."""
        if self.auto is None:
            return None
        out = {}
        for ep in self.pool.endpoints:
            t0 = ep.controller.history[0][0]
            out[ep.name] = [(round(t - t0, 3), lim, why) for t, lim, why in ep.controller.history]
        return out

    async def probe(self, ep: Endpoint) -> bool:
        """`GET {base}/models` answered below 500 within probe_timeout_s."""
        try:
            async with asyncio.timeout(self.health.probe_timeout_s):
                async with self._session.get(ep.base_url + "/models", headers=self._headers) as resp:
                    await resp.read()
                    return resp.status < 500
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    async def complete(self, body: dict, *, request_key: str | None = None) -> Completion:
        """Send one attempt of `body` (an OpenAI chat-completions request; `stream` decides the mode).

        Returns a Completion (quality not yet checked); raises RequestFailure on transport or HTTP errors.
        """
        payload = dumps(body)
        headers = self._headers if request_key is None else {**self._headers, "X-Regen-Request-Key": request_key}
        async with self._sem:
            ep = await self.pool.acquire(self.max_wait_s)
            self.in_flight += 1
            if self.in_flight > self.peak_in_flight:
                self.peak_in_flight = self.in_flight
            error_class, retry_after, c, status = None, None, None, None
            try:
                c = await self._attempt(ep, payload, headers, bool(body.get("stream")))
                return c
            except RequestFailure as exc:
                error_class, retry_after, status = exc.error_class, exc.retry_after_s, exc.status
                raise
            finally:
                self.in_flight -= 1
                self.pool.release(ep, error_class, retry_after)
                if ep.controller is not None:
                    self._observe(ep, c, error_class, status)

    async def _attempt(self, ep: Endpoint, payload: bytes, headers: dict, stream: bool) -> Completion:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        phase = "first_byte"
        try:
            async with asyncio.timeout(self.timeouts.total) as total_cm:
                async with asyncio.timeout(self.timeouts.first_byte) as cm:
                    async with self._session.post(ep.url, data=payload, headers=headers) as resp:
                        if resp.status != 200:
                            raise await http_failure(resp)
                        if stream:
                            phase = "between_chunks"
                            c = await read_stream(resp, cm, t0, self.timeouts.between_chunks)
                        else:
                            c = parse_body(await resp.read())
                            c.ttft_s = loop.time() - t0
        except RequestFailure:
            raise
        except TimeoutError as exc:
            which = "total" if total_cm.expired() else phase
            raise RequestFailure("timeout", f"{which} timeout at {ep.name}") from exc
        except aiohttp.ClientResponseError as exc:
            raise RequestFailure(classify_status(exc.status), f"HTTP {exc.status} at {ep.name}", exc.status) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise RequestFailure("connection", f"{type(exc).__name__} at {ep.name}") from exc
        c.latency_s = loop.time() - t0
        c.endpoint = ep.name
        return normalize(c)
