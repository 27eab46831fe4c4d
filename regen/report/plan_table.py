"""`regen plan`'s figures for a terminal: one two-column table (figure, value) that fits the terminal's width, and
each figure's formula below it on request (`--formulas`). The figures and formulas are `regen.report.plan.build_plan`'s
plan dict (also written to `<run>/plan.json`)."""
from __future__ import annotations

from regen.report.cells import print_cells
from regen.serve.engines import serving_rows


def _gib(x: float) -> str:
    return f"{x:,.2f} GiB"


def plan_rows(plan: dict) -> list[list[str]]:
    """The plan's figures as rows (figure, value, how): what `print_plan` shows, the formula in the third column."""
    pt, sh, sv, d = plan["prompt_tokens"], plan["shards"], plan["servers"], plan["draft"]
    rows = [
        ["prompts / units", f"{plan['prompts']:,} / {plan['units']:,}", "selection x scale"],
        ["prompt tokens p50 / p90 / max", f"{pt['p50']:,} / {pt['p90']:,} / {pt['max']:,}",
         f"{pt['renderer']} renderer on {pt['rendered_units']:,} units"],
        ["prompt tokens total", f"{pt['total']:,}", f"requested units x mean {pt['mean']} (every request's prompt "
                                                     f"side; history = earlier turns' supervised tokens)"],
        ["output tokens total", f"{plan['output_tokens']['total']:,}",
         f"{plan['output_tokens']['per_unit']}/unit, {plan['output_tokens']['source']}"],
        ["requests", f"{plan['requests']['total']:,}", f"{plan['requested_units']:,} requested units (P(reached), "
                                                        f"{plan['continuation']['source']}) x attempts"],
        ["server-hours / wall hours", f"{sv['server_hours']:,} / {sv['wall_hours']:,}", sv["formula"]],
        ["shard rows", f"{sh['rows']:,}", f"units x {sh['keep_fraction']} (overlong drop {sh['overlong_drop_fraction']})"],
        ["shard prompt-side tokens", f"{sh['prompt_tokens']:,}", "rows x (rendered fixed part + earlier turns' "
                                                                 "supervised tokens) x pilot ratio"],
        ["supervised tokens", f"{sh['supervised_tokens']:,}", "rows x supervised tokens per row"],
        ["shard tokens / bytes", f"{sh['tokens']:,} / {sh['bytes'] / 1e9:,.3f} GB",
         f"{sh['files']} file(s) x {sh['file_bytes']} B + tokens x {sh['bytes_per_token']} B/token"],
    ]
    if "params_trainable" in d:
        mem = d["memory_per_gpu_gib"]
        rows += [["draft parameters", f"{d['params_trainable'] / 1e9:.3f}B trainable + {d['params_frozen'] / 1e9:.3f}B "
                  f"frozen", f"{d['params_trainable']:,} + {d['params_frozen']:,}; {d['target_config']}"]]
        rows += [[f"memory/GPU {k}", _gib(mem[k]), d["memory_formulas"][k]] for k in d["memory_formulas"]]
        rows += [["memory/GPU total", _gib(mem["total"]), f"W={d['world_size']}, T={d['micro_batch_tokens']}"],
                 *[[f"host/GPU {k.replace('feature_staging', 'feature slots').replace('_', ' ')}",
                    _gib(d["host_memory_per_gpu_gib"][k]), d["host_memory_formulas"][k]]
                   for k in d["host_memory_formulas"]],
                 *([["host/GB200 tray", f"{d['host_tray']['bytes'] / 1e9:,.0f} GB", d["host_tray"]["holds_text"]]]
                   if "host_tray" in d else []),
                 ["training FLOPs", f"{d['training_flops']:.3e}", d["flops_formula"] + f" (6·P·D: {d['six_p_d_flops']:.3e})"],
                 ["trainer s/row at MFU", f"{d['trainer_seconds_per_row']['at_mfu']} s", "counted FLOPs per row / "
                  f"(peak x MFU); plan.trainer_seconds_per_row {d['trainer_seconds_per_row']['assumed']} s is MFU "
                  f"{d['trainer_seconds_per_row']['mfu_of_assumed']}"],
                 ["training time", f"{d['training_hours']:,} h", d["time_formula"]]]
    elif d:
        rows.append(["draft", "-", d.get("note", "")])
    if plan.get("features"):
        from regen.train.features.plan import rows as feature_rows

        rows += feature_rows(plan["features"])
    serving = d.get("serving") or {}
    return rows + [[name, _verdict(serving[name.removeprefix("served by ")]), how]
                   for name, _, how in serving_rows(serving)]


def _verdict(s: dict) -> str:
    """An engine's verdict in a few words: yes, or no and the subject of each refusal ("fc_norm=True")."""
    if s["serves"]:
        return "yes"
    subjects = [r.split(": ")[1] if r.count(": ") >= 2 else r for r in s["refusals"]]
    return "no: " + ", ".join(subjects)


def _short(value: str, width: int) -> str:
    """A figure's value cut to `width` characters (an engine's refusals: the first one's subject, and how many)."""
    return value if len(value) <= width else value[:width - 1] + "…"


def print_plan(plan: dict, *, formulas: bool = False, width: int | None = None) -> None:
    """The plan for a terminal: the figures as one two-column table (figure, value) that fits `width` columns
    (the terminal's, at least 60), then, with `formulas`, each figure's formula below it, wrapped to the width.
    Without `formulas` one line says how to see them (they are also in plan.json)."""
    import shutil
    import textwrap

    from regen.report.query import print_table

    width = max(60, width or shutil.get_terminal_size((100, 40)).columns)

    def say(text: str, indent: str = "") -> None:
        print(textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent + "  "))

    say(f"regen plan: profile {plan['profile']}, rates {plan['source_of_rates']}; {plan['scale']['note']} "
        f"(x{plan['scale']['factor']})")
    print_table(["category", "prompts", "units", "output tokens/unit", "requests/unit", "keep"],
                [[k, v["prompts"], v["units"], v["output_tokens_per_unit"], v["requests_per_unit"], v["keep"]]
                 for k, v in plan["categories"].items()],
                title="mix", width=width)
    rows = plan_rows(plan)
    name_w = max(len(r[0]) for r in rows)
    value_w = width - name_w - 7  # rich's borders and padding of two columns
    print_table(["figure", "value"], [[r[0], _short(r[1], value_w)] for r in rows], title="plan", width=width)
    print_cells(plan.get("cells") or {}, width=width)
    for p in plan["preflight_problems"]:
        say(f"preflight (would stop `regen run`): {p}")
    if plan["assumptions"].get("note"):
        say(f"assumptions: {plan['assumptions']['note']}")
    if formulas:
        print("\nhow each figure is computed:")
        for name, value, how in rows:
            say(f"{name} = {value}: {how}", indent="  ")
    else:
        say("each figure's formula: add --formulas (also in plan.json)")
