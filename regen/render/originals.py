"""`regen render --responses original`: the source's own answers rendered into a second shard set of the run.

The prompts' `original_answers` (PROMPT_SCHEMA v2, `regen.select.originals`) and the recorded assistant messages
inside their `messages` are turned into generation rows (GENERATION_SCHEMA), one per turn position
(`schemas.prompt.turn_positions`), exactly as the generate stage lays out its units: turn k's `messages` are
the original conversation before position k, its `content` / `reasoning_content` / `tool_calls` the original
answer at position k. They are written to `originals/part-*.parquet` + `originals/manifest.json`
(`write_original_generations`), and the render stage then runs unchanged on `run.with_responses("original")`
(`regen render --responses original`, or `run_render(cfg, run.with_responses("original"))`): the same response filters,
row checks, template, assistant-only mask and limits, into `shards-original/` (its own manifest, `filters.json`,
`responses.parquet`) with rejects in `rejected/render-original/`.

Only prompts with an original for every turn position are written (`original_answers` not null); the others
are counted in the manifest (`prompts_without_original`, per source). Original rows carry `status` "ok",
`finish_reason` null (not generated: never "length"), `model` "original", and a `request_key` that hashes
the prompt id, turn and answer. Rewritten only when the prompt parts change (their sha256s), so a second
`regen render --responses original` resumes like the first.
"""
from __future__ import annotations

import hashlib
from collections import Counter

import pyarrow.parquet as pq

from regen.errors import InputError
from regen.rundir import RunDir
from schemas.generation import GENERATION_SCHEMA
from schemas.io import read_json, write_rows_atomic
from schemas.messages import message_from_arrow, message_to_arrow
from schemas.prompt import SCHEMA_VERSION as PROMPT_SCHEMA_VERSION
from schemas.prompt import canonical_json, inserted_positions, original_answers_of

ROWS_PER_PART = 10_000
PROMPT_COLUMNS = ("prompt_id", "messages", "tools", "category", "language", "source", "original_answers")


def _prompt_parts(run: RunDir) -> tuple[list, dict]:
    manifest = read_json(run.prompts / "manifest.json")
    if not manifest or not manifest.get("parts"):
        raise InputError(f"{run.prompts}/manifest.json lists no prompt parts: run `regen select --run {run.root}` "
                         f"first")
    return [run.prompts / p["path"] for p in manifest["parts"]], manifest


def original_rows(prompt: dict) -> list[dict]:
    """GENERATION_SCHEMA rows of one prompt row (PROMPT_SCHEMA dict) with `original_answers`, one per turn
    position; [] when it has none."""
    answers = original_answers_of(prompt)
    if answers is None:
        return []
    messages = [message_from_arrow(m) for m in prompt["messages"]]
    inserted = inserted_positions(messages)
    if len(answers) != len(inserted):  # not written by regen select: no original rather than a wrong one
        return []
    by_position = dict(zip(inserted, answers))
    full = []  # the original conversation: recorded messages with the answers at the inserted positions
    for i in range(len(messages) + 1):
        if i in by_position:
            full.append(by_position[i])
        if i < len(messages):
            full.append(messages[i])
    rows = []
    at = [i for i, m in enumerate(full) if m["role"] == "assistant"]  # = the turn positions, in order
    for turn, pos in enumerate(at):
        answer = full[pos]
        key = hashlib.sha256(canonical_json(["original", prompt["prompt_id"], turn, answer]).encode()).hexdigest()
        rows.append({
            **dict.fromkeys(GENERATION_SCHEMA.names), "flags": [], "attempts": 0,
            "request_key": key, "prompt_id": prompt["prompt_id"], "turn": turn, "status": "ok",
            "category": prompt.get("category"), "language": prompt.get("language"), "model": "original",
            "messages": [message_to_arrow(m) for m in full[:pos]], "tools": prompt.get("tools"),
            "content": answer.get("content") if isinstance(answer.get("content"), str) else None,
            "reasoning_content": answer.get("reasoning_content"),
            "tool_calls": message_to_arrow(answer)["tool_calls"],
        })
    return rows


def write_original_generations(run: RunDir) -> dict:
    """Write `originals/part-*.parquet` + manifest from the run's prompts; returns the manifest.

    Manifest: {parts: [{path, rows, bytes, sha256}], prompts_fingerprint, num_prompts, num_prompts_with_original,
    num_rows, prompts_without_original: {source: n}}. Skipped (the manifest returned) when the prompt parts are
    unchanged. Raises InputError when the run has no prompts, or prompts of schema version 1 (selected before
    original answers were kept: re-run `regen select`).
    """
    orig = run.with_responses("original")
    files, prompts_manifest = _prompt_parts(run)
    fingerprint = hashlib.sha256(canonical_json(prompts_manifest["parts"]).encode()).hexdigest()[:16]
    old = read_json(orig.generations / "manifest.json")
    if old and old.get("prompts_fingerprint") == fingerprint and old.get("complete") \
            and all((orig.generations / p["path"]).is_file() for p in old.get("parts", [])):
        return old
    if int(prompts_manifest.get("schema_version") or 1) < 2 or any(
            "original_answers" not in pq.read_schema(f).names for f in files):
        raise InputError(f"{run.prompts}: the prompts were selected before original answers were kept (prompt schema "
                         f"v{prompts_manifest.get('schema_version') or 1}, v{PROMPT_SCHEMA_VERSION} needed): run "
                         f"`regen select --run {run.root}` again (prompt ids stay the same, generations are kept)")
    rows, without, num_prompts, with_original = [], Counter(), 0, 0
    for f in files:
        for prompt in pq.read_table(f, columns=list(PROMPT_COLUMNS)).to_pylist():
            num_prompts += 1
            made = original_rows(prompt)
            if made:
                with_original += 1
                rows.extend(made)
            else:
                without[prompt.get("source") or "unknown"] += 1
    rows.sort(key=lambda r: (r["prompt_id"], r["turn"]))
    for stale in orig.generations.glob("part-*.parquet"):
        stale.unlink()
    parts = [write_rows_atomic(rows[s:s + ROWS_PER_PART], orig.generations / f"part-{k:05d}.parquet",
                               GENERATION_SCHEMA)
             for k, s in enumerate(range(0, len(rows), ROWS_PER_PART))]
    manifest = {"stage": "originals", "parts": parts, "prompts_fingerprint": fingerprint, "num_prompts": num_prompts,
                "num_prompts_with_original": with_original, "num_rows": len(rows),
                "prompts_without_original": dict(sorted(without.items()))}
    # complete by construction: one row per (prompt, turn) with an original; the render stage's finished-generation
    # rule (regen.render.stage.generation_status) reads the same fields as for generations/
    units = {(r["prompt_id"], r["turn"]) for r in rows}
    manifest["accounting"] = {"prompts": with_original, "units": len(units), "generated": len(rows), "error": 0,
                              "skipped": 0, "rows": len(rows), "duplicates": len(rows) - len(units), "missing": 0,
                              "stray": 0, "balanced": len(rows) == len(units)}
    manifest["complete"] = manifest["accounting"]["balanced"]
    run.write_manifest(orig.generations, manifest)
    return manifest

