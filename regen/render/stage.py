"""`regen render`: generations -> response filters -> rendered, assistant-masked token shards.

Reads the generation parts listed in `generations/manifest.json` (else `generations/part-*.parquet`;
`schemas.generation.GENERATION_SCHEMA`, one row per (prompt_id, turn)).

1. `filter_responses`: every `ok` row is scored by each response filter of `render.filters`
   (`filters.response`); the first failing one (config order) drops it to `rejected/render/part-filter.parquet`.
   Scores of every filter are kept as columns in `shards/responses.parquet`; `shards/filters.json` records the
   counts and the input fingerprint + filter-config hash it was made with (a re-run with both equal is skipped).
2. `run_render`: the kept rows, per `turn_mode` (`per_turn`: every kept row; `conversation`: per prompt the
   kept row with the highest turn, i.e. the longest conversation), are rendered by `regen.render.rows`
   (checks, renderer, server ids, limits) into `shards/shard-*.parquet` (`regen.render.shards`). Row rejects go to
   `rejected/render/part-render-NNNNN.parquet`, one part per checkpoint.

Unfinished generation: `run_render` first checks that the generate stage finished
(`generation_status`): `generations/manifest.json` exists with `complete: true` and a balanced `accounting`
(every (prompt, turn) unit has exactly one row: no missing, duplicate or stray row), and no journal holds rows
not yet in a part. Otherwise it raises InputError naming what is missing and how to proceed (rerun
`regen generate`), unless `allow_incomplete=True` (CLI `--allow-incomplete`): then it renders what is there and
the shards manifest records it under `generations` (`complete: false`, `allowed_incomplete: true`, the problems).

Order and resume: files in name order, rows of a file sorted by (prompt_id, turn, request_key). At every
checkpoint (a shard closes, or 10,000 rejects are pending, or the end) the shard, the rejects part and the
manifest (with a cursor: file index + rows consumed) are written atomically. A re-run with the same contract,
config and input continues after the cursor; identical samples (same sample_id) are written once. Same input
and config give the same shards, byte for byte.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from regen.config.render import RenderConfig
from regen.errors import InputError
from regen.generate.ledger import check_parts  # generate's public check of its parts
from regen.render.rows import Reject, RowRenderer
from regen.render.shards import MANIFEST_SCHEMA, ShardWriter, contract_hash, manifest_totals, training_contract
from regen.rundir import RunDir
from schemas.io import read_json, write_json_atomic, write_rows_atomic
from schemas.rejected import REJECTED_SCHEMA, RejectedRecord
from schemas.shard import SCHEMA_VERSION

STAGE = "render"
PENDING_REJECTS_CHECKPOINT = 10_000
PAYLOAD_FIELDS = ("finish_reason", "content", "reasoning_content", "tool_calls", "num_completion_tokens")


def make_renderer(cfg: RenderConfig):
    """The renderer of a render config: `kimi-k3` (KimiK3Renderer, test vocabulary when `tokenizer` is null) or
    `hf` (HFTemplateRenderer on the local `tokenizer` directory). Raises InputError for a missing directory."""
    from regen.config import resolve_path

    path = resolve_path(cfg.tokenizer) if cfg.tokenizer else None
    if path is not None and "${" in str(path):
        raise InputError(f"render.tokenizer {cfg.tokenizer!r}: the environment variable is not set; export it or "
                         f"pass --set render.tokenizer=/path/to/tokenizer")
    if cfg.renderer == "kimi-k3":
        from regen.render.kimi_k3.renderer import KimiK3Renderer

        return KimiK3Renderer(str(path) if path else None, mask_policy=cfg.mask_policy)
    from regen.render.hf_template import HFTemplateRenderer

    if path is None:
        raise InputError("render.renderer=hf needs render.tokenizer: a local directory with tokenizer.json and a "
                         "chat template (e.g. data/models/gemma3-270m)")
    return HFTemplateRenderer(path, mask=cfg.hf_mask)


def prompt_control_tokens(cfg: RenderConfig) -> tuple[str, ...]:
    """The strings the select stage rejects in prompt text for this render config (so no request is sent for such a
    prompt): the ones the renderer's tokenizer would parse as control tokens wherever they stand
    (`Renderer.text_control_tokens`: an hf tokenizer's special tokens, e.g. `<|im_end|>`), under `render.control_tokens:
    reject`. () for `keep` and for kimi-k3 (it encodes message text as text; nothing is loaded then). Raises InputError
    when the hf tokenizer does not load (`make_renderer`)."""
    if cfg.control_tokens == "keep" or cfg.renderer == "kimi-k3":
        return ()
    return tuple(make_renderer(cfg).text_control_tokens)


def sample_prompt_side(renderer, messages: list[dict], tools: list[dict] | None = None,
                       template_kwargs: dict | None = None) -> tuple[int, int]:
    """(prompt-side tokens, history tokens) of the shard row this stage writes for an assistant turn generated
    after `messages` (OpenAI-style dicts, ending with a user or tool message), counted before the answer exists.

    prompt-side = the row's num_tokens - num_loss_tokens: the generation prompt of `messages` tokenized alone plus
    the template's closing tail after the answer (`rows.RowRenderer.sample`, `render(..., last_only=True)`; the
    answer's own ids never change these). history = the supervised-span tokens of the assistant
    messages inside `messages` (a full render's `assistant_spans`): the part a regenerated history replaces; 0
    where the template does not render that history prefix-stably. Raises ValueError when `messages` do not render.
    """
    kwargs = dict(template_kwargs or {}, add_generation_prompt=False)
    conversation = list(messages) + [{"role": "assistant", "content": ""}]
    sample = renderer.render(conversation, tools, **RowRenderer.render_options, **kwargs)
    start, end = sample.assistant_spans[-1]
    try:
        spans = renderer.render(conversation, tools, **kwargs).assistant_spans[:-1]
    except ValueError:  # e.g. an HF template that rewrites earlier turns (TemplateNotPrefixStable)
        spans = []
    return start + len(sample.input_ids) - end, sum(e - s for s, e in spans)


# -- inputs ---------------------------------------------------------------------------------------------------

def generation_files(run: RunDir) -> list[Path]:
    """The generation parts, in name order: those listed in `generations/manifest.json` ("parts": [{path}])
    when it lists them (a reader trusts the manifest), else `part-*.parquet`. Every part the generate ledger
    lists is verified first (size, sha256, Parquet footer, row count: `regen.generate.ledger.check_parts`).
    Raises InputError when none, or naming every damaged part and the `regen generate --repair` that fixes it."""
    check_parts(run.generations, run.root)
    manifest = run.manifest(run.generations) or {}
    listed = manifest.get("parts") if isinstance(manifest.get("parts"), list) else None
    if listed:
        files = sorted(run.generations / p["path"] for p in listed)
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise InputError(f"{run.generations}/manifest.json lists {missing} but they are missing; re-run "
                             f"`regen generate --run {run.root}`")
    else:
        files = sorted(run.generations.glob("part-*.parquet"))
    if not files:
        raise InputError(f"{run.generations}: no part-*.parquet; run `regen generate --run {run.root}` first")
    return files


def generation_status(run: RunDir) -> dict:
    """Whether the generate stage finished: {"complete": bool, "problems": [str], "accounting": dict | None}.

    Complete: `generations/manifest.json` exists, says `complete: true` and `accounting.balanced: true`, and no
    non-empty `journal-*.jsonl` is left (rows recorded but not yet in a part: a session running or killed)."""
    gen = run.generations
    manifest = run.manifest(gen)
    problems: list[str] = []
    acc = (manifest or {}).get("accounting") if isinstance((manifest or {}).get("accounting"), dict) else None
    if not manifest:
        problems.append(f"{gen}/manifest.json is missing: `regen generate` has not finished on this run (it writes "
                        "the manifest last)")
    else:
        if acc is None or not acc.get("balanced"):
            detail = ", ".join(f"{k} {acc[k]}" for k in ("missing", "duplicates", "stray") if (acc or {}).get(k))
            problems.append(f"{gen}/manifest.json: accounting is not balanced ({detail or 'no accounting recorded'})")
        if manifest.get("complete") is not True and (acc or {}).get("balanced"):
            problems.append(f"{gen}/manifest.json: complete is {manifest.get('complete')!r}")
    journals = [j.name for j in sorted(gen.glob("journal-*.jsonl")) if j.stat().st_size > 0]
    if journals:
        problems.append(f"{gen}: {journals} hold rows not yet in a part (a generate session is running or was "
                        "killed)")
    return {"complete": not problems, "problems": problems, "accounting": acc}


def require_finished_generation(run: RunDir, allow_incomplete: bool = False) -> dict:
    """`generation_status(run)`, or InputError when it is incomplete and `allow_incomplete` is False."""
    status = generation_status(run)
    if not status["complete"] and not allow_incomplete:
        raise InputError(
            "the generate stage of this run is unfinished: " + "; ".join(status["problems"]) + ". Rerun "
            f"`regen generate --run {run.root}` until it exits 0 (recorded rows are not requested again), or pass "
            "--allow-incomplete to render what is there (the shards manifest records that it is incomplete)")
    return status


def input_fingerprint(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}|{f.stat().st_size}|{pq.ParquetFile(f).metadata.num_rows}\n".encode())
    return h.hexdigest()[:16]


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _progress(enabled: bool, description: str, total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeRemainingColumn(), disable=not enabled)
    task = progress.add_task(description, total=total, info="")
    return progress, task


def _payload(row: dict) -> str:
    return json.dumps({k: row.get(k) for k in PAYLOAD_FIELDS}, ensure_ascii=False, default=str)


def _reject_row(row: dict, file: Path, index: int, filter: str, reason: str, score=None, sample_id=None) -> dict:
    return RejectedRecord(stage=STAGE, filter=filter, reason=reason, score=score, source="generations",
                          source_file=file.name, source_row=index, prompt_id=row.get("prompt_id"),
                          sample_id=sample_id, turn=row.get("turn"), category=row.get("category"),
                          payload=_payload(row)).to_arrow_row()


# Columns the filters read (token id lists are replaced by their lengths) and the columns rendering reads.
FILTER_COLUMNS = ("request_key", "prompt_id", "turn", "status", "category", "language", "messages", "content",
                  "reasoning_content", "tool_calls", "finish_reason", "num_prompt_tokens", "num_completion_tokens")
RENDER_COLUMNS = FILTER_COLUMNS + ("tools", "request_params", "prompt_token_ids", "completion_token_ids")


def _read(path: Path, columns: tuple[str, ...]) -> pa.Table:
    names = set(pq.read_schema(path).names)
    return pq.read_table(path, columns=[c for c in columns if c in names])


def _filter_table(path: Path) -> pa.Table:
    """The filter columns; where the server returned ids, their lengths replace the usage token counts."""
    import pyarrow.compute as pc

    table = _read(path, FILTER_COLUMNS)
    ids = _read(path, ("prompt_token_ids", "completion_token_ids"))
    for ids_name, count_name in (("prompt_token_ids", "num_prompt_tokens"), ("completion_token_ids", "num_completion_tokens")):
        if ids_name in ids.column_names and count_name in table.column_names:
            lengths = pc.list_value_length(ids.column(ids_name)).cast(pa.int32())
            merged = pc.if_else(pc.is_null(lengths), table.column(count_name), lengths)
            table = table.set_column(table.column_names.index(count_name), count_name, merged)
    return table


def _sorted_rows(path: Path, table: pa.Table | None = None) -> list[tuple[int, dict]]:
    """(row index in file, row) of one generations file, sorted by (prompt_id, turn, request_key)."""
    rows = (table if table is not None else _read(path, RENDER_COLUMNS)).to_pylist()
    order = sorted(range(len(rows)), key=lambda i: (rows[i].get("prompt_id") or "", rows[i].get("turn") or 0,
                                                    rows[i].get("request_key") or ""))
    return [(i, rows[i]) for i in order]


# -- 1. response filters --------------------------------------------------------------------------------------

def _filter_settings(cfg: RenderConfig) -> tuple[list[str], dict]:
    names = [n for n in cfg.filters if not (n == "over_long" and cfg.overlong == "cut")]
    params = cfg.filter_params.model_dump()
    params["max_tokens"] = params["max_tokens"] or cfg.max_tokens
    return names, params


def filter_responses(cfg: RenderConfig, run: RunDir, *, progress: bool = True,
                     files: list[Path] | None = None) -> dict:
    """Score every `ok` generation with the response filters; drops go to `rejected/render/part-filter.parquet`.

    Returns the summary written to `shards/filters.json`: {input_fingerprint, filters_hash, counts: {rows,
    ok, error, skipped, kept, dropped: {filter: n}}}. Skipped (returns the existing summary) when the input
    and filter config are unchanged. Raises InputError when there are no generation files. `files`: the
    verified `generation_files(run)` when the caller already has them (each call checksums every part).
    """
    from filters.response import make_response_filters

    files = generation_files(run) if files is None else files
    names, params = _filter_settings(cfg)
    fingerprint, fhash = input_fingerprint(files), _hash([names, params])
    summary_path = run.shards / "filters.json"
    old = read_json(summary_path)
    if old and old.get("input_fingerprint") == fingerprint and old.get("filters_hash") == fhash \
            and (run.shards / "responses.parquet").exists():
        return old
    filters = make_response_filters(names, params)
    counts: Counter = Counter()
    dropped: Counter = Counter()
    decisions, rejects = [], []
    total = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    bar, task = _progress(progress, "filter responses", total)
    with bar:
        for f in files:
            for index, row in _sorted_rows(f, _filter_table(f)):
                counts["rows"] += 1
                counts[row.get("status") or "unknown"] += 1
                bar.advance(task)
                if row.get("status") != "ok":
                    continue
                ds = [flt(row) for flt in filters]
                failed = next((d for d in ds if not d.keep), None)
                decisions.append({"request_key": row.get("request_key"), "prompt_id": row.get("prompt_id"),
                                  "turn": row.get("turn"), "keep": failed is None,
                                  "filter": failed.filter if failed else None,
                                  "reason": failed.reason if failed else None,
                                  **{f"score_{d.filter}": d.score for d in ds}})
                if failed is None:
                    counts["kept"] += 1
                else:
                    dropped[failed.filter] += 1
                    rejects.append(_reject_row(row, f, index, failed.filter, failed.reason, failed.score))
    schema = pa.schema([("request_key", pa.string()), ("prompt_id", pa.string()), ("turn", pa.int32()),
                        ("keep", pa.bool_()), ("filter", pa.string()), ("reason", pa.string())]
                       + [(f"score_{n}", pa.float64()) for n in names])
    write_rows_atomic(decisions, run.shards / "responses.parquet", schema)
    write_rows_atomic(rejects, run.rejected(STAGE) / "part-filter.parquet", REJECTED_SCHEMA)
    summary = {"input_fingerprint": fingerprint, "filters_hash": fhash, "filters": names, "params": params,
               "counts": {**{k: counts[k] for k in ("rows", "ok", "error", "skipped", "kept")},
                          "dropped": dict(sorted(dropped.items()))}}
    write_json_atomic(summary, summary_path)
    return summary


# -- 2. render ------------------------------------------------------------------------------------------------

def _selected_keys(run: RunDir, turn_mode: str) -> set[str]:
    table = pq.read_table(run.shards / "responses.parquet", columns=["request_key", "prompt_id", "turn", "keep"])
    kept = [r for r in table.to_pylist() if r["keep"]]
    if turn_mode == "per_turn":
        return {r["request_key"] for r in kept}
    best: dict[str, dict] = {}
    for r in kept:
        b = best.get(r["prompt_id"])
        if b is None or (r["turn"], r["request_key"]) > (b["turn"], b["request_key"]):
            best[r["prompt_id"]] = r
    return {r["request_key"] for r in best.values()}


def _clear_outputs(run: RunDir) -> None:
    for p in list(run.shards.glob("shard-*.parquet")) + list(run.rejected(STAGE).glob("part-render-*.parquet")):
        p.unlink()
    (run.shards / "manifest.json").unlink(missing_ok=True)


def run_render(cfg: RenderConfig, run: RunDir, *, progress: bool = True, force: bool = False,
               allow_incomplete: bool = False) -> dict:
    """`_run_render` holding the lease of its shards directory (`regen.rundir.Lease`: LeaseHeld when another `regen
    render` writes them)."""
    from regen.rundir import Lease

    with Lease(run.root, "render", name=f"render-{run.shards.name}"):
        return _run_render(cfg, run, progress=progress, force=force, allow_incomplete=allow_incomplete)


def _run_render(cfg: RenderConfig, run: RunDir, *, progress: bool = True, force: bool = False,
                allow_incomplete: bool = False) -> dict:
    """Render the kept generations into shards; returns the shards manifest (also `shards/manifest.json`).

    Calls `filter_responses` first when its summary is missing or stale. Resumable (see module doc); `force`
    starts over. Raises InputError for an unfinished generate stage (unless `allow_incomplete`; see module doc),
    missing inputs or a bad tokenizer directory.
    """
    status = require_finished_generation(run, allow_incomplete)
    generations = {"complete": status["complete"], "allowed_incomplete": not status["complete"],
                   "problems": status["problems"]}
    files = generation_files(run)  # verified once (sha256 of every part), then passed on
    filter_summary = filter_responses(cfg, run, progress=progress, files=files)
    renderer = make_renderer(cfg)
    contract = training_contract(renderer, max_tokens=cfg.max_tokens, turn_mode=cfg.turn_mode,
                                 min_loss_tokens=cfg.min_loss_tokens, template_kwargs=cfg.template_kwargs,
                                 overlong=cfg.overlong, on_drift=cfg.on_drift)
    chash, cfg_hash = contract_hash(contract), _hash(cfg.model_dump())
    fingerprint = filter_summary["input_fingerprint"]
    manifest = run.manifest(run.shards)
    same = bool(manifest) and manifest.get("contract_hash") == chash and manifest.get("config_hash") == cfg_hash \
        and (manifest.get("input") or {}).get("fingerprint") == fingerprint \
        and (manifest.get("generations") or {}).get("complete") == generations["complete"]
    if same and manifest.get("complete") and not force:
        return manifest
    if not same or force:
        _clear_outputs(run)
        manifest = None
    state = _State(run, cfg, contract, chash, cfg_hash, fingerprint, filter_summary, manifest, files)
    state.base["generations"] = generations
    rows_renderer = RowRenderer(renderer, cfg, chash)
    state.restore_counters(rows_renderer)
    selected = _selected_keys(run, cfg.turn_mode)
    total = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    bar, task = _progress(progress, "render", total)
    started = time.perf_counter()
    with bar:
        for fi, f in enumerate(files):
            if fi < state.cursor["file"]:
                bar.advance(task, pq.ParquetFile(f).metadata.num_rows)
                continue
            rows = _sorted_rows(f)
            skip = state.cursor["row"] if fi == state.cursor["file"] else 0
            bar.advance(task, skip)
            for pos in range(skip, len(rows)):
                index, row = rows[pos]
                bar.advance(task)
                state.position = {"file": fi, "row": pos + 1}
                if row.get("status") != "ok" or row.get("request_key") not in selected:
                    continue
                state.counts["rendered"] += 1
                before = rows_renderer.snapshot()
                closed = None
                try:
                    sample = rows_renderer.sample(row)
                except Reject as r:
                    state.reject(_reject_row(row, f, index, r.filter, r.reason, r.score))
                    sample = None
                if sample is not None and sample["sample_id"] in state.seen:
                    state.counts["duplicates"] += 1
                    sample = None
                if sample is not None:
                    state.seen.add(sample["sample_id"])
                    if not state.writer.fits(sample):  # close the shard first: the cursor is the row before
                        state.position = {"file": fi, "row": pos}
                        state.counts["rendered"] -= 1
                        state.checkpoint(rows_renderer, None, counters=before)
                        state.counts["rendered"] += 1
                        state.position = {"file": fi, "row": pos + 1}
                    closed = state.writer.add(sample)
                if closed or len(state.pending_rejects) >= PENDING_REJECTS_CHECKPOINT:
                    state.checkpoint(rows_renderer, closed)
                    bar.update(task, info=f"{state.totals()['num_rows']} rows")
            state.position = {"file": fi + 1, "row": 0}
    state.elapsed_s += time.perf_counter() - started
    return state.checkpoint(rows_renderer, None, final=True)


class _State:
    """Manifest, counters, pending rejects and the shard writer of one render run (resumed from a manifest)."""

    def __init__(self, run, cfg, contract, chash, cfg_hash, fingerprint, filter_summary, manifest, files):
        self.run, self.cfg = run, cfg
        m = manifest or {}
        self.entries: list[dict] = list(m.get("shards", []))
        self.cursor = m.get("cursor", {"file": 0, "row": 0})
        self.position = dict(self.cursor)
        self.checkpoint_index = m.get("checkpoint", 0)
        self.counts = Counter(m.get("counts", {}))
        self.rejected = Counter(m.get("rejected", {}))
        self.elapsed_s = m.get("elapsed_s", 0.0)
        self._saved = m
        self.base = {"schema": MANIFEST_SCHEMA, "schema_version": SCHEMA_VERSION, "contract": contract,
                     "contract_hash": chash, "config_hash": cfg_hash,
                     "input": {"fingerprint": fingerprint, "files": [p.name for p in files]},
                     "filters": filter_summary["counts"]}
        for p in run.shards.glob("shard-*.parquet"):  # shards of a crashed checkpoint were never listed
            if p.name not in {e["path"] for e in self.entries}:
                p.unlink()
        for p in run.rejected(STAGE).glob("part-render-*.parquet"):
            if int(p.stem.rsplit("-", 1)[1]) >= self.checkpoint_index:
                p.unlink()
        self.seen: set[str] = set()
        for e in self.entries:
            self.seen.update(pq.read_table(run.shards / e["path"], columns=["sample_id"]).column(0).to_pylist())
        next_index = max((int(e["path"][6:11]) for e in self.entries), default=-1) + 1
        self.writer = ShardWriter(run.shards, max_rows=cfg.shard_max_rows, max_tokens=cfg.shard_max_tokens,
                                  next_index=next_index)
        self.pending_rejects: list[dict] = []

    def restore_counters(self, rr: RowRenderer) -> None:
        rr.counts.update(self._saved.get("row_counts", {}))
        d = self._saved.get("drift")
        if d:
            rr.drift["rows_checked"], rr.drift["rows_drifted"] = d["rows_checked"], d["rows_drifted"]
            rr.drift["causes"].update(d["causes"])

    def reject(self, row: dict) -> None:
        self.pending_rejects.append(row)
        self.rejected[row["filter"]] += 1

    def totals(self) -> dict:
        return manifest_totals(self.entries)

    def checkpoint(self, rr: RowRenderer, closed: dict | None, final: bool = False, counters: dict | None = None) -> dict:
        """Write the open shard (unless `closed` was just written), pending rejects and the manifest with the
        cursor. `counters`: the row renderer's counters to record (a snapshot from before the current row)."""
        if final or not closed:
            closed = self.writer.flush() or closed
        if closed:
            self.entries.append(closed)
        if self.pending_rejects:
            write_rows_atomic(self.pending_rejects, self.run.rejected(STAGE) / f"part-render-{self.checkpoint_index:05d}.parquet",
                              REJECTED_SCHEMA)
            self.pending_rejects = []
        self.checkpoint_index += 1
        self.cursor = dict(self.position)
        c = counters or rr.snapshot()
        checked = c["drift"]["rows_checked"]
        manifest = {
            **self.base, "status": "complete" if final else "running", "complete": final,
            **self.totals(), "shards": self.entries, "checkpoint": self.checkpoint_index, "cursor": self.cursor,
            "counts": dict(self.counts), "rejected": dict(sorted(self.rejected.items())),
            "row_counts": c["row_counts"],
            "drift": {"rows_checked": checked, "rows_drifted": c["drift"]["rows_drifted"],
                      "rate": c["drift"]["rows_drifted"] / checked if checked else 0.0,
                      "causes": dict(sorted(c["drift"]["causes"].items())), "policy": self.cfg.on_drift},
            "elapsed_s": round(self.elapsed_s, 3),
        }
        self.run.write_manifest(self.run.shards, manifest)
        return manifest


# -- CLI ------------------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    from regen.config import add_profile_arguments, add_responses_argument

    add_profile_arguments(parser)
    add_responses_argument(parser, "the answers to render (original: the prompts' original_answers -> originals/)")
    parser.add_argument("--filters-only", action="store_true", help="run the response filters only")
    parser.add_argument("--force", action="store_true", help="render again from scratch")
    parser.add_argument("--allow-incomplete", action="store_true",
                        help="render although the generate stage is unfinished (recorded in shards/manifest.json)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args) -> int:
    from regen.config import load_profile_from_args

    profile, run = load_profile_from_args(args)
    cfg = profile.render
    if run.responses == "original":  # the original answers become generation rows first (regen.render.originals)
        from regen.render.originals import write_original_generations

        made = write_original_generations(run)
        print(f"original answers: {made['num_prompts_with_original']} of {made['num_prompts']} prompts "
              f"({made['num_rows']} turns); prompts without one, per source: {made['prompts_without_original']}")
        if not made["num_rows"]:
            raise InputError(f"none of the prompts of {run.prompts} has the source's own answer: select sources "
                             "that ship answers (gsm8k, MATH, MBPP, GPTeacher, ShareGPT conversations, ...)")
    require_finished_generation(run, args.allow_incomplete)
    if args.filters_only:
        summary = filter_responses(cfg, run, progress=not args.no_progress)
        print(json.dumps(summary["counts"], indent=2))
        return 0
    m = run_render(cfg, run, progress=not args.no_progress, force=args.force, allow_incomplete=args.allow_incomplete)
    if not m["generations"]["complete"]:
        print("regen render: warning: rendered an UNFINISHED generate stage (--allow-incomplete): "
              + "; ".join(m["generations"]["problems"]), file=sys.stderr)
    _print_summary(m, run)
    return 0


def _print_summary(m: dict, run: RunDir) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"regen render -> {run.shards}")
    t.add_column("what")
    t.add_column("value", justify="right")
    f = m.get("filters", {})
    t.add_row("generations ok / error / skipped", f"{f.get('ok', 0)} / {f.get('error', 0)} / {f.get('skipped', 0)}")
    for name, n in f.get("dropped", {}).items():
        t.add_row(f"  dropped by filter {name}", str(n))
    t.add_row("rendered", str(m["counts"].get("rendered", 0)))
    for name, n in m.get("rejected", {}).items():
        t.add_row(f"  rejected: {name}", str(n))
    t.add_row("duplicates", str(m["counts"].get("duplicates", 0)))
    t.add_row("shards / rows", f"{m['num_shards']} / {m['num_rows']}")
    t.add_row("tokens / supervised", f"{m['num_tokens']} / {m['num_loss_tokens']}")
    d = m["drift"]
    t.add_row("prompt drift (rows checked)", f"{d['rate']:.2%} ({d['rows_checked']}) {d['causes']}")
    t.add_row("contract", f"{m['contract']['renderer']} v{m['contract']['renderer_version']} "
                          f"{m['contract']['tokenizer_name']} {m['contract']['mask_policy']}")
    Console().print(t)
