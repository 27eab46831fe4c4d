"""`regen report --run DIR [--out FILE]`: one self-contained HTML page with plots of a run.

Plots (matplotlib PNGs inlined as base64 `data:` URIs; no file or network access when viewed):
  mix            prompts (and samples) per category          prompts / samples views
  languages      prompts per language (top 15)               prompts view
  prompt_tokens  histogram of prompt lengths, tokens         generations.num_prompt_tokens (server usage), else
                                                             prompts.num_prompt_tokens (select's estimate)
  response_tokens histogram of response lengths, tokens      generations.num_completion_tokens (status ok)
  finish_reasons rows per finish_reason                      generations view
  rejects        rejected rows per (stage, filter)           rejected view
  throughput     output tokens/s and requests per minute     generations/throughput.parquet, else finished_at
  drift          render drift: rows whose rendered prompt ids differ from the server's, by cause
                                                             shards/manifest.json `drift`
  acc_len_cells, position_acceptance, eval_curve: where the draft is weak and its curve (`regen.report.acceptance`)
and tables: stage counts (manifests, one row per count), the mix, the finish-reason mix of the answers,
generation outcomes, reject reasons. A missing stage gives a
note in place of its plots, never an error. Written to `<run>/report.html` by default. A small inline script
counts the images the browser decoded into `<body data-images-ok=N>` (the headless-browser test reads it).
"""
from __future__ import annotations

import argparse
import base64
import html
import io
import time
from pathlib import Path

from regen.errors import InputError
from regen.report import acceptance, summary
from schemas.io import read_json

CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.6em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;font-size:.9em;text-align:left}
.plots{display:flex;flex-wrap:wrap;gap:12px}figure.plot{margin:0;width:520px}
.plot img{width:520px;height:auto;border:1px solid #eee}
.missing{color:#999;font-style:italic}code{background:#f4f4f4;padding:1px 3px}"""

SCRIPT = """window.addEventListener('load',function(){var n=0;document.querySelectorAll('img.plot-img').forEach(
function(i){if(i.complete&&i.naturalWidth>0)n++;});document.body.setAttribute('data-images-ok',String(n));});"""


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _bar(labels, values, title: str, xlabel: str = "", horizontal: bool = False):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, max(2.5, 0.3 * len(labels)) if horizontal else 3.2))
    labels = [str(x) for x in labels]
    if horizontal:
        ax.barh(labels[::-1], list(values)[::-1], color="#4c72b0")
        ax.set_xlabel(xlabel)
    else:
        ax.bar(labels, values, color="#4c72b0")
        ax.set_ylabel(xlabel)
        ax.tick_params(axis="x", rotation=30)
    ax.set_title(title)
    return fig


def _hist(values, title: str, xlabel: str):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.hist(values, bins=min(40, max(5, len(set(values)))), color="#55a868")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("rows")
    return fig


def _col(con, view: str, column: str, where: str = "") -> list:
    if view not in summary.views(con) or column not in summary.columns_of(con, view):
        return []
    rows = con.execute(f"SELECT {column} FROM {view} WHERE {column} IS NOT NULL {where}").fetchall()
    return [r[0] for r in rows]


def _group(con, view: str, column: str, limit: int = 30) -> tuple[list, list]:
    if view not in summary.views(con) or column not in summary.columns_of(con, view):
        return [], []
    rows = con.execute(f"SELECT coalesce(CAST({column} AS VARCHAR), '(null)'), count(*) FROM {view} "
                       f"GROUP BY 1 ORDER BY 2 DESC LIMIT {limit}").fetchall()
    return [r[0] for r in rows], [r[1] for r in rows]


def _throughput(run_root: Path, con):
    """(minutes since start, output tok/s, requests/min) from throughput.parquet, else from finished_at."""
    path = run_root / "generations" / "throughput.parquet"
    if path.exists():
        rows = con.execute(f"SELECT epoch(minute) AS t, sum(output_tokens), sum(requests) FROM read_parquet('{path}') "
                           "GROUP BY 1 ORDER BY 1").fetchall()
    elif "generations" in summary.views(con) and "finished_at" in summary.columns_of(con, "generations"):
        rows = con.execute("SELECT epoch(date_trunc('minute', finished_at)) AS t, sum(num_completion_tokens), "
                           "count(*) FROM generations WHERE finished_at IS NOT NULL GROUP BY 1 ORDER BY 1").fetchall()
    else:
        rows = []
    if not rows:
        return None
    t0 = rows[0][0]
    return [(r[0] - t0) / 60 for r in rows], [(r[1] or 0) / 60 for r in rows], [r[2] or 0 for r in rows]


def make_plots(run_root: Path, con) -> dict[str, tuple[str | None, str]]:
    """{plot name: (base64 PNG or None, caption or the reason it is missing)}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots: dict[str, tuple[str | None, str]] = {}
    cols, rows = summary.mix_table(con)
    if rows:
        fig = _bar([r[0] for r in rows], [r[1] for r in rows], "Prompts per category", "prompts")
        if "samples" in cols:
            fig.axes[0].bar([str(r[0]) for r in rows], [r[cols.index("samples")] for r in rows], color="#dd8452",
                            width=0.4, label="samples")
            fig.axes[0].legend(["prompts", "samples"])
        plots["mix"] = (_png(fig), "Category mix: selected prompts and rendered samples per category")
    else:
        plots["mix"] = (None, "no prompts yet (select has not run)")
    labels, values = _group(con, "prompts", "language", 15)
    plots["languages"] = ((_png(_bar(labels, values, "Prompts per language", "prompts")), "Language mix (top 15)")
                          if labels else (None, "no prompts yet"))
    lengths = _col(con, "generations", "num_prompt_tokens", "AND turn = 0")
    source = "server usage.prompt_tokens, first turn"
    if not lengths:
        lengths, source = _col(con, "prompts", "num_prompt_tokens"), "select's estimate"
    plots["prompt_tokens"] = ((_png(_hist(lengths, "Prompt length", "tokens")), f"Prompt tokens ({source})")
                              if lengths else (None, "no prompt lengths (no prompts or generations)"))
    lengths = _col(con, "generations", "num_completion_tokens", "AND status = 'ok'")
    plots["response_tokens"] = ((_png(_hist(lengths, "Response length", "tokens")),
                                 "Response tokens (usage.completion_tokens of ok rows)")
                                if lengths else (None, "no generations yet"))
    labels, values = _group(con, "generations", "finish_reason")
    plots["finish_reasons"] = ((_png(_bar(labels, values, "Finish reasons", "rows")), "finish_reason of every row")
                               if labels else (None, "no generations yet"))
    if "rejected" in summary.views(con):
        rows = con.execute("SELECT stage || ' / ' || filter, count(*) FROM rejected GROUP BY 1 ORDER BY 2 DESC "
                           "LIMIT 30").fetchall()
        plots["rejects"] = (_png(_bar([r[0] for r in rows], [r[1] for r in rows], "Rejected rows by filter", "rows",
                                      horizontal=True)), "Rejects per stage and filter (reasons in the table below)")
    else:
        plots["rejects"] = (None, "nothing rejected (or no stage has run)")
    tp = _throughput(run_root, con)
    if tp:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot(tp[0], tp[1], marker="o", color="#4c72b0", label="output tokens/s")
        ax.set_xlabel("minutes since the first request")
        ax.set_ylabel("output tokens/s")
        ax2 = ax.twinx()
        ax2.plot(tp[0], tp[2], marker="x", color="#c44e52", label="requests/min")
        ax2.set_ylabel("requests/min")
        ax.set_title("Throughput over time (per minute)")
        plots["throughput"] = (_png(fig), "Generation throughput per minute")
    else:
        plots["throughput"] = (None, "no generation throughput recorded yet")
    drift = (read_json(run_root / "shards" / "manifest.json") or {}).get("drift")
    if drift is None:
        plots["drift"] = (None, "render has not run")
    else:
        checked, rate = drift.get("rows_checked") or 0, drift.get("rate") or 0.0
        causes = drift.get("causes") or {}
        labels = ["no drift"] + list(causes)
        values = [max(0, checked - (drift.get("rows_drifted") or 0))] + list(causes.values())
        caption = (f"Render drift rate {rate:.2%} of {checked} rows checked against the server's prompt_token_ids"
                   if checked else "drift rate: no rows checked (the server returned no token ids)")
        plots["drift"] = (_png(_bar(labels, values, f"Render drift: {rate:.2%}", "rows")), caption)
    plots.update(acceptance.eval_plots(run_root))
    plots.update(acceptance.training_plot(run_root))
    plots.update(acceptance.curve_plot(run_root))
    return plots


def _html_table(table: summary.Table) -> str:
    cols, rows = table
    if not cols or not rows:
        return '<p class="missing">none</p>'
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape('' if v is None else str(v))}</td>" for v in r) + "</tr>"
                   for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_report(run_root: str | Path) -> str:
    """The report's HTML for the run directory `run_root`. Raises InputError when it does not exist."""
    root = Path(run_root).resolve()
    if not root.is_dir():
        raise InputError(f"run directory {root} does not exist: give --run a directory made by `regen run`")
    con = summary.connect(root)
    plots = make_plots(root, con)
    counts = summary.stage_counts(root)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>regen report: {html.escape(root.name)}</title>",
             f"<style>{CSS}</style><script>{SCRIPT}</script></head><body>",
             f"<h1>regen report: {html.escape(str(root))}</h1>",
             f"<p>generated {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}</p><h2>Stages</h2>"]
    stages = summary.stage_table(counts)
    parts.append(_html_table(stages) if stages[1] else '<p class="missing">no stage has run</p>')
    parts.append('<h2>Plots</h2><div class="plots">')
    for name, (png, caption) in plots.items():
        if png:
            parts.append(f'<figure class="plot" id="plot-{name}"><img class="plot-img" alt="{html.escape(caption)}" '
                         f'src="data:image/png;base64,{png}"><figcaption>{html.escape(caption)}</figcaption></figure>')
        else:
            parts.append(f'<figure class="plot" id="plot-{name}"><p class="missing">{name}: '
                         f'{html.escape(caption)}</p></figure>')
    parts.append("</div><h2>Mix</h2>" + _html_table(summary.mix_table(con)))
    parts.append(f"<p>Query: <code>{html.escape(summary.MIX_SQL)}</code></p>")
    parts.append("<h2>Finish reasons</h2>" + _html_table(summary.finish_table(con)))
    parts.append("<h2>Generations</h2>" + _html_table(summary.generation_table(con)))
    parts.append("<h2>Rejected</h2>" + _html_table(summary.reject_table(con)))
    parts.append("<h2>Acceptance per cell (trained draft, eval.json)</h2>" + _html_table(acceptance.cells_table(root)))
    engine = acceptance.engine_cells_table(root)
    if engine[1]:
        parts.append("<h2>Acceptance per cell in the engine (llama.cpp, engine-eval.json)</h2>" + _html_table(engine))
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(run_root: str | Path, out: str | Path | None = None) -> Path:
    """Write the report (default `<run>/report.html`); returns its path."""
    root = Path(run_root)
    path = Path(out) if out else root / "report.html"
    text = render_report(root)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, help="run directory")
    parser.add_argument("--out", default=None, help="output HTML file (default: <run>/report.html)")


def main(args) -> int:
    path = write_report(args.run, args.out)
    print(f"wrote {path}")
    return 0
