"""A real OpenAI-compatible chat-completions server on loopback that answers deterministically and injects
faults on command: the counterpart of `regen.generate.client` in tests and benchmarks.

    python -m regen.testing.openai_server --host 127.0.0.1 --port 0 [--log-file F] [--faults '{"429": 0.1}']

prints `listening on http://HOST:PORT/v1` once ready. Endpoints:

    POST /v1/chat/completions   streamed (SSE) or not; answers derive from sha256 of the request (messages,
                                model, tools, sampling; not `stream`), so the same request gets the same answer
    GET  /v1/models, /health    503 while `down`
    GET  /metrics               Prometheus gauges of the capacity model when `metrics` is "vllm" or "sglang", else 404
    GET  /_log                  received requests: seq, key (X-Regen-Request-Key), body_sha, stream, fault,
                                status, and the body when log_bodies (never headers: no API key is logged)
    POST /_log/clear            empty the log
    GET  /_timings              when `timings`: [key, received_t, ended_t] per chat request (unix seconds; the end
                                is when the handler returned or was cancelled by a dropped connection)
    POST /_control              merge settings (JSON object), e.g. {"faults": {"429": 0.2}, "down": true}
    GET  /_control              current settings

Faults (`Settings.faults`: kind -> probability per request, drawn with a seeded RNG; or forced for one request
by the header `X-Fault: kind`, or by `[[fault:kind]]` in the last user message, every attempt): the HTTP errors,
answer faults, errors inside a 200 and streamed tool-call shapes of `regen.testing.wire_faults` (its module doc
lists each with the public report it reproduces), and stall (no answer for stall_s), stall_stream (some chunks,
then silence), close (connection closed mid-body or mid-stream), malformed (body / SSE event not JSON), empty (200
with empty body / stream with only [DONE]). `Settings.error_message` replaces the message of injected errors.
Wire shapes: OpenAI chat-completions reference; vLLM `return_token_ids` (prompt_token_ids, choices[].token_ids).

Capacity model (`slots` > 0; benchmarks of `max_in_flight: auto`): `slots` decode slots served in arrival order,
a queue beyond (more than `max_waiting` waiting: 503 at once). An admitted request waits `prefill_s`, then
decodes its tokens at itl_s x (1 + load_factor x running / slots) seconds per token (every running request
slows as the batch grows), streamed as it decodes, first byte only once admitted (as vLLM). Lengths are long
tailed with `length_sigma` > 0: reasoning and content lengths x exp(sigma z - sigma^2 / 2), z ~ N(0, 1) seeded by
the request (mean kept). `/metrics` exposes running, waiting and cache usage (tokens held / `kv_tokens`, else
running / slots) under vLLM's or SGLang's names.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import re
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from aiohttp import web

from regen.testing.capacity import CapacityModel, _Capture
from regen.testing.wire_faults import ERROR_200, ERROR_FAULTS, FAULT_KINDS, answer_fault, stream_events, usage  # noqa: F401

try:
    import orjson

    def _dumps(obj) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # pragma: no cover
    def _dumps(obj) -> bytes:
        return json.dumps(obj, ensure_ascii=False).encode()

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu one two three four five six").split()
KNOWN_FIELDS = {"model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens", "stream",
                "stream_options", "n", "stop", "presence_penalty", "frequency_penalty", "user"}
MARKER = re.compile(r"\[\[fault:([a-z0-9_]+)\]\]")


@dataclass
class Settings:
    tokens: int = 8  # content tokens per answer (capped by max_tokens)
    reasoning_tokens: int = 4
    reasoning_field: str | None = "reasoning_content"  # or "reasoning", or None
    tool_calls: bool = True  # with tools and a final user message, call the first tool
    faults: dict = field(default_factory=dict)
    fault_budget: int | None = None  # random faults left to inject (None: no limit)
    seed: int = 0
    retry_after: str = "1"
    stall_s: float = 3600.0
    delay_s: float = 0.0  # before answering (every request)
    chunk_delay_s: float = 0.0  # between SSE events
    down: bool = False
    strict: bool = False  # 400 on fields outside KNOWN_FIELDS (return_token_ids, seed, extra body)
    api_key: str | None = None  # when set, require `Authorization: Bearer <api_key>` (chat and /v1/models)
    models: list = field(default_factory=lambda: ["fake"])  # ids listed by GET /v1/models
    log_bodies: bool = True
    max_log: int = 1_000_000
    log: bool = True  # False: keep no request log (benchmarks)
    fixed: bool = False  # every request gets the same pre-encoded answer (benchmarks: the cheapest server)
    error_message: str | None = None  # replaces the message of injected HTTP errors (ERROR_FAULTS)
    slots: int = 0  # capacity model (module doc): decode slots; 0 = unlimited, answers at once
    itl_s: float = 0.0  # seconds per output token of one request decoding alone
    load_factor: float = 1.0  # ITL x (1 + load_factor x running / slots)
    prefill_s: float = 0.0
    max_waiting: int | None = None  # queue bound: beyond it, 503 at once
    kv_tokens: int = 0  # cache size in tokens for the usage gauge (0: running / slots)
    metrics: str | None = None  # "vllm" | "sglang": serve /metrics gauges
    length_sigma: float = 0.0  # lognormal spread of answer lengths (0: every answer has `tokens`)
    timings: bool = False  # keep [key, received, ended] per chat request (GET /_timings; bench/scale.py)
    end_marker: str = "<|im_end|>"  # the end-of-turn text of the after_end / echo_end faults (SmolLM2's)
    finish_other: str = "eos_token"  # the finish_reason of the finish_other fault


class FakeOpenAI(CapacityModel):
    """The server's state and handlers (`app()` builds the aiohttp application)."""

    def __init__(self, settings: Settings | None = None, log_file: str | None = None):
        self.settings = settings or Settings()
        self.rng = random.Random(self.settings.seed)
        self.log: list[dict] = []
        self.log_file = open(log_file, "a", encoding="utf-8") if log_file else None
        self._cache: dict = {}
        self._bytes: dict = {}
        self.running = self.waiting = self.kv_used = 0
        self.timings: list[tuple] = []
        self._slot_free: asyncio.Condition | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._timed_chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.models)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/_timings", self.get_timings)
        app.router.add_get("/_log", self.get_log)
        app.router.add_post("/_log/clear", self.clear_log)
        app.router.add_get("/_control", self.get_control)
        app.router.add_post("/_control", self.set_control)
        return app

    # -- control
    async def models(self, request: web.Request) -> web.Response:
        if self.settings.down:
            return web.json_response({"error": {"message": "down"}}, status=503)
        if self.settings.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.settings.api_key}":
            return web.json_response({"error": {"message": "bad key", "code": "invalid_api_key"}}, status=401)
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.settings.models]})

    async def get_log(self, request: web.Request) -> web.Response:
        since = int(request.query.get("since", 0))
        return web.Response(body=_dumps(self.log[since:]), content_type="application/json")

    async def clear_log(self, request: web.Request) -> web.Response:
        self.log.clear()
        return web.json_response({"ok": True})

    async def get_control(self, request: web.Request) -> web.Response:
        return web.json_response({k: v for k, v in asdict(self.settings).items() if k != "api_key"})

    async def set_control(self, request: web.Request) -> web.Response:
        update = await request.json()
        for k, v in update.items():
            if not hasattr(self.settings, k):
                return web.json_response({"error": {"message": f"unknown setting {k}"}}, status=400)
            setattr(self.settings, k, v)
        if "seed" in update:
            self.rng = random.Random(self.settings.seed)
        return web.json_response({"ok": True})

    # -- answers
    def _fault(self, request: web.Request, body: dict) -> str | None:
        forced = request.headers.get("X-Fault")
        if forced:
            return forced
        for m in reversed(body.get("messages") or []):
            if m.get("role") == "user":
                found = MARKER.search(m.get("content") or "") if isinstance(m.get("content"), str) else None
                if found:
                    return found.group(1)
                break
        faults = self.settings.faults
        if faults and self.settings.fault_budget != 0:
            x = self.rng.random()
            for kind, prob in faults.items():
                if x < prob:
                    if self.settings.fault_budget is not None:
                        self.settings.fault_budget -= 1
                    return kind
                x -= prob
        return None

    def answer(self, body: dict) -> dict:
        """The deterministic answer to `body`: reasoning, content, tool_calls, token ids (from its hash)."""
        s = self.settings
        basis = {k: body.get(k) for k in ("model", "messages", "tools", "temperature", "top_p", "seed")}
        digest = hashlib.sha256(json.dumps(basis, sort_keys=True, ensure_ascii=False).encode()).digest()
        cache_key = (digest, body.get("max_tokens"), s.tokens, s.reasoning_tokens, s.reasoning_field, s.tool_calls,
                     s.length_sigma)
        if cache_key in self._cache:
            return self._cache[cache_key]
        budget = body.get("max_tokens") or 1 << 30
        want_reason, want_content = s.reasoning_tokens, s.tokens
        if s.length_sigma:
            scale = _lognormal_scale(digest, s.length_sigma)
            want_reason, want_content = round(want_reason * scale), max(1, round(want_content * scale))
        n_reason = min(want_reason, budget) if s.reasoning_field else 0
        n_content = max(0, min(want_content, budget - n_reason))
        words = [WORDS[(digest[i % 32] + i * 7) % len(WORDS)] for i in range(n_reason + n_content)]
        ids = [(digest[i % 32] * 131 + i) % 50_000 + 10 for i in range(n_reason + n_content)]
        msgs = body.get("messages") or []
        prompt_words = sum(len(str(m.get("content") or "").split()) + 2 for m in msgs)
        tool_calls = []
        if s.tool_calls and body.get("tools") and msgs and msgs[-1].get("role") == "user":
            name = body["tools"][0].get("function", {}).get("name", "tool")
            tool_calls = [{"id": "call_" + digest[:4].hex(), "type": "function",
                           "function": {"name": name, "arguments": json.dumps({"query": words[-1] if words else ""})}}]
        ans = {
            "reasoning": [w + " " for w in words[:n_reason]], "content": [w + " " for w in words[n_reason:]],
            "token_ids": ids, "prompt_token_ids": [(digest[i % 32] + i) % 50_000 + 10 for i in range(prompt_words)],
            "tool_calls": tool_calls, "finish_reason": "tool_calls" if tool_calls else
            ("length" if n_reason + n_content >= budget and budget < want_content + n_reason else "stop"),
        }
        if len(self._cache) < 100_000:
            self._cache[cache_key] = ans
        return ans

    def _log(self, entry: dict, body: dict) -> None:
        if self.settings.log_bodies:
            entry["body"] = body
        if len(self.log) < self.settings.max_log:
            self.log.append(entry)
        if self.log_file:
            self.log_file.write(json.dumps({**entry, "body": body}, ensure_ascii=False) + "\n")
            self.log_file.flush()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        s = self.settings
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return web.json_response({"error": {"message": "body is not JSON", "code": "invalid_json"}}, status=400)
        stream = bool(body.get("stream"))
        if s.fixed and not s.log:
            return await self._fixed(request, body, stream)
        entry = {"seq": len(self.log), "t": time.time(), "key": request.headers.get("X-Regen-Request-Key"),
                 "body_sha": hashlib.sha256(json.dumps({k: v for k, v in body.items() if k not in ("stream", "stream_options")},
                                                       sort_keys=True).encode()).hexdigest(),
                 "stream": stream, "fault": None, "status": 200}
        if s.api_key is not None and request.headers.get("Authorization") != f"Bearer {s.api_key}":
            entry.update(status=401, fault="auth")
            self._log(entry, body)
            return web.json_response({"error": {"message": "bad key", "code": "invalid_api_key"}}, status=401)
        if s.down:
            entry.update(status=503, fault="down")
            self._log(entry, body)
            return web.json_response({"error": {"message": "down"}}, status=503)
        fault = self._fault(request, body)
        if s.strict and not fault:
            unknown = sorted(set(body) - KNOWN_FIELDS)
            if unknown:
                fault = "unknown_field"
        entry["fault"] = fault
        status = ERROR_FAULTS[fault][0] if fault in ERROR_FAULTS else None
        entry["status"] = status or 200
        self._log(entry, body)
        if s.delay_s:
            await asyncio.sleep(s.delay_s)
        if status:
            headers = {"Retry-After": s.retry_after} if status == 429 else None
            err = ERROR_FAULTS[fault][1](s.error_message)
            if isinstance(err, bytes):
                return web.Response(status=status, body=err, content_type="text/html", headers=headers)
            return web.json_response(err, status=status, headers=headers)
        if fault == "stall":
            await asyncio.sleep(s.stall_s)
        ans = answer_fault(fault, self.answer(body), body, s)
        want_ids = bool(body.get("return_token_ids"))
        if s.slots and fault is None:
            return await self._served(request, body, ans, want_ids, stream)
        if stream:
            return await self._stream(request, body, ans, fault, want_ids)
        return await self._whole(request, body, ans, fault, want_ids)

    async def _fixed(self, request, body, stream) -> web.StreamResponse:
        want_ids = bool(body.get("return_token_ids"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        key = (stream, want_ids, include_usage, body.get("max_tokens"))
        data = self._bytes.get(key)
        if data is None:
            ans = self.answer({"model": "fixed", "messages": [], "max_tokens": body.get("max_tokens")})
            capture = _Capture()
            if stream:
                await self._stream(capture, {**body, "model": "fixed"}, ans, None, want_ids)
            else:
                await self._whole(capture, {**body, "model": "fixed"}, ans, None, want_ids)
            data = self._bytes[key] = capture.data
        if s := self.settings.delay_s:
            await asyncio.sleep(s)
        ctype = "text/event-stream" if stream else "application/json"
        return web.Response(status=200, body=data, content_type=ctype)

    async def _whole(self, request, body, ans, fault, want_ids) -> web.StreamResponse:
        s = self.settings
        if fault == "empty":
            return web.Response(status=200, body=b"", content_type="application/json")
        if fault in ERROR_200:  # a 200 whose body is an error object
            return web.Response(status=200, body=_dumps(ERROR_200[fault](s.error_message)),
                                content_type="application/json")
        msg = {"role": "assistant", "content": "".join(ans["content"])}
        if s.reasoning_field and ans["reasoning"]:
            msg[s.reasoning_field] = "".join(ans["reasoning"])
        if ans["tool_calls"]:
            msg["tool_calls"] = ans["tool_calls"]
        choice = {"index": 0, "message": msg, "finish_reason": ans["finish_reason"]}
        if ans.get("finish_missing"):
            del choice["finish_reason"]
        obj = {"id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()),
               "model": body.get("model"), "choices": [choice], "usage": usage(ans, body)}
        if want_ids:
            obj["prompt_token_ids"] = ans["prompt_token_ids"]
            choice["token_ids"] = ans["token_ids"][: len(ans["reasoning"]) + len(ans["content"])]
        data = _dumps(obj)
        if isinstance(request, _Capture):
            request.data = data
            return request
        if fault == "malformed":
            data = data[: len(data) // 2]
        if fault == "close":
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json",
                                                           "Content-Length": str(len(data))})
            await resp.prepare(request)
            await resp.write(data[: len(data) // 2])
            request.transport.close()
            return resp
        return web.Response(status=200, body=data, content_type="application/json")

    async def _stream(self, request, body, ans, fault, want_ids) -> web.StreamResponse:
        s = self.settings
        if isinstance(request, _Capture):
            resp = request
        else:
            resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
        base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": body.get("model")}
        events = ([] if fault == "empty" else
                  stream_events(base, ans, body, want_ids, s.reasoning_field, fault, s.error_message))
        encoded = [b"data: " + _dumps(e) + b"\n\n" for e in events]
        if fault == "malformed":
            encoded.insert(len(encoded) // 2, b"data: {\"choices\": [{\"delta\": \n\n")
        encoded.append(b"data: [DONE]\n\n")
        if fault in ("close", "stall_stream"):
            await resp.write(b"".join(encoded[: max(1, len(encoded) // 2)]))
            if fault == "close":
                request.transport.close()
                return resp
            await asyncio.sleep(s.stall_s)
        elif s.chunk_delay_s:
            for e in encoded:
                await resp.write(e)
                await asyncio.sleep(s.chunk_delay_s)
        else:
            await resp.write(b"".join(encoded))
        await resp.write_eof()
        return resp


    async def _timed_chat(self, request: web.Request) -> web.StreamResponse:
        if not self.settings.timings:
            return await self.chat(request)
        t0 = time.time()
        try:
            return await self.chat(request)
        finally:
            self.timings.append((request.headers.get("X-Regen-Request-Key"), t0, time.time()))

    async def get_timings(self, request: web.Request) -> web.Response:
        return web.Response(body=_dumps(self.timings), content_type="application/json")


def _lognormal_scale(digest: bytes, sigma: float) -> float:
    """exp(sigma z - sigma^2 / 2), z ~ N(0, 1) drawn from the request's digest: mean 1, long right tail."""
    import math

    z = random.Random(digest).gauss(0.0, 1.0)
    return math.exp(sigma * z - sigma * sigma / 2)


class ServerThread:
    """The server in a background thread of this process (tests): `.base_url`, `.server`, `.stop()`."""

    def __init__(self, settings: Settings | None = None, host: str = "127.0.0.1", port: int = 0,
                 log_file: str | None = None):
        self.server = FakeOpenAI(settings, log_file)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(host, port), daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("fake OpenAI server did not start")

    def _serve(self, host: str, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        self._runner = web.AppRunner(self.server.app(), handle_signals=False, shutdown_timeout=0.5)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, host, port, backlog=8192)
        self._loop.run_until_complete(site.start())
        sock = site._server.sockets[0]
        self.port = sock.getsockname()[1]
        self.base_url = f"http://{host}:{self.port}/v1"
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        async def _stop():
            await self._runner.cleanup()

        if self._loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(_stop(), self._loop)
            try:
                fut.result(10)
            except Exception:
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m regen.testing.openai_server", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--log-file", default=None, help="append every received request body here (JSON lines)")
    parser.add_argument("--settings", default="{}", help="JSON object of Settings fields, e.g. '{\"tokens\": 64}'")
    parser.add_argument("--faults", default=None, help="JSON object kind -> probability")
    parser.add_argument("--api-key-env", default=None, help="require the API key held by this environment variable")
    args = parser.parse_args(argv)
    settings = Settings(**json.loads(args.settings))
    if args.faults:
        settings.faults = json.loads(args.faults)
    if args.api_key_env:
        import os

        settings.api_key = os.environ[args.api_key_env]
    fake = FakeOpenAI(settings, args.log_file)

    async def serve():
        runner = web.AppRunner(fake.app(), shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port, backlog=8192)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        print(f"listening on http://{args.host}:{port}/v1", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
