"""Fixtures of the regeneration-client tests: a real fake-OpenAI server on loopback and small prompt runs."""
from __future__ import annotations

import pyarrow as pa
import pytest

from regen.config.generate import GenerateConfig
from regen.rundir import RunDir
from regen.testing.openai_server import ServerThread, Settings
from schemas.io import write_json_atomic, write_parquet_atomic
from schemas.prompt import PROMPT_SCHEMA, PromptRecord, prompt_id_of

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]


def conversations(n: int, seed: int = 0) -> list[tuple[list[dict], list | None]]:
    """n conversations of mixed shapes: single turn, multi-turn with recorded assistants, tool turns."""
    out = []
    for i in range(n):
        kind = (i + seed) % 4
        if kind == 0:
            out.append(([{"role": "user", "content": f"question {i}"}], None))
        elif kind == 1:
            out.append(([{"role": "system", "content": "be brief"}, {"role": "user", "content": f"first {i}"},
                         {"role": "assistant", "content": "old answer"}, {"role": "user", "content": f"second {i}"}], None))
        elif kind == 2:  # tool turn whose recorded call matches what the fake server calls (tools[0])
            out.append(([{"role": "user", "content": f"look up {i}"},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": f"result {i}"},
                         {"role": "assistant", "content": "old final"}], TOOLS))
        else:  # three user turns, no recorded assistants between the last two
            out.append(([{"role": "user", "content": f"a {i}"}, {"role": "assistant", "content": "x"},
                         {"role": "user", "content": f"b {i}"}, {"role": "assistant", "content": "y"},
                         {"role": "user", "content": f"c {i}"}], None))
    return out


def write_prompts(run: RunDir, convs: list[tuple[list[dict], list | None]]) -> list[PromptRecord]:
    records = []
    for i, (messages, tools) in enumerate(convs):
        records.append(PromptRecord(prompt_id=prompt_id_of(messages, tools), messages=messages, tools=tools,
                                    category="tool_use" if tools else "general", language="en", source="test",
                                    source_file="test.jsonl", source_row=i, num_turns=1))
    table = pa.Table.from_pylist([r.to_arrow_row() for r in records], schema=PROMPT_SCHEMA)
    info = write_parquet_atomic(table, run.prompts / "part-00000.parquet", PROMPT_SCHEMA)
    write_json_atomic({"parts": [info]}, run.prompts / "manifest.json")
    return records


def fast_config(**kw) -> GenerateConfig:
    """Small timeouts and backoff so fault tests finish in seconds."""
    base = {
        "model": "fake", "max_in_flight": 32, "max_tokens": 64, "part_rows": 50,
        "timeouts": {"connect": 2, "first_byte": 2, "between_chunks": 1, "total": 10},
        "retry": {"max_attempts": 8, "base_s": 0.01, "max_s": 0.05, "max_retry_after_s": 0.2},
        "health": {"fail_threshold": 1000, "interval_s": 0.2, "max_wait_s": 5},
    }
    for k, v in kw.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k] = {**base[k], **v}
        else:
            base[k] = v
    return GenerateConfig.model_validate(base)


@pytest.fixture
def server():
    srv = ServerThread(Settings(stall_s=30, retry_after="0.05"))
    yield srv
    srv.stop()


@pytest.fixture
def run_dir(tmp_path) -> RunDir:
    return RunDir.at(tmp_path / "run")
