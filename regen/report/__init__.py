"""Looking at a run: DuckDB views over its files, summaries for people, and the HTML report.

Modules:
    query.py    `regen query`: DuckDB SQL over the views prompts, rejected, generations, samples, shards
    summary.py  the mix, stage counts, reject reasons, generation outcomes (used by `regen run` and the flow)
    html.py     `regen report`: one self-contained HTML page with plots
    cells.py    `regen plan`'s count of the mix's cells (length band x generation mode)
"""
