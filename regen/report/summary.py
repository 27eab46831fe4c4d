"""Summaries of a run directory for people: the mix, stage counts, reject reasons, generation outcomes and the
finish-reason mix.

Plain functions over the run's DuckDB views (`regen.report.query`) and manifests, shared by `regen run` (printed),
the Prefect flow (artifacts) and `regen report` (tables beside the plots). Every function tolerates a missing
stage: a view that does not exist yields no rows. Nothing here reads secrets: endpoints are base URLs and the
API key never reaches a manifest.
"""
from __future__ import annotations

from pathlib import Path

from schemas.io import read_json

# The mix query `regen run` prints at the end (and runs): prompts per category and language, with the share.
MIX_SQL = (
    "SELECT category, count(*) AS prompts, round(100.0 * count(*) / sum(count(*)) OVER (), 1) AS pct, "
    "count(DISTINCT language) AS languages FROM prompts GROUP BY category ORDER BY prompts DESC"
)

Table = tuple[list[str], list[tuple]]


def views(con) -> set[str]:
    """The views that hold rows (`regen query` defines every view, empty where its files do not exist)."""
    names = [r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()]
    return {v for v in names if con.execute(f"SELECT 1 FROM {v} LIMIT 1").fetchone()}


def columns_of(con, view: str) -> set[str]:
    return {r[0] for r in con.execute(f"DESCRIBE {view}").fetchall()}


def _table(con, sql: str) -> Table:
    cur = con.execute(sql)
    return [d[0] for d in cur.description], cur.fetchall()


def connect(run_root: str | Path):
    """`regen.report.query.connect`, or when one of its views cannot be made (e.g. the `shards` view over a manifest
    with an empty shard list), an in-memory connection with every view that can."""
    import duckdb

    from regen.report.query import connect as query_connect
    from regen.report.query import view_statements

    try:
        return query_connect(run_root)
    except duckdb.Error:
        con = duckdb.connect()
        for statement in view_statements(Path(run_root).resolve()):
            try:
                con.execute(statement)
            except duckdb.Error:
                pass
        return con


def mix_table(con) -> Table:
    """category, prompts, pct, languages (+ samples, loss_tokens when shards exist); empty without prompts."""
    have = views(con)
    if "prompts" not in have:
        return [], []
    if "samples" not in have:
        return _table(con, MIX_SQL)
    return _table(con, (
        "WITH p AS (SELECT category, count(*) AS prompts, count(DISTINCT language) AS languages FROM prompts "
        "GROUP BY 1), s AS (SELECT category, count(*) AS samples, sum(num_loss_tokens) AS loss_tokens "
        "FROM samples WHERE responses = 'regenerated' GROUP BY 1) "  # the original set is not the run's output
        "SELECT p.category, p.prompts, round(100.0 * p.prompts / sum(p.prompts) OVER (), 1) "
        "AS pct, p.languages, coalesce(s.samples, 0) AS samples, coalesce(s.loss_tokens, 0) AS loss_tokens "
        "FROM p LEFT JOIN s USING (category) ORDER BY p.prompts DESC"
    ))


def language_table(con, limit: int = 20) -> Table:
    if "prompts" not in views(con):
        return [], []
    return _table(con, f"SELECT language, count(*) AS prompts FROM prompts GROUP BY 1 ORDER BY 2 DESC LIMIT {limit}")


def reject_table(con) -> Table:
    """stage, filter, rows, one example reason; empty when nothing was rejected."""
    if "rejected" not in views(con):
        return [], []
    return _table(con, "SELECT stage, filter, count(*) AS rows, any_value(reason) AS example_reason FROM rejected "
                       "GROUP BY ALL ORDER BY stage, rows DESC")


def generation_table(con) -> Table:
    """status, error_class, finish_reason, rows, output tokens; empty before generate."""
    if "generations" not in views(con):
        return [], []
    return _table(con, "SELECT status, coalesce(error_class, '') AS error_class, coalesce(finish_reason, '') AS "
                       "finish_reason, count(*) AS rows, coalesce(sum(num_completion_tokens), 0) AS output_tokens "
                       "FROM generations GROUP BY ALL ORDER BY rows DESC")


def finish_table(con) -> Table:
    """finish_reason, answers, pct, output_tokens, mean_tokens over the `ok` generations (every turn); empty before
    generate. `stop`: the answer ended by itself; `length`: cut at `generate.max_tokens`."""
    if "generations" not in views(con):
        return [], []
    return _table(con, "SELECT coalesce(finish_reason, '(none)') AS finish_reason, count(*) AS answers, "
                       "round(100.0 * count(*) / sum(count(*)) OVER (), 1) AS pct, "
                       "coalesce(sum(num_completion_tokens), 0) AS output_tokens, "
                       "round(avg(num_completion_tokens), 1) AS mean_tokens FROM generations WHERE status = 'ok' "
                       "GROUP BY 1 ORDER BY answers DESC")


def finish_line(con) -> str:
    """One line, e.g. `finish_reason of 114 answers: stop 92.1% (105), length 7.9% (9)`; '' before generate."""
    cols, rows = finish_table(con)
    if not rows:
        return ""
    total = sum(r[1] for r in rows)
    return f"finish_reason of {total} answers: " + ", ".join(f"{r[0]} {r[2]}% ({r[1]})" for r in rows)


def stage_counts(run_root: str | Path) -> dict:
    """Counts from each stage's manifest: {stage: {...}}; a stage without a manifest is absent."""
    root = Path(run_root)
    out: dict = {}
    m = read_json(root / "prompts" / "manifest.json")
    if m:
        out["select"] = {k: m[k] for k in ("rows", "num_prompts", "total", "shortfall") if k in m}
        if not out["select"]:
            out["select"] = {"rows": sum(p.get("rows", 0) for p in m.get("parts", []))}
    m = read_json(root / "generations" / "manifest.json")
    if m:
        acc = m.get("accounting", {})
        met = m.get("metrics", {})
        out["generate"] = {
            "generated": acc.get("generated"), "error": acc.get("error"), "skipped": acc.get("skipped"),
            "units": acc.get("units"), "balanced": acc.get("balanced"), "attempts": met.get("attempts"),
            "output_tokens": met.get("output_tokens"), "output_tok_per_s": met.get("output_tok_per_s"),
            "error_rows_by_class": met.get("error_rows_by_class"), "failures_by_class": met.get("failures_by_class"),
            "failure_examples": met.get("failure_examples"),  # what the first failure of each class said
        }
    m = read_json(root / "shards" / "filters.json")
    if m:
        out["filter"] = {k: v for k, v in m.items() if k in ("kept", "rejected", "rows", "by_filter", "counts")}
    m = read_json(root / "shards" / "manifest.json")
    if m:
        shards = m.get("shards", [])
        out["render"] = {"shards": len(shards), "rows": sum(s.get("rows", 0) for s in shards),
                         "tokens": sum(s.get("tokens", 0) for s in shards)}
        if "drift" in m:
            out["render"]["drift_rate"] = m["drift"].get("rate")
            out["render"]["drift_rows_checked"] = m["drift"].get("rows_checked")
    m = read_json(root / "eval.json")
    if m:
        out["eval"] = {f"acc_len_{k}": (m.get(k) or {}).get("acc_len") for k in m.get("drafts", {})}
        out["eval"]["num_prompts"] = m.get("num_prompts")
    m = read_json(root / "engine-eval.json")
    if m:  # the draft served by a real engine (regen engine-eval, docs/serve.md)
        for qtype, r in (m.get("by_gguf_type") or {}).items():
            sp, ll = r.get("speed", {}), r.get("lossless", {})
            out[f"serve ({m.get('engine')} {qtype})"] = {
                "acc_len_engine": (r.get("engine") or {}).get("acc_len"),
                "acc_len_regen_replay": ((m.get("regen") or {}).get("engine_budget_rule") or {}).get("acc_len"),
                "tokens_per_s_target_alone": sp.get("tokens_per_s_target_alone"),
                "tokens_per_s_with_draft": sp.get("tokens_per_s_with_draft"), "speedup": sp.get("speedup"),
                "answers_identical": f"{ll.get('identical')}/{ll.get('num_prompts')}",
                "answers_differing_unexplained": ll.get("differing_unexplained")}
            if ll.get("warning"):
                out[f"serve ({m.get('engine')} {qtype})"]["warning"] = ll["warning"]
    return out


def _cell(value):
    return f"{value:.4g}" if isinstance(value, float) else value


def _flat(prefix: str, value) -> list[tuple[str, object]]:
    """(measure, value) pairs of one count: a dict, at any depth, one pair per leaf (`counts: dropped: language`)."""
    if isinstance(value, dict):
        return [pair for k, v in value.items() for pair in _flat(f"{prefix}: {k}", v)]
    return [] if value in (None, []) else [(prefix, _cell(value))]


def stage_table(counts: dict) -> Table:
    """`stage_counts` as rows of (stage, measure, value): one row per count; a dict count (e.g.
    `failures_by_class`, or the filter's `counts` holding `dropped`) one row per leaf, its keys joined as
    `failures_by_class: empty_content`, `counts: dropped: repetition`. Empty values are left out."""
    rows = [(stage, measure, value) for stage, c in counts.items() for key, v in c.items()
            for measure, value in _flat(key, v)]
    return ["stage", "measure", "value"], rows


def markdown_table(table: Table, title: str | None = None) -> str:
    """A Markdown table (for Prefect artifacts); `_none_` when the table is empty."""
    cols, rows = table
    head = f"### {title}\n\n" if title else ""
    if not cols or not rows:
        return head + "_none_\n"
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("" if v is None else str(v).replace("|", "\\|") for v in r) + " |")
    return head + "\n".join(lines) + "\n"


def dict_markdown(d: dict, title: str | None = None) -> str:
    rows = [(k, v) for k, v in d.items()]
    return markdown_table((["field", "value"], rows), title)
