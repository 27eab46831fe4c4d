"""One process's share of a generate run: its prompts, its conversation workers, its client and its ledger.

`Runner` drives `max_in_flight` conversations turn by turn (`regen.generate.conversation`), sends each request
through one `regen.generate.client.ChatClient`, checks answers (`regen.generate.checks`) and records every
(prompt_id, turn) unit exactly once through `regen.generate.ledger`. `run_shard` runs one in a fresh event loop:
in-process for `regen generate`, or inside a Ray actor (`regen.generate.ray_runner`). Shard `(i, n)` owns the
prompt ids whose hash is i mod n.
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from regen.config.generate import GenerateConfig
from regen.errors import InputError
from regen.generate import ledger as ledger_mod
from regen.generate.checks import (
    END_MARKER_STRIPPED,
    NO_PARTIAL,
    QUALITY_KIND,
    Completion,
    RequestFailure,
    judge,
    strip_echoed_end,
)
from regen.generate.client import ChatClient, backoff_delay
from regen.generate.conversation import (
    PREVIOUS_TURN_ERROR,
    TOOL_RESULT_MISMATCH,
    fill_missing_call_ids,
    history_message,
    next_segment,
    request_body,
    request_config,
    request_key,
    skipped_key,
    tools_from_json,
    turn_positions,
)
from regen.generate.metrics import Metrics, ProgressLine
from schemas.messages import message_from_arrow, message_to_arrow
from schemas.prompt import canonical_json

PROMPT_COLUMNS = ["prompt_id", "messages", "tools", "category", "language"]
PROMPT_V3_COLUMNS = ["length_band", "mode"]  # PROMPT_SCHEMA v3; null for older selections
NOTED = ("usage_inconsistent", "over_max_tokens")  # flagged classes whose numbers go in error_detail


class FatalStop(Exception):
    """A failure no retry can fix (e.g. 401): the run stops, keeping every recorded row."""


def in_shard(prompt_id: str, shard: tuple[int, int]) -> bool:
    """Shard `(index, count)` owns the prompt ids whose sha1 (first 8 hex digits) is index mod count."""
    index, count = shard
    return count <= 1 or int(hashlib.sha1(prompt_id.encode()).hexdigest()[:8], 16) % count == index


def iter_prompts(files: list[Path], shard: tuple[int, int] = (0, 1)):
    """Prompt rows of this shard as dicts: prompt_id, messages (OpenAI dicts), tools (JSON), category, language.

    A prompt_id seen before (the same prompt in two parts) is skipped: units are counted once.
    """
    seen: set[str] = set()
    for f in files:
        pf = pq.ParquetFile(f)
        present = set(pf.schema_arrow.names)
        columns = PROMPT_COLUMNS + [c for c in PROMPT_V3_COLUMNS if c in present]
        for batch in pf.iter_batches(batch_size=1024, columns=columns):
            for row in batch.to_pylist():
                for c in PROMPT_V3_COLUMNS:
                    row.setdefault(c, None)
                pid = row["prompt_id"]
                if pid in seen or not in_shard(pid, shard):
                    continue
                seen.add(pid)
                row["messages"] = [message_from_arrow(m) for m in row["messages"]]
                yield row


# ---------------------------------------------------------------- the runner


@dataclass
class Conv:
    prompt: dict
    positions: list[int]
    start: int = 0
    history: list[dict] | None = None  # request messages of turn `start`
    skip_from: tuple[str, str] | None = None  # (stop_reason, stopping key): emit skipped rows only


class Runner:
    """One process's share of a run: a ChatClient, a Ledger, `max_in_flight` conversation workers."""

    def __init__(self, cfg: GenerateConfig, gen_dir: Path, files: list[Path], endpoints: list[str],
                 api_key: str | None, writer: str = "w0", shard: tuple[int, int] = (0, 1), progress: bool = True):
        self.cfg, self.gen_dir, self.files, self.endpoints = cfg, Path(gen_dir), files, endpoints
        self.api_key, self.writer, self.shard, self.show_progress = api_key, writer, shard, progress
        self.metrics = Metrics(writer)
        self.total_units = self.done_units = self.num_prompts = 0
        self._modes: dict = {}  # mode -> (its GenerateConfig, its request_params JSON)
        self.request_params = self.mode_config(None)[1]
        self.client: ChatClient | None = None
        self.ledger: ledger_mod.Ledger | None = None

    def mode_config(self, mode: str | None) -> tuple[GenerateConfig, str]:
        """(the config of a prompt of generation mode `mode`, its `request_params` JSON), built once per mode.
        InputError for a mode the profile does not define (`GenerateConfig.for_mode`)."""
        if mode not in self._modes:
            cfg = self.cfg.for_mode(mode)
            params = canonical_json({**request_config(cfg)["sampling"], **cfg.extra_body,
                                     **({"return_token_ids": True} if cfg.return_token_ids else {})})
            self._modes[mode] = (cfg, params)
        return self._modes[mode]

    # -- planning
    def plan(self) -> tuple[dict, set]:
        """Scan recorded rows and prompts: units total/done, and prompt ids cut mid-conversation."""
        index = ledger_mod.read_index(self.gen_dir, ["prompt_id", "turn"]).to_pydict()
        recorded: dict[str, int] = {}
        last: dict[str, int] = {}
        for pid, t in zip(index["prompt_id"], index["turn"]):
            recorded[pid] = recorded.get(pid, 0) + 1
            last[pid] = max(last.get(pid, -1), t)
        for pid, n in recorded.items():
            if last[pid] != n - 1:  # rows of later turns without an earlier one: a part was lost
                raise InputError(f"generations/ holds turns of prompt {pid} after a missing earlier turn (a part was "
                                 "deleted or lost): run `regen generate --repair` to re-request the lost turns")
        partial = set()
        for p in iter_prompts(self.files, self.shard):
            n = len(turn_positions(p["messages"]))
            self.mode_config(p.get("mode"))  # an unknown mode stops the run before its first request
            self.num_prompts += 1
            self.total_units += n
            done = recorded.get(p["prompt_id"], 0)
            if done > n:
                raise InputError(f"generations/ holds {done} rows for prompt {p['prompt_id']} but it has {n} turns: "
                                 "the directory mixes runs; use a new --run directory")
            self.done_units += done
            if 0 < done < n:
                partial.add(p["prompt_id"])
        return recorded, partial

    def resume_conv(self, p: dict, positions: list[int], rows: list[dict]) -> Conv:
        """A conversation cut by a crash after len(rows) recorded turns: rebuild the history of the next one."""
        rows = sorted(rows, key=lambda r: r["turn"])
        last = rows[-1]
        s = len(rows)
        if last["status"] != "ok" or last["stop_reason"]:
            return Conv(p, positions, s, skip_from=(last["stop_reason"] or PREVIOUS_TURN_ERROR, last["request_key"]))
        assistant = {"content": last["content"], "reasoning_content": last["reasoning_content"],
                     "tool_calls": [dict(tc, function=dict(tc["function"])) for tc in last["tool_calls"] or []] or None}
        seg = next_segment(p["messages"], positions, s - 1, assistant)
        if seg is None:
            return Conv(p, positions, s, skip_from=(TOOL_RESULT_MISMATCH, last["request_key"]))
        sent = [message_from_arrow(m) for m in last["messages"]]
        return Conv(p, positions, s, history=sent + [history_message(assistant, self.cfg)] + seg)

    # -- rows
    def _base_row(self, p: dict, turn: int, key: str, messages: list[dict] | None) -> dict:
        return {
            "request_key": key, "prompt_id": p["prompt_id"], "turn": turn, "category": p["category"],
            "language": p["language"], "model": self.cfg.model, "tools": p["tools"],
            "messages": [message_to_arrow(m) for m in messages] if messages is not None else None,
            "request_params": self.mode_config(p.get("mode"))[1], "finished_at": None, "flags": [],
            "length_band": p.get("length_band"), "mode": p.get("mode"),
        }

    def _fill(self, row: dict, c: Completion | None, answer: bool = True) -> dict:
        """The completion's fields into `row`; `answer=False` keeps its text and ids out (a partial answer)."""
        if c is not None:
            row.update(
                finish_reason=c.finish_reason, num_prompt_tokens=c.num_prompt_tokens,
                num_completion_tokens=c.num_completion_tokens, num_reasoning_tokens=c.num_reasoning_tokens,
                latency_s=c.latency_s, ttft_s=c.ttft_s, endpoint=c.endpoint,
            )
            if answer:
                row.update(reasoning_content=c.reasoning_content, content=c.content, tool_calls=c.tool_calls,
                           prompt_token_ids=c.prompt_token_ids, completion_token_ids=c.completion_token_ids)
        return row

    def _skipped(self, p: dict, turns: range, reason: str, stop_key: str) -> list[dict]:
        rows = []
        for t in turns:
            r = self._base_row(p, t, skipped_key(p["prompt_id"], t, stop_key), None)
            r.update(status="skipped", stop_reason=reason, attempts=0)
            rows.append(r)
        return rows

    async def _record(self, rows: list[dict]) -> None:
        now_ms = int(time.time() * 1000)
        for r in rows:
            r["finished_at"] = now_ms  # when the unit ended, not when its row was started
        await self.ledger.append(rows)
        for r in rows:
            self.metrics.row(r["status"], r.get("error_class"), r.get("flags"))
        self.done_units += len(rows)

    # -- one unit, with retries and policies
    async def generate_turn(self, p: dict, turn: int, messages: list[dict],
                            tools: list[dict] | None) -> tuple[dict, Completion | None]:
        cfg = self.mode_config(p.get("mode"))[0]
        key = request_key(p["prompt_id"], turn, cfg, messages, tools)
        body = request_body(cfg, messages, tools)
        row = self._base_row(p, turn, key, messages)
        attempt = 0
        while True:
            attempt += 1
            try:
                c = await self.client.complete(body, request_key=key)
            except RequestFailure as f:
                self.metrics.attempt(f.error_class, detail=f.detail)
                if f.fatal:
                    raise FatalStop(f"{f.error_class}: HTTP {f.status} from the endpoint; check the API key "
                                    f"(generate.api_key_env) and the endpoint URL") from None
                drop = f.error_class == "malformed" and cfg.policy("malformed") == "drop"
                if f.transient and not drop and attempt < cfg.retry.max_attempts:
                    await asyncio.sleep(backoff_delay(attempt, cfg.retry, f.retry_after_s))
                    continue
                row.update(status="error", error_class=f.error_class, error_detail=f.detail, attempts=attempt)
                return row, None
            stripped = strip_echoed_end(c, cfg.end_of_turn_markers)
            found = dict(judge(c, cfg.think_markers, cfg.end_of_turn_markers, body.get("max_tokens")))
            classes = list(found)
            acting = [k for k in classes if cfg.policy(k) != "keep_flagged"]
            self.metrics.attempt(acting[0] if acting else None, c.num_completion_tokens or c.num_chunks,
                                 c.num_prompt_tokens or 0, c.latency_s, c.ttft_s)
            if not acting:
                self._fill(row, c)
                noted = [found[k] for k in classes if k in NOTED]
                row.update(status="ok", flags=classes + ([END_MARKER_STRIPPED] if stripped else []),
                           attempts=attempt, error_detail="; ".join(noted) or None)
                return row, c
            klass = acting[0]
            policy = cfg.policy(klass)
            if policy == "drop" or attempt >= cfg.retry.max_attempts:
                self._fill(row, c, answer=klass not in NO_PARTIAL)
                why = "dropped by policy" if policy == "drop" else f"{policy}: {attempt} attempts"
                row.update(status="error", error_class=klass, flags=classes,
                           error_detail=f"{QUALITY_KIND[klass]}: {why}; {found[klass]}", attempts=attempt)
                return row, None
            if policy == "retry_larger":
                body["max_tokens"] = min(cfg.retry.max_tokens_cap, int(body["max_tokens"] * cfg.retry.larger_factor))
            await asyncio.sleep(backoff_delay(attempt, cfg.retry))

    async def run_conv(self, conv: Conv) -> None:
        p, positions = conv.prompt, conv.positions
        n = len(positions)
        if conv.skip_from is not None:
            await self._record(self._skipped(p, range(conv.start, n), *conv.skip_from))
            return
        tools = tools_from_json(p["tools"])
        history = conv.history if conv.history is not None else p["messages"][: positions[0]]
        for k in range(conv.start, n):
            row, c = await self.generate_turn(p, k, history, tools)
            if row["status"] != "ok":
                await self._record([row] + self._skipped(p, range(k + 1, n), PREVIOUS_TURN_ERROR, row["request_key"]))
                return
            assistant = c.assistant_message()
            fill_missing_call_ids(assistant, p["messages"], positions[k])
            row["tool_calls"] = assistant.get("tool_calls")
            if k + 1 == n:
                await self._record([row])
                return
            seg = next_segment(p["messages"], positions, k, assistant)
            if seg is None:
                row["stop_reason"] = TOOL_RESULT_MISMATCH
                await self._record([row] + self._skipped(p, range(k + 1, n), TOOL_RESULT_MISMATCH, row["request_key"]))
                return
            await self._record([row])
            history = history + [history_message(assistant, self.cfg)] + seg

    def _limit(self) -> int | None:
        """The sum of the endpoints' current in-flight limits under `max_in_flight: auto`, else None."""
        limits = self.client.limits() if self.client is not None else None
        return sum(limits.values()) if limits else None

    # -- the loop
    async def run(self) -> dict:
        recorded, partial = self.plan()
        cut = {}
        for r in ledger_mod.load_rows(self.gen_dir, partial):
            cut.setdefault(r["prompt_id"], []).append(r)
        bar = ProgressLine(self.total_units, self.done_units, self.show_progress, self.cfg.progress_interval_s)
        cap = self.cfg.in_flight_cap(len(self.endpoints))  # auto: workers for every endpoint's highest limit
        queue: asyncio.Queue = asyncio.Queue(self.cfg.queue_size or 2 * cap)
        num_workers = cap
        self.ledger = await ledger_mod.Ledger(self.gen_dir, self.writer, self.cfg.part_rows,
                                              self.cfg.part_interval_s).start()

        async def produce():
            for p in iter_prompts(self.files, self.shard):
                positions = turn_positions(p["messages"])
                done = recorded.get(p["prompt_id"], 0)
                if done >= len(positions):
                    continue
                conv = self.resume_conv(p, positions, cut[p["prompt_id"]]) if done else Conv(p, positions)
                await queue.put(conv)
            for _ in range(num_workers):
                await queue.put(None)

        async def work():
            while (conv := await queue.get()) is not None:
                await self.run_conv(conv)

        async def tick():
            while True:
                bar.update(self.done_units, self.metrics.snapshot(), self.client.in_flight, self._limit())
                await asyncio.sleep(0.5)

        fatal = None
        try:
            async with ChatClient(self.endpoints, max_in_flight=cap, timeouts=self.cfg.timeouts,
                                  health=self.cfg.health, api_key=self.api_key, max_wait_s=self.cfg.health.max_wait_s,
                                  base_cooldown_s=self.cfg.retry.base_s,
                                  auto=self.cfg.concurrency if self.cfg.auto_in_flight else None) as client:
                self.client = client
                ticker = asyncio.create_task(tick())
                try:
                    async with asyncio.TaskGroup() as tg:
                        tg.create_task(produce())
                        for _ in range(num_workers):
                            tg.create_task(work())
                except* FatalStop as eg:
                    fatal = eg.exceptions[0]
                finally:
                    ticker.cancel()
                    bar.update(self.done_units, self.metrics.snapshot(), 0)
                    self.endpoint_summary = [e.summary() for e in client.pool.endpoints]
                    self.metrics.peak_in_flight = client.peak_in_flight
                    self.metrics.limit_history = client.limit_history()
        finally:
            await self.ledger.close()
            bar.close()
        if fatal is not None:
            raise InputError(f"generation stopped: {fatal}")
        return self.metrics.summary()


def run_shard(cfg: GenerateConfig, gen_dir: Path, files: list[Path], endpoints: list[str], api_key: str | None,
              writer: str, shard: tuple[int, int], progress: bool) -> dict:
    """Run one shard in a fresh event loop (a local process or a Ray actor); returns its metrics summary."""
    runner = Runner(cfg, gen_dir, files, endpoints, api_key, writer, shard, progress)
    summary = asyncio.run(runner.run())
    summary["endpoints"] = getattr(runner, "endpoint_summary", [])
    summary["throughput"] = runner.metrics.throughput_rows()
    return summary
