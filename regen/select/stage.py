"""`regen select`: a raw prompt pool -> a deduplicated, filtered, seeded selection in the requested mix.

Pipeline (one pass over the sources, streaming in `batch_rows` batches):
  1. read + normalize each row (`regen.select.sources`, `regen.select.shapes`), label category and language
     (`regen.select.classify`); malformed rows are rejects with filter `parse`
  2. row filters in config order (`filters.prompt`); exact dedup is stateful, first occurrence kept
  3. MinHash signatures of the survivors (`filters.dedup`), then near dedup over the whole pool
  4. selection (`plan_mix`, `select_rows`): per-source and per-language caps bound the eligible pool (rows
     beyond a cap, in seeded key order, are not eligible); each category gets round(total * share)
     (largest remainder); a category short of supply gives its shortfall to the others in proportion to
     their shares (`shortfall_policy: redistribute`; `report_only` leaves it unfilled). Within a category
     the rows with the smallest seeded keys (sha of seed + prompt_id) are taken: same seed, same prompt_id
     list; another seed, another sample in the same mix.
Outputs: `prompts/part-*.parquet` (PROMPT_SCHEMA, ordered by seeded key) + `prompts/manifest.json`,
`rejected/select/part-*.parquet` (REJECTED_SCHEMA). Accounting per source file:
input_rows = selected + rejected + not_selected, checked before the manifest is written.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from filters.dedup import near_duplicates
from filters.prompt import PROMPT_FILTERS, ContaminationIndex
from regen.config.select import SelectConfig, SourceConfig
from regen.errors import InputError
from regen.rundir import Lease, RunDir
from regen.select.batches import BatchRunner, payload
from regen.select.mix import assign_modes, largest_remainder, plan_mix, seeded_keys, select_rows  # noqa: F401 (re-exported)
from regen.select.sources import BadFile, benchmark_texts, iter_raw_batches, shape_of, source_files
from regen.select.summary import first_reject, print_mix  # noqa: F401 (print_mix re-exported)
from schemas.io import write_parquet_atomic, write_rows_atomic
from schemas.prompt import PROMPT_SCHEMA, SCHEMA_VERSION, canonical_json
from schemas.rejected import REJECTED_SCHEMA, RejectedRecord

STAGE = "select"
MANIFEST_SCHEMA = "regen.prompts.manifest"


# --------------------------------------------------------------------------------------------- writing


class RejectWriter:
    """Buffers rejected rows and writes `rejected/select/part-NNNNN.parquet` files atomically."""

    def __init__(self, directory: Path, flush_rows: int = 20_000):
        self.dir = directory
        self.rows: list[dict] = []
        self.parts: list[dict] = []
        self.flush_rows = flush_rows
        self.examples: dict[str, dict] = {}  # the first reject of each filter (manifest `reject_examples`)

    def add(self, rec: RejectedRecord) -> None:
        self.add_row(rec.to_arrow_row())

    def add_row(self, row: dict) -> None:
        """Add one REJECTED_SCHEMA row dict."""
        first_reject(self.examples, row)
        self.rows.append(row)
        if len(self.rows) >= self.flush_rows:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            name = f"part-{len(self.parts):05d}.parquet"
            self.parts.append(write_rows_atomic(self.rows, self.dir / name, REJECTED_SCHEMA))
            self.rows = []


_payload = payload


def _staging(final: Path) -> Path:
    """An empty `.<name>.new` folder beside `final`, where the new output is written before the swap."""
    tmp = final.parent / f".{final.name}.new"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _swap_in(new: Path, final: Path) -> None:
    """Replace `final` by the complete `new` folder: rename the old one aside, rename, then delete the old."""
    old = final.parent / f".{final.name}.old"
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(new, final)
    shutil.rmtree(old, ignore_errors=True)


def _warn(message: str) -> None:
    """A loud warning on stderr (also kept in the manifest's `warnings`)."""
    from rich.console import Console

    Console(stderr=True, soft_wrap=True).print(f"[bold red]WARNING[/] select: {message}", highlight=False)


def starved_categories(report: dict, cfg: SelectConfig) -> list[str]:
    """Warnings for categories of an explicit `cfg.mix` (and length bands of `cfg.band_shares`, summed over the
    categories) selected below `cfg.min_category_fill` x their target; with `on_category_shortfall: fail`, raises
    InputError instead (before anything is written)."""
    out = []
    for c, m in report["mix"].items():
        if cfg.mix.get(c, 0) > 0 and m["target"] > 0 and m["selected"] < cfg.min_category_fill * m["target"]:
            out.append(f"category {c!r} got {m['selected']:,} of its {m['target']:,} prompts "
                       f"({m['selected'] / m['target']:.0%} < min_category_fill {cfg.min_category_fill:.0%}; "
                       f"{m['available']:,} available after filters): check the sources and their category_map")
    bands: dict = {}  # a length band short of supply, summed over the categories (select.band_shares)
    for by_band in (report.get("bands") or {}).values():
        for b, m in by_band.items():
            t = bands.setdefault(b, {"target": 0, "selected": 0, "available": 0})
            for k in t:
                t[k] += m[k]
    for b, t in bands.items():
        if t["target"] > 0 and t["selected"] < cfg.min_category_fill * t["target"]:
            share = t["selected"] / t["target"]
            out.append(f"length band {b!r} got {t['selected']:,} of its {t['target']:,} prompts ({share:.0%} < "
                       f"min_category_fill {cfg.min_category_fill:.0%}; {t['available']:,} "
                       "available after filters; its shortfall went to the other bands): add longer prompts or "
                       "lower its share in select.band_shares")
    if out and cfg.on_category_shortfall == "fail":
        raise InputError("select: starved category quota (select.on_category_shortfall: fail): " + "; ".join(out)
                         + ". Add prompts of that category, lower its share in select.mix, or set "
                           "on_category_shortfall: warn")
    return out


def _check_bad_files(bad_files: dict[str, str], policy: str) -> None:
    if bad_files and policy == "fail":
        listed = "\n".join(f"  {f}: {why}" for f, why in sorted(bad_files.items()))
        raise InputError(f"select: {len(bad_files)} source file(s) cannot be read:\n{listed}\nFix or remove them, "
                         f"or pass --on-bad-file skip (select.on_bad_file) to select without them; nothing was "
                         f"written, the previous selection is unchanged")


def config_hash(cfg: SelectConfig, seed: int, extra: list[str], files: list[tuple[str, int, int]] = (),
                control_tokens=()) -> str:
    """Hash of what determines the selection: the select config, the seed, extra sources and the input files
    (path, size, mtime_ns), so a changed pool path or file is never mistaken for a finished run; and the
    renderer's control tokens when there are any (without them the hash is the one selections made before
    that check existed have, so those resume)."""
    payload = {"select": cfg.model_dump(), "seed": seed, "extra": extra, "files": [list(f) for f in files]}
    if control_tokens:
        payload["control_tokens"] = tokens_digest(control_tokens)
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:16]


def tokens_digest(tokens) -> str:
    return hashlib.sha256("\0".join(sorted(set(tokens))).encode()).hexdigest()[:16]


def _resumable(old: dict | None, chash: str, seed: int, run: RunDir) -> bool:
    return bool(old) and old.get("config_hash") == chash and old.get("seed") == seed \
        and old.get("schema_version") == SCHEMA_VERSION and all((run.prompts / p["path"]).exists()
                                                                for p in old.get("parts", []))


def _all_sources(cfg: SelectConfig, extra_sources: list[str] | None) -> list[SourceConfig]:
    sources = list(cfg.sources)
    names = {s.name for s in sources}
    for p in extra_sources or []:
        path = Path(p).resolve()
        name = path.stem or str(path)
        while name in names:
            name += "_"
        names.add(name)
        sources.append(SourceConfig(name=name, path=str(path)))
    if not sources:
        raise InputError("select: no sources; add select.sources to the profile or pass --source PATH")
    return sources


def _file_rows(path: str, kind: str) -> int | None:
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except (OSError, ValueError):  # a damaged file: reading it names it as a bad file
            return None
    return None


def run_select(cfg: SelectConfig, run: RunDir, **kwargs) -> dict:
    """`_run_select` holding the run's lease (`regen.rundir.Lease`: LeaseHeld beside another select or a generate)."""
    with Lease(run.root, "select", exclude="generate*"):
        return _run_select(cfg, run, **kwargs)


def _run_select(cfg: SelectConfig, run: RunDir, *, seed: int, extra_sources: list[str] | None = None,
                progress: bool = True, control_tokens=()) -> dict:
    """Select prompts into `run.prompts` (parts + manifest.json) and `run.rejected("select")`; returns the manifest.

    `control_tokens`: strings the profile's renderer would parse as control tokens in prompt text
    (`regen.render.stage.prompt_control_tokens`); a prompt holding one is a reject (filter `control_tokens`).
    Resumable: an existing manifest with the same config hash and seed is returned as is; a selection made before
    the control-token check existed resumes too, recorded as not checked (render rejects such rows).
    Raises InputError for a missing source path or an unrecognized file shape.
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    extra = [str(Path(p).resolve()) for p in extra_sources or []]
    sources = _all_sources(cfg, extra)
    files = [(src, path, kind) for src in sources for path, kind in source_files(src)]
    stats = [(path, _size(path), Path(path).stat().st_mtime_ns) for _, path, _ in files]
    control_tokens = tuple(control_tokens or ())
    chash = config_hash(cfg, seed, extra, stats, control_tokens)
    old = run.manifest(run.prompts)
    if _resumable(old, chash, seed, run):
        return old
    legacy = old is not None and (old.get("control_tokens") or {"legacy": True}).get("legacy")
    if legacy and _resumable(old, config_hash(cfg, seed, extra, stats), seed, run):
        if "control_tokens" not in old:  # recorded once: the policy at its value now, not applied to these prompts
            old["control_tokens"] = {"num_tokens": len(control_tokens), "sha256": tokens_digest(control_tokens),
                                     "applied": False, "legacy": True, "note": "selected before the control-token "
                                     "check existed: these prompts were not checked (render rejects rows holding "
                                     "them; select into a new --run to apply it here)"}
            run.write_manifest(run.prompts, old)
        return old
    t0 = time.time()
    # The new selection is written beside the old one and swapped in only when complete (`_swap_in`): a run
    # that fails on the way leaves the previous selection as it was.
    out_dir, rej_dir = _staging(run.prompts), _staging(run.rejected(STAGE))

    index = None
    if "contamination" in cfg.filters and cfg.contamination_files:
        from regen.config import resolve_path

        texts = [t for f in cfg.contamination_files for t in benchmark_texts(str(resolve_path(f)))]
        index = ContaminationIndex(texts, cfg.contamination_ngram)
    exact = PROMPT_FILTERS["exact_dedup"].from_config(cfg) if "exact_dedup" in cfg.filters else None
    near = PROMPT_FILTERS["near_dedup"].from_config(cfg) if "near_dedup" in cfg.filters else None
    rejects = RejectWriter(rej_dir)
    acct: dict[str, dict] = {}
    drops: Counter = Counter()
    tables: list[pa.Table] = []
    sigs: list[np.ndarray] = []
    total_bytes = sum(_size(p) for _, p, _ in files)
    bad_files: dict[str, str] = {}
    notes: dict[str, list[str]] = {}  # per input file, what reading it changed (a stripped byte-order mark)

    def jobs():
        """(progress step in bytes, job) for every batch of every file, reading in the main process."""
        for src, path, kind in files:
            size, done, num_batches = _size(path), 0.0, 0
            try:
                known = _file_rows(path, kind)
                if kind != "hf":  # an empty file is still accounted for (0 rows)
                    _acct(acct, path, src.name, None)
                shape = fmap = None
                for sfile, start, rows in iter_raw_batches(path, kind, cfg.batch_rows, src.fields, src.max_rows,
                                                           notes):
                    if shape is None:
                        shape, fmap = shape_of(sfile, rows, src.fields)
                    _acct(acct, sfile, src.name, shape)
                    step = size * len(rows) / known if known else 0.0
                    done += step
                    num_batches += 1
                    yield step, (src, sfile, start, rows, shape, fmap)
            except BadFile as exc:  # the file-level policy: every bad file is named, then fail or skip
                bad_files[path] = exc.reason
                if not num_batches:  # rows of a Parquet file read before its damage stay accounted for
                    acct.pop(path, None)
            if size - done > 0:
                yield size - done, None

    runner = BatchRunner(cfg.workers, cfg, index, control_tokens)
    with Progress(TextColumn("[bold]select"), BarColumn(), TextColumn("{task.fields[rows]:,} rows"),
                  TextColumn("{task.description}"), TimeElapsedColumn(), disable=not progress, transient=True) as bar:
        task = bar.add_task("", total=max(total_bytes, 1), rows=0)
        num_rows = 0
        try:
            for step, res in runner.map(jobs()):
                if res is not None:
                    num_rows += res.num_rows
                    _merge(res, acct, drops, rejects, exact, tables, sigs)
                bar.update(task, advance=step, rows=num_rows,
                           description=Path(res.source_file).name if res is not None else "")
        except BaseException:
            runner.close(error=True)
            raise
        runner.close()
        pool = with_bands(pa.concat_tables(tables) if tables else PROMPT_SCHEMA.empty_table(), cfg)
        del tables
        keep = np.ones(pool.num_rows, dtype=bool)
        if near is not None and pool.num_rows > 1:
            bar.update(task, description="near dedup")
            keep = _near_dedup(pool, _stack(sigs, cfg.num_perm), near, rejects, acct, drops)
        sigs.clear()
        bar.update(task, description="selecting")
        chosen, report = select_rows(pool, cfg, seed, keep)
    _check_bad_files(bad_files, cfg.on_bad_file)
    warnings = [f"source file skipped (on_bad_file: skip): {f}: {why}" for f, why in sorted(bad_files.items())]
    warnings += starved_categories(report, cfg)
    selected = pool.take(pa.array(chosen, type=pa.int64())) if len(chosen) else PROMPT_SCHEMA.empty_table()
    selected = with_modes(selected, cfg, seed)
    sel_files = Counter(selected.column("source_file").to_pylist())
    pool_files = Counter(pool.filter(pa.array(keep)).column("source_file").to_pylist())
    for f, a in acct.items():
        a["selected"] = sel_files.get(f, 0)
        a["not_selected"] = pool_files.get(f, 0) - a["selected"]
    rejects.flush()
    parts = []
    for k, s in enumerate(range(0, max(selected.num_rows, 1), cfg.rows_per_part)):
        parts.append(write_parquet_atomic(selected.slice(s, cfg.rows_per_part), out_dir / f"part-{k:05d}.parquet",
                                          PROMPT_SCHEMA))
    manifest = _manifest(cfg, seed, extra, chash, selected, report, drops, acct, parts, rejects.parts, int(keep.sum()))
    manifest.update(bad_files=bad_files, warnings=warnings, input_notes=notes, reject_examples=rejects.examples,
                    num_tools_inferred=int(pc.sum(selected.column("tools_inferred")).as_py() or 0),
                    control_tokens={"num_tokens": len(control_tokens), "sha256": tokens_digest(control_tokens),
                                    "applied": bool(control_tokens), "rejected": int(drops.get("control_tokens", 0))})
    if control_tokens:
        manifest["filters"]["control_tokens"] = int(drops.get("control_tokens", 0))
    manifest["elapsed_s"] = round(time.time() - t0, 3)
    run.write_manifest(out_dir, manifest)
    _swap_in(rej_dir, run.rejected(STAGE))
    _swap_in(out_dir, run.prompts)
    for w in warnings:
        _warn(w)
    return manifest


def with_bands(table: pa.Table, cfg: SelectConfig) -> pa.Table:
    """`table` (PROMPT_SCHEMA) with `length_band` set from `num_prompt_tokens` (`SelectConfig.band_of`); null
    without `select.length_bands`."""
    bands = [cfg.band_of(int(n or 0)) for n in table.column("num_prompt_tokens").to_pylist()] \
        if cfg.length_bands else [None] * table.num_rows
    i = table.schema.get_field_index("length_band")
    return table.set_column(i, "length_band", pa.array(bands, type=pa.string()))


def with_modes(table: pa.Table, cfg: SelectConfig, seed: int) -> pa.Table:
    """`table` (the selection) with `mode` assigned per category x band cell (`assign_modes`); null without
    `select.modes`."""
    modes = assign_modes(table.column("prompt_id").to_pylist(), table.column("category").to_pylist(),
                         table.column("length_band").to_pylist(), cfg.modes, seed) \
        if cfg.modes else [None] * table.num_rows
    i = table.schema.get_field_index("mode")
    return table.set_column(i, "mode", pa.array(modes, type=pa.string()))


def _acct(acct: dict, name: str, source: str, shape: str | None) -> dict:
    a = acct.setdefault(name, {"source": source, "shape": shape, "input_rows": 0, "selected": 0, "rejected": 0,
                               "not_selected": 0})
    a["shape"] = a["shape"] or shape
    return a


def _merge(res, acct: dict, drops: Counter, rejects: "RejectWriter", exact, tables: list, sigs: list) -> None:
    """Fold one BatchResult into the run: accounting, rejects, then exact dedup (stateful, stream order)."""
    a = acct[res.source_file]
    a["input_rows"] += res.num_rows
    a["rejected"] += len(res.rejects)
    drops.update(res.drops)
    for row in res.rejects:
        rejects.add_row(row)
    if res.table is None:
        return
    table, batch_sigs = res.table, res.sigs
    if exact is not None:
        ids = table.column("prompt_id").to_pylist()
        mask = np.ones(len(ids), dtype=bool)
        reasons = {}
        for i, (pid, norm) in enumerate(zip(ids, res.norms)):
            dec = exact(_Row(pid, norm))
            if not dec.keep:
                mask[i] = False
                reasons[i] = dec
        if reasons:
            dup = table.take(pa.array(sorted(reasons), type=pa.int64())).to_pylist()
            for i, row in zip(sorted(reasons), dup):
                dec = reasons[i]
                rejects.add(RejectedRecord(stage=STAGE, filter=exact.name, reason=dec.reason, score=dec.score,
                                           source=row["source"], source_file=row["source_file"],
                                           source_row=row["source_row"], prompt_id=row["prompt_id"],
                                           category=row["category"],
                                           payload=_payload({"messages": row["messages"], "tools": row["tools"]})))
            drops[exact.name] += len(reasons)
            a["rejected"] += len(reasons)
            table = table.filter(pa.array(mask))
            batch_sigs = batch_sigs[mask] if batch_sigs is not None else None
    if table.num_rows:
        tables.append(table)
        if batch_sigs is not None:
            sigs.append(batch_sigs)


def _size(path: str) -> int:
    p = Path(path)
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return p.stat().st_size


def _stack(parts: list[np.ndarray], k: int) -> np.ndarray:
    """Concatenate per-batch signatures, freeing each batch as it is copied (peak ~1x, not 2x)."""
    out = np.empty((sum(len(p) for p in parts), k), dtype=np.uint32)
    at = 0
    for i, p in enumerate(parts):
        out[at : at + len(p)] = p
        at += len(p)
        parts[i] = None
    return out


def _near_dedup(pool: pa.Table, sig: np.ndarray, near, rejects: RejectWriter, acct: dict, drops: Counter) -> np.ndarray:
    """Reject near duplicates (see `filters.dedup.near_duplicates`); returns the keep mask over `pool`."""
    dup, match, jac = near_duplicates(sig, near.threshold)
    del sig
    mask = np.ones(pool.num_rows, dtype=bool)
    if not len(dup):
        return mask
    ids = pool.column("prompt_id").to_pylist()
    near.matches = {ids[i]: (ids[j], float(s)) for i, j, s in zip(dup.tolist(), match.tolist(), jac.tolist())}
    cols = pool.select(["prompt_id", "source", "source_file", "source_row", "category", "messages"])
    for s in range(0, len(dup), 10_000):
        for row in cols.take(pa.array(dup[s : s + 10_000], type=pa.int64())).to_pylist():
            _near_reject(row, near, rejects, acct, drops)
    mask[dup] = False
    return mask


def _near_reject(row: dict, near, rejects: RejectWriter, acct: dict, drops: Counter) -> None:
    dec = near(_Row(row["prompt_id"]))
    assert not dec.keep, "near_duplicates returns verified pairs only"
    rejects.add(RejectedRecord(stage=STAGE, filter=near.name, reason=dec.reason, score=dec.score,
                               source=row["source"], source_file=row["source_file"], source_row=row["source_row"],
                               prompt_id=row["prompt_id"], category=row["category"],
                               payload=_payload(row["messages"])))
    drops[near.name] += 1
    acct[row["source_file"]]["rejected"] += 1


class _Row:
    """The fields the dedup filters read: prompt_id and the cached normalized conversation text."""

    def __init__(self, prompt_id, norm=None):
        self.prompt_id = prompt_id
        self.messages = []
        self.tools = None
        self.extra = {"norm": norm} if norm is not None else {}


def originals_counts(selected) -> dict:
    """Selected prompts with and without the source's own answers (`original_answers`), in all and per source:
    {num_with, num_without, by_source: {source: {with, without}}}."""
    has = pc.invert(pc.is_null(selected.column("original_answers"))).to_pylist() if selected.num_rows else []
    by_source: dict[str, dict] = {}
    for src, h in zip(selected.column("source").to_pylist() if selected.num_rows else [], has):
        entry = by_source.setdefault(src, {"with": 0, "without": 0})
        entry["with" if h else "without"] += 1
    return {"num_with": sum(has), "num_without": len(has) - sum(has), "by_source": dict(sorted(by_source.items()))}


def _manifest(cfg, seed, extra, chash, selected, report, drops, acct, parts, rej_parts, pool_rows) -> dict:
    def counts(col):  # null values (no bands, no modes) are not counted
        return dict(sorted(Counter(v for v in selected.column(col).to_pylist() if v is not None).items())) \
            if selected.num_rows else {}

    totals = {k: sum(a[k] for a in acct.values()) for k in ("input_rows", "selected", "rejected", "not_selected")}
    bad = {f: a for f, a in acct.items() if a["input_rows"] != a["selected"] + a["rejected"] + a["not_selected"]}
    if bad:
        raise AssertionError(f"accounting does not close for {sorted(bad)}")
    return {
        "schema": MANIFEST_SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "stage": STAGE,
        "seed": seed,
        "config_hash": chash,
        "config": cfg.model_dump(),
        "extra_sources": extra,
        "num_prompts": selected.num_rows,
        "num_requested": cfg.total,
        "num_eligible": pool_rows,
        "parts": parts,
        "rejected_parts": rej_parts,
        "counts": {"category": counts("category"), "language": counts("language"), "source": counts("source"),
                   "length_band": counts("length_band"), "mode": counts("mode")},
        "mix": report["mix"],
        **({"bands": report["bands"]} if "bands" in report else {}),
        "cells": cell_counts(selected),
        "shortfall_policy": cfg.shortfall_policy,
        "total_shortfall": report["total_shortfall"],
        "capped": report["capped"],
        "filters": {name: int(drops.get(name, 0)) for name in ["parse", "not_a_prompt", *cfg.filters]},
        "originals": originals_counts(selected),
        "accounting": {"files": acct, "totals": totals, "closed": True},
    }


def cell_counts(selected) -> list[dict]:
    """Selected prompts per category x length band x mode: [{category, length_band, mode, prompts}], sorted."""
    if not selected.num_rows:
        return []
    cells = Counter(zip(selected.column("category").to_pylist(), selected.column("length_band").to_pylist(),
                        selected.column("mode").to_pylist()))
    return [{"category": c, "length_band": b, "mode": m, "prompts": n}
            for (c, b, m), n in sorted(cells.items(), key=lambda kv: tuple(str(x) for x in kv[0]))]


# ----------------------------------------------------------------------------------------------- CLI


def eligible_pool(cfg: SelectConfig, run: RunDir, seed: int, control_tokens=()) -> pa.Table:
    """Every eligible prompt of `cfg`'s sources (this stage with no quota: filters, dedup and control tokens as
    the selection had them), written under `<run>/loop/pool/` and resumed there while nothing changed."""
    every = cfg.model_copy(update={"total": 10 ** 12, "shortfall_policy": "report_only", "min_category_fill": 0.0,
                                   "on_category_shortfall": "warn", "modes": {}})
    pool = RunDir.at(run.root / "loop" / "pool")
    manifest = run_select(every, pool, seed=seed, progress=False, control_tokens=control_tokens)
    parts = [pool.prompts / p["path"] for p in manifest["parts"]]
    import pyarrow.parquet as pq

    return pa.concat_tables([pq.read_table(p, schema=PROMPT_SCHEMA) for p in parts]) if parts \
        else PROMPT_SCHEMA.empty_table()


def next_round(cfg: SelectConfig, run: RunDir, *, seed: int, control_tokens=(), **kwargs) -> dict:
    """The next round of the data loop on `run`: `regen.select.aim.next_selection` over `eligible_pool`."""
    from regen.select.aim import next_selection

    return next_selection(cfg, run, eligible_pool(cfg, run, seed, control_tokens), seed=seed, **kwargs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from regen.config import add_profile_arguments

    add_profile_arguments(parser)
    parser.add_argument("--source", action="append", default=[], metavar="PATH",
                        help="an extra prompt pool (file, directory or HF dataset dir); repeatable")
    parser.add_argument("--on-bad-file", choices=("fail", "skip"), default=None,
                        help="a source file that cannot be read: fail naming every bad file (default, "
                             "select.on_bad_file) or skip it")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = parser.add_argument_group("the next selection (regen.select.aim): more prompts where the draft is weakest")
    g.add_argument("--budget-units", type=int, default=None, metavar="N",
                   help="add a round of at most N new generation units to the run's selection (instead of selecting)")
    g.add_argument("--policy", choices=("weakest", "mix"), default="weakest",
                   help="weakest: where the evaluation's acc_len is lowest (default); mix: the profile's stated mix")
    g.add_argument("--eval", default=None, metavar="PATH", help="the evaluation to aim at (default <run>/eval.json)")
    g.add_argument("--prior-requests", type=float, default=4.0,
                   help="pseudo-requests shrinking each cell's acc_len toward its category's (default 4)")


def main(args) -> int:
    from regen.config import load_profile_from_args
    from regen.config.render import effective_render_config
    from regen.render.stage import prompt_control_tokens  # render's public entry: what its tokenizer parses

    profile, run = load_profile_from_args(args)
    cfg = profile.select
    if getattr(args, "on_bad_file", None):
        cfg = cfg.model_copy(update={"on_bad_file": args.on_bad_file})
    tokens = prompt_control_tokens(effective_render_config(profile.render, profile.serve))
    if getattr(args, "budget_units", None) is not None:
        rec = next_round(cfg, run, seed=profile.seed, eval_path=args.eval, budget_units=args.budget_units,
                         policy=args.policy, heldout_fraction=profile.train.heldout_fraction,
                         prior_requests=args.prior_requests, control_tokens=tokens)
        print(f"loop round {rec['round']} ({rec['policy']}): {rec['prompts_added']:,} prompts, "
              f"{rec['units_added']:,} of {rec['budget_units']:,} units; reasoning in {run.root / rec['reasoning']}")
        return 0
    manifest = run_select(cfg, run, seed=profile.seed, extra_sources=args.source,
                          progress=not args.no_progress, control_tokens=tokens)
    print_mix(manifest, run.root)
    return 0
