"""What `regen select` prints when it is done: the mix table, the accounting, the drops with the first reject of
each filter (its file, row and reason), and the notes on how input files were read (a stripped byte-order mark).

Everything printed comes from the manifest (`regen.select.stage._manifest`), so a resumed selection prints the
same summary; every reject is in `rejected/select/` (`regen query --run R "SELECT * FROM rejected"`).
"""
from __future__ import annotations


def first_reject(examples: dict, row: dict) -> None:
    """Keep `row` (a REJECTED_SCHEMA row dict) as its filter's example in `examples` unless that filter has one:
    `{filter: {source_file, source_row, reason}}`, the first reject of each filter in the order they are written."""
    if row["filter"] not in examples:
        examples[row["filter"]] = {k: row[k] for k in ("source_file", "source_row", "reason")}


def print_mix(manifest: dict, run_root=None) -> None:
    """The mix table (rich): requested vs selected share per category, with shortfall and drop counts; then the
    first reject of each filter that dropped rows (manifest `reject_examples`) and the manifest's `input_notes`.
    `run_root`, when given, is named in the query that lists every reject."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"prompt mix: {manifest['num_prompts']:,} of {manifest['num_requested']:,} requested "
                        f"(seed {manifest['seed']})")
    for col in ("category", "requested", "target", "available", "selected", "share", "shortfall"):
        table.add_column(col, justify="left" if col == "category" else "right")
    for c, m in manifest["mix"].items():
        table.add_row(c, f"{m['share_requested']:.1%}", f"{m['target']:,}", f"{m['available']:,}", f"{m['selected']:,}",
                      f"{m['share_selected']:.1%}", f"{m['shortfall']:,}" if m["shortfall"] else "")
    con = Console(soft_wrap=True)
    con.print(table)
    for dim in ("length_band", "mode"):
        counts = manifest["counts"].get(dim, {})
        if counts:
            con.print(f"{dim}: " + ", ".join(f"{k} {v:,} ({v / max(1, manifest['num_prompts']):.1%})"
                                             for k, v in counts.items()))
    t = manifest["accounting"]["totals"]
    con.print(f"input rows {t['input_rows']:,} = selected {t['selected']:,} + rejected {t['rejected']:,} "
              f"+ not selected {t['not_selected']:,}")
    con.print("drops: " + ", ".join(f"{k} {v:,}" for k, v in manifest["filters"].items() if v))
    examples = manifest.get("reject_examples") or {}
    for name, n in manifest["filters"].items():
        if n and name in examples:
            e = examples[name]
            con.print(escape(f"  {name}, first of {n:,}: {e['source_file']} row {e['source_row']}: {e['reason']}"),
                      highlight=False)
    if t["rejected"]:
        where = f" --run {run_root}" if run_root is not None else ""
        con.print(escape(f"  every reject: regen query{where} \"SELECT source_file, source_row, filter, reason FROM "
                         "rejected\""), highlight=False)
    for path, notes in sorted((manifest.get("input_notes") or {}).items()):
        for note in notes:
            con.print(escape(f"note: {path}: {note}"), highlight=False)
