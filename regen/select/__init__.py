"""Stage 1, select: prompt pools -> `prompts/part-*.parquet` (PROMPT_SCHEMA) + `rejected/select/`.

In:  the profile's `select.sources` (JSON, JSONL, Parquet, HF `save_to_disk` dirs; ShareGPT, OpenAI, kimi-mtp
     and benchmark row shapes).
Out: a deduplicated, filtered, seeded selection in the requested category mix, every drop with its reason,
     and `prompts/manifest.json` (accounting per file: selected + rejected + not selected == read).

Modules, in reading order:
    sources.py   files -> batches of raw rows -> normalized prompt drafts (or parse rejects)
    strict_json.py  JSON that refuses a key given twice, at any depth
    shapes.py    row shapes -> OpenAI-style `messages` + `tools`
    conversation.py  one conversation being built: unique call ids, tool results linked by id, name, order
    kimi_text.py Kimi-K2 markers written as text -> tool_calls / tool messages; declared or inferred tools
    tool_schemas.py  tool declarations (glaive, BFCL dialect, OpenAI) -> OpenAI `tools`
    originals.py the source's own answers beside the prompt (`original_answers`), or why there are none
    errors.py    RowError: a malformed row (a `parse` reject with the field and the reason); wrong_type
    classify.py  category and language: source labels, then config, then a classifier
    batches.py   the per-batch work (normalize, filter (+ control_tokens), sign for near dedup), in forkserver workers
    mix.py       the selection policy: per-category targets, caps, the seeded choice
    stage.py     the stage: exact + near dedup, the mix, outputs and manifest
    summary.py   what `regen select` prints when done: the mix, the accounting, the first reject per filter, notes
    preflight.py `check(cfg, rep)`: before a run, the sources and contamination files exist

Entry point: `regen.select.stage.run_select(cfg: SelectConfig, run: RunDir, *, seed)`; CLI `regen select`;
its check before a run: `regen.select.preflight.check(cfg, rep)`.
"""
