"""Property test over every row of generated runs (hypothesis): each written row's supervised tokens decode to
exactly the text the target generated (+ the spec's closing markers), with control ids only where the format
puts them; every other row is rejected with a reason; the accounting adds up."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from render_fixtures import generation_row, k3_generated_text, write_generations

from regen.config.render import RenderConfig
from regen.render.kimi_k3.renderer import KimiK3Renderer
from regen.render.stage import run_render
from regen.rundir import RunDir

PIECES = ["the ", "answer ", "is ", "five", ". ", "\n", "\n\n", "  ", "<|sep|>", "<|open|>", "<|close|>message",
          "<|end_of_msg|>", "[EOS]", "漢字", "テスト", "é", "🙂", "&", '"', "'s ", "12345", "\t", "def f(x): ", "{}"]
text = st.lists(st.sampled_from(PIECES), min_size=0, max_size=25).map("".join)
CONTROL_BASE = 163_584


@st.composite
def rows(draw):
    out = []
    for i in range(draw(st.integers(1, 6))):
        turns = draw(st.integers(0, 2))
        history = []
        for _ in range(turns):
            history += [{"role": "user", "content": draw(text) or "q"},
                        {"role": "assistant", "content": draw(text), "reasoning_content": draw(text)}]
        history.append({"role": "user", "content": draw(text) or "q"})
        calls = None
        if draw(st.booleans()) and draw(st.booleans()):
            calls = [{"id": f"c{i}", "type": "function",
                      "function": {"name": "lookup", "arguments": json.dumps({"q": draw(text), "n": 3})}}]
        out.append(generation_row(f"h{i}", turns, history, content=draw(text), reasoning_content=draw(text),
                                  tool_calls=calls, language=None, category="code"))
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows())
def test_every_written_row_masks_exactly_the_generated_text(generated):
    renderer = KimiK3Renderer()
    tmp = Path(tempfile.mkdtemp(prefix="regen-prop-"))
    try:
        write_generations(tmp, generated, parts=2)
        run = RunDir.at(tmp)
        cfg = RenderConfig(template_kwargs={"thinking": True, "thinking_effort": "max"}, min_loss_tokens=1)
        m = run_render(cfg, run, progress=False)
        by_key = {(r["prompt_id"], r["turn"]): r for r in generated}
        samples = [s for e in m["shards"] for s in pq.read_table(run.shards / e["path"]).to_pylist()]
        for s in samples:
            (span,) = s["loss_spans"]
            masked = s["input_ids"][span["start"]:span["end"]]
            row = by_key[(s["prompt_id"], s["turn"])]
            assert renderer.decode(masked) == k3_generated_text(row)
            calls = len(row["tool_calls"] or [])
            num_args = 2 * calls
            expected_controls = 8 + (4 + 4 * calls + 4 * num_args if calls else 0)
            assert sum(t >= CONTROL_BASE for t in masked) == expected_controls
            assert s["input_ids"][span["end"]:] == [163586]
        rejects = [r for p in run.rejected("render").glob("part-*.parquet") for r in pq.read_table(p).to_pylist()]
        assert all(r["reason"] and r["filter"] for r in rejects)
        written = {(s["prompt_id"], s["turn"]) for s in samples}
        rejected = {(r["prompt_id"], r["turn"]) for r in rejects}
        assert written | rejected == set(by_key) and not written & rejected
        assert m["counts"].get("rendered", 0) == m["num_rows"] + sum(m["rejected"].values()) + m["counts"].get("duplicates", 0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
