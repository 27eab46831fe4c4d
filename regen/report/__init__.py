"""Looking at a run, before and after: the dry run's plan, DuckDB views over its files, summaries for people, and
the HTML report.

Modules:
    query.py    `regen query`: DuckDB SQL over the views prompts, rejected, generations, samples, shards
    summary.py  the mix, stage counts, reject reasons, generation outcomes (used by `regen run` and the flow)
    html.py     `regen report`: one self-contained HTML page with plots
    plan.py     `regen plan`: the dry run (requests, tokens, server-hours, shard bytes, GPU and host memory)
    plan_table.py  its terminal table (80 columns; the formulas on request)
    cells.py    `regen plan`'s count of the mix's cells (length band x generation mode)
"""
