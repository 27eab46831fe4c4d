"""The test server's capacity model (`Settings.slots` > 0): decode slots, a queue beyond, load-dependent ITL, and
Prometheus `/metrics` gauges under vLLM's or SGLang's names (see `regen.testing.openai_server`, "Capacity model").

`CapacityModel` is a mixin of `regen.testing.openai_server.FakeOpenAI`: it reads the server's `settings` and
counters (`running`, `waiting`, `kv_used`) and answers through its `_whole` / `_stream` writers.
"""
from __future__ import annotations

import asyncio

from aiohttp import web


class _Capture:
    """Collects what a handler writes (to pre-encode the fixed benchmark answer)."""

    def __init__(self):
        self.data = b""

    async def write(self, data: bytes) -> None:
        self.data += data

    async def write_eof(self) -> None:
        pass


class CapacityModel:
    async def _served(self, request, body, ans, want_ids, stream) -> web.StreamResponse:
        """Queue for a decode slot, prefill, then decode at the batch's pace (module doc, "Capacity model")."""
        s = self.settings
        if self._slot_free is None:
            self._slot_free = asyncio.Condition()
        if s.max_waiting is not None and self.waiting >= s.max_waiting:
            return web.json_response({"error": {"message": "queue full", "code": "overloaded"}}, status=503)
        n_tokens = len(ans["reasoning"]) + len(ans["content"])
        held = len(ans["prompt_token_ids"]) + n_tokens
        self.waiting += 1
        try:
            async with self._slot_free:
                await self._slot_free.wait_for(lambda: self.running < s.slots)
                self.running += 1
        finally:
            self.waiting -= 1
        self.kv_used += held
        try:
            if s.prefill_s:
                await asyncio.sleep(s.prefill_s)
            if not stream:
                await self._decode(n_tokens)
                return await self._whole(request, body, ans, None, want_ids)
            capture = _Capture()
            await self._stream(capture, body, ans, None, want_ids)
            events = [e + b"\n\n" for e in capture.data.split(b"\n\n") if e]
            resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            head, tail = 1, max(1, len(events) - n_tokens - 1)  # role event first; usage, finish, [DONE] last
            await resp.write(b"".join(events[:head]))
            sent = head
            async for done in self._decoding(n_tokens):
                upto = min(len(events) - tail, head + done)
                if upto > sent:
                    await resp.write(b"".join(events[sent:upto]))
                    sent = upto
            await resp.write(b"".join(events[sent:]))
            await resp.write_eof()
            return resp
        finally:
            self.kv_used -= held
            async with self._slot_free:
                self.running -= 1
                self._slot_free.notify(1)

    def _itl(self) -> float:
        s = self.settings
        return s.itl_s * (1 + s.load_factor * self.running / max(1, s.slots))

    async def _decoding(self, n_tokens: int, step_s: float = 0.05):
        """Yield the number of tokens decoded so far, every step_s, until n_tokens (the ITL follows the load)."""
        done = 0.0
        while done < n_tokens:
            itl = self._itl()
            if itl <= 0:
                break
            dt = min(step_s, (n_tokens - done) * itl)
            await asyncio.sleep(dt)
            done += dt / itl
            yield int(done)
        yield n_tokens

    async def _decode(self, n_tokens: int) -> None:
        async for _ in self._decoding(n_tokens):
            pass

    async def prometheus(self, request: web.Request) -> web.Response:
        s = self.settings
        if s.metrics not in ("vllm", "sglang"):
            return web.Response(status=404, text="no metrics")
        usage = self.kv_used / s.kv_tokens if s.kv_tokens else self.running / max(1, s.slots)
        names = {"vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
                 "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage")}[s.metrics]
        lines = []
        for name, value in zip(names, (self.running, self.waiting, min(1.0, usage))):
            lines += [f"# HELP {name} capacity model of regen.testing.openai_server", f"# TYPE {name} gauge",
                      f'{name}{{model_name="fake"}} {float(value)}']
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")
