import pytest

from regen.config import ProfileError, load_profile
from schemas.io import write_rows_atomic
from schemas.messages import message_from_arrow, message_to_arrow
from schemas.prompt import PROMPT_SCHEMA, PromptRecord, prompt_id_of
from schemas.shard import mask_from_spans, spans_from_mask


def test_profiles_load_and_overrides_apply():
    p = load_profile("local", ["select.total=123", "generate.max_in_flight=7"])
    assert p.select.total == 123 and p.generate.max_in_flight == 7
    assert load_profile("kimi-k3").generate.extra_body == {"thinking": True, "thinking_effort": "max"}


def test_unknown_profile_field_names_the_field():
    with pytest.raises(ProfileError, match="select.totl"):
        load_profile("local", ["select.totl=5"])


def test_unknown_profile_lists_known_ones():
    with pytest.raises(ProfileError, match="kimi-k3"):
        load_profile("nope")


def test_message_round_trip_with_parts_and_tool_calls():
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "assistant", "content": "", "reasoning_content": "r",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "5", "tool_call_id": "c1"},
    ]
    assert [message_from_arrow(message_to_arrow(m)) for m in msgs] == msgs


def test_prompt_id_is_content_hash(tmp_path):
    msgs = [{"role": "user", "content": "Name a prime."}]
    a = prompt_id_of(msgs, None)
    assert a == prompt_id_of([dict(m) for m in msgs], [])
    assert a != prompt_id_of([{"role": "user", "content": "Name a prime!"}], None)
    rec = PromptRecord(a, msgs, None, "general", "en", "s", "f.jsonl", 3, 1, 4)
    info = write_rows_atomic([rec.to_arrow_row()], tmp_path / "part-0.parquet", PROMPT_SCHEMA)
    assert info["rows"] == 1 and len(info["sha256"]) == 64
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("mask", [[0, 1, 1, 0, 1], [1, 1, 1], [0, 0], [1, 0, 0, 1]])
def test_spans_round_trip(mask):
    assert mask_from_spans(spans_from_mask(mask), len(mask)) == mask


def test_shards_view_over_an_empty_and_a_filled_manifest(tmp_path):
    import json

    from regen.report.query import query

    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "manifest.json").write_text(json.dumps({"shards": [], "complete": False}))
    assert query(tmp_path, "SELECT count(*) FROM shards")[1] == [(0,)]
    entry = {"path": "shard-00000.parquet", "rows": 3, "tokens": 50, "sha256": "ab"}
    (tmp_path / "shards" / "manifest.json").write_text(json.dumps({"shards": [entry], "complete": True}))
    columns, rows = query(tmp_path, "SELECT path, rows, tokens FROM shards")
    assert columns == ["path", "rows", "tokens"] and rows == [("shard-00000.parquet", 3, 50)]
