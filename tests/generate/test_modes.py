"""Generation modes: each prompt is requested with its mode's settings (temperature,
thinking, effort), the row records its mode and band, the DuckDB view shows them, an unknown mode stops the run
before its first request, and a profile without modes keeps its request keys."""
from __future__ import annotations

import json

import pyarrow as pa
import pytest
from conftest import fast_config

from regen.errors import InputError
from regen.generate.conversation import request_key
from regen.generate.stage import run_generate
from regen.report.query import query
from schemas.io import write_json_atomic, write_parquet_atomic
from schemas.prompt import PROMPT_SCHEMA, PromptRecord, prompt_id_of

MODES = {"think_max": {"extra_body": {"thinking": True, "thinking_effort": "max"}},
         "think_low": {"temperature": 0.6, "extra_body": {"thinking": True, "thinking_effort": "low"}},
         "no_think": {"temperature": 0.0, "extra_body": {"thinking": False, "thinking_effort": None}}}


def _prompts(run, modes: list[str | None]) -> list[PromptRecord]:
    records = []
    for i, mode in enumerate(modes):
        messages = [{"role": "user", "content": f"question {i}"}]
        records.append(PromptRecord(prompt_id=prompt_id_of(messages, None), messages=messages, tools=None,
                                    category="general", language="en", source="t", source_file="t.jsonl",
                                    source_row=i, num_turns=1, num_prompt_tokens=5, length_band="0-2K", mode=mode))
    table = pa.Table.from_pylist([r.to_arrow_row() for r in records], schema=PROMPT_SCHEMA)
    write_json_atomic({"parts": [write_parquet_atomic(table, run.prompts / "part-00000.parquet", PROMPT_SCHEMA)]},
                      run.prompts / "manifest.json")
    return records


def test_each_prompt_is_requested_with_its_modes_settings(server, run_dir):
    modes = ["think_max", "think_low", "no_think"] * 4
    records = _prompts(run_dir, modes)
    cfg = fast_config(temperature=1.0, extra_body={"thinking": True, "thinking_effort": "max"}, modes=MODES)
    manifest = run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False)
    assert manifest["accounting"]["balanced"]
    mode_of = {r.prompt_id: r.mode for r in records}
    question = {f"question {i}": m for i, m in enumerate(modes)}
    bodies = [e["body"] for e in server.server.log]
    assert len(bodies) == 12
    for body in bodies:
        mode = question[body["messages"][0]["content"]]
        want = {"think_max": (1.0, True, "max"), "think_low": (0.6, True, "low"), "no_think": (0.0, False, None)}[mode]
        assert (body["temperature"], body["thinking"], body.get("thinking_effort")) == want, (mode, body)
    rows = query(run_dir.root, "SELECT prompt_id, mode, length_band, request_params FROM generations")[1]
    assert len(rows) == 12
    for pid, mode, band, params in rows:
        assert mode == mode_of[pid] and band == "0-2K"
        assert json.loads(params)["temperature"] == {"think_max": 1.0, "think_low": 0.6, "no_think": 0.0}[mode]
    counts = dict(query(run_dir.root, "SELECT mode, count(*) FROM generations GROUP BY 1")[1])
    assert counts == {"think_max": 4, "think_low": 4, "no_think": 4}


def test_a_mode_the_profile_does_not_define_stops_before_any_request(server, run_dir):
    _prompts(run_dir, ["think_max", "ghost"])
    cfg = fast_config(modes=MODES)
    with pytest.raises(InputError, match="generation mode 'ghost'.*generate.modes"):
        run_generate(cfg, run_dir, endpoints=[server.base_url], progress=False)
    assert server.server.log == []


def test_without_modes_request_keys_are_unchanged():
    cfg = fast_config()
    msgs = [{"role": "user", "content": "q"}]
    assert request_key("p", 0, cfg.for_mode(None), msgs, None) == request_key("p", 0, cfg, msgs, None)
    with_modes = fast_config(modes=MODES)
    low = with_modes.for_mode("think_low")
    assert request_key("p", 0, low, msgs, None) != request_key("p", 0, with_modes, msgs, None)
    assert low.extra_body == {"thinking": True, "thinking_effort": "low"} and low.modes == {}
