"""`regen plan`: what a profile's run will cost, before it is run. A dry run.

    regen plan --profile P --run DIR [--pilot N] [--sample N] [--servers N --server-tokens-per-s X
               --world-size W --mfu M --gpu-tflops T --output-tokens K]

1. Checks the profile (`regen.preflight.check_profile`, endpoints asked only with `--pilot`): problems of the
   stages a plan does not need (a missing target, an unset key) are listed in the plan, not fatal; a source or
   renderer that does not load is an InputError.
2. Runs the selection (`regen select`, resumed when done) and counts every prompt's (prompt, turn) units
   (`regen.generate.conversation.turn_positions`).
3. Renders every unit's row prompt side (up to `--sample` prompts, seeded) with the profile's renderer as the
   render stage builds the row (`regen.render.stage.sample_prompt_side`), less the recorded history it carries;
   a unit's expected prompt side adds the supervised tokens of its earlier turns (the regenerated history).
4. Without `--pilot`: no request is sent; output tokens, retries, the kept share and shard bytes per token come
   from the profile's `plan:` section, labelled `assumed`, and every turn is assumed requested. With `--pilot N`:
   about N units (whole prompts, seeded; one prompt of every turn kind first) are generated, filtered and
   rendered for real in `<run>/plan/pilot/` through the stages' own entries; per stratum (category, first/later
   turn) their requests, output tokens and kept rows per requested unit, supervised tokens per row, the
   real/estimated prompt-side ratio, per turn kind (`turn_kind`) the rate at which a conversation goes on after
   a turn (P(reached) of later turns), and shard bytes per token replace the assumptions (labelled `pilot`).
5. Prints a table, and the serving engines that can load the draft the profile trains (`regen.serve.engines`),
   and writes `<run>/plan.json`. A pool short of `select.total` prompts scales every count by total / selected.

Formulas (`regen plan --formulas` prints each one below the figures; all are in plan.json):
  requests        = units x requests_per_unit
  server-hours    = output_tokens / server_output_tokens_per_s / 3600; wall hours = server-hours / servers
  shard bytes     = shard tokens x shard_bytes_per_token
  memory per GPU, one optimizer step's peak (FSDP2 over W ranks): weights, all-gathered compute copies, gradients
    (held through accumulation), AdamW state, resident feature objects (2 with producers), saved activations and
    the fused loss's buffers, each term's formula in `regen.train.memory` and printed beside its figure by
    `regen plan`; apart, the host's pinned feature staging per GPU (a step's objects)
  training FLOPs  = rows x epochs x the draft's forward + backward of the mean row, counted per part (context,
                    K/V, block side, attention, loss: `regen.train.flops`) + 2 x N_target_active x D (the target's
                    forward, on the producers' GPUs with producers), D = training tokens = shard tokens x epochs
  training time   = FLOPs / (W x gpu_peak_tflops x 1e12 x mfu); seconds per row at that MFU beside the assumed
                    plan.trainer_seconds_per_row
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from regen.config import Profile, resolve_path
from regen.config.render import effective_render_config
from regen.errors import InputError
from regen.preflight import PreflightError, check_profile
from regen.report.cells import cell_plan, mode_factor, out_tokens, set_template_kwargs
from regen.rundir import RunDir
from regen.serve.engines import support_report
from regen.train.features.plan import feature_plan, host_plan
from schemas.io import write_json_atomic

GiB = 1024 ** 3


def _rank(seed: int, pid: str) -> str:
    return hashlib.sha256(f"{seed}|{pid}".encode()).hexdigest()


def selected_prompts(run: RunDir) -> list[dict]:
    """The selection's prompts (dicts from `regen.generate.runner.iter_prompts`), each with its `positions` and its
    parsed `tool_list` (None without tools)."""
    from regen.generate.conversation import tools_from_json, turn_positions
    from regen.generate.runner import iter_prompts
    from regen.generate.stage import prompt_files

    out = []
    for p in iter_prompts(prompt_files(run)):
        p["positions"] = turn_positions(p["messages"])
        p["tool_list"] = tools_from_json(p.get("tools")) or None
        out.append(p)
    return out


def history_messages(p: dict, turn: int) -> list[dict]:
    """The messages before `turn` as its request carries them (`regen.generate.conversation`): the original ones
    before its position, an empty assistant message standing in where an earlier turn has no recorded assistant
    message (the regenerated turn is inserted there)."""
    msgs, positions = p["messages"], p["positions"]
    inserted = {q for q in positions[:turn] if msgs[q].get("role") != "assistant"}
    out: list[dict] = []
    for j, m in enumerate(msgs[:positions[turn]]):
        if j in inserted:
            out.append({"role": "assistant", "content": ""})
        out.append(m)
    return out


def render_units(renderer, render_cfg, prompts: list[dict]) -> dict:
    """`fixed`: {(prompt_id, turn): the unit's shard-row prompt side less the history it carries}, counted as the
    render stage builds a row (`regen.render.stage.sample_prompt_side`); `errors`: units that did not render.
    A unit's expected prompt side is fixed + the supervised tokens of its earlier (regenerated) turns: the target's
    history holds its own earlier answers, reasoning included for Kimi-K3 (kimi-k3-format.md section 2)."""
    from regen.render.stage import sample_prompt_side

    fixed, errors = {}, 0
    for p in prompts:
        for turn in range(len(p["positions"])):
            try:
                side, history = sample_prompt_side(renderer, history_messages(p, turn), p["tool_list"],
                                                   p.get("template_kwargs", render_cfg.template_kwargs))
            except ValueError:
                errors += 1
                continue
            fixed[(p["prompt_id"], turn)] = side - history
    return {"fixed": fixed, "errors": errors}


def stratum(category: str, turn: int, mode: str | None = None) -> str:
    """Rates are measured and applied per category and turn kind: a conversation's first turn, or a later one
    (later turns carry the regenerated history); and per generation mode where the selection has modes."""
    return f"{category}/{'first' if turn == 0 else 'later'}" + (f"/{mode}" if mode else "")


def turn_kind(p: dict, turn: int) -> str:
    """What decides whether a conversation goes on after `turn`: the regenerated turn's tool calls must match the
    recorded ones (`regen.generate.conversation.next_segment`), so: tools offered or not, the role the turn
    answers, and whether the recorded turn called tools (an inserted turn records none)."""
    msgs, pos = p["messages"], p["positions"][turn]
    recorded = msgs[pos] if pos < len(msgs) and msgs[pos].get("role") == "assistant" else {}
    return (f"{'tools' if p['tool_list'] else 'no tools'}, after {msgs[pos - 1].get('role')}: "
            f"{'call' if recorded.get('tool_calls') else 'answer'}")


def reach(p: dict, go_on: dict[str, float]) -> list[float]:
    """P(turn t is requested) for each turn of `p`: the product of the continuation rates of the turns before it."""
    out = [1.0]
    for turn in range(len(p["positions"]) - 1):
        out.append(out[-1] * go_on[turn_kind(p, turn)])
    return out[:len(p["positions"])]


# ---------------------------------------------------------------------------------------------- the pilot


def pilot_prompts(prompts: list[dict], num_units: int, seed: int) -> list[dict]:
    """Whole prompts, in seeded order: first one holding each turn kind (`turn_kind`) that has a next turn in the
    selection, so every continuation rate the plan applies is measured (this may exceed num_units); then
    round-robin over categories until they hold >= num_units units."""
    ordered = sorted(prompts, key=lambda p: _rank(seed, p["prompt_id"]))
    chosen, seen, covered = [], set(), set()
    for p in ordered:
        kinds = {turn_kind(p, t) for t in range(len(p["positions"]) - 1)}
        if kinds - covered:
            chosen.append(p)
            seen.add(p["prompt_id"])
            covered |= kinds
    by_cat: dict[str, list[dict]] = {}
    for p in ordered:
        if p["prompt_id"] not in seen:
            by_cat.setdefault(p["category"], []).append(p)
    units, i = sum(len(p["positions"]) for p in chosen), 0
    while units < num_units and any(i < len(v) for v in by_cat.values()):
        for cat in sorted(by_cat):
            if i < len(by_cat[cat]) and units < num_units:
                chosen.append(by_cat[cat][i])
                units += len(by_cat[cat][i]["positions"])
        i += 1
    return chosen


def shard_bytes_model(rows: list[dict], tmp: Path) -> tuple[float, float]:
    """(bytes of an empty shard file, marginal bytes per token) of SHARD_SCHEMA Parquet files, from `rows`
    written the way shards are (`schemas.io.write_parquet_atomic`, zstd)."""
    import pyarrow as pa

    from schemas.io import write_parquet_atomic
    from schemas.shard import SHARD_SCHEMA

    empty = write_parquet_atomic(pa.Table.from_pylist([], schema=SHARD_SCHEMA), tmp / "empty.parquet", SHARD_SCHEMA)
    full = write_parquet_atomic(pa.Table.from_pylist(rows, schema=SHARD_SCHEMA), tmp / "rows.parquet", SHARD_SCHEMA)
    tokens = sum(r["num_tokens"] for r in rows)
    return float(empty["bytes"]), (full["bytes"] - empty["bytes"]) / max(1, tokens)


def run_pilot(profile: Profile, run: RunDir, chosen: list[dict], log=print) -> tuple[dict, list[dict], list[dict]]:
    """Generate, filter and render the `chosen` prompts for real in `<run>/plan/pilot/` through the stages'
    entries (`regen.pipeline.step_*`). Returns (summary with the shard file-size model, generation rows
    {prompt_id, category, turn, status, attempts, num_completion_tokens}, shard rows {prompt_id, category, turn,
    prompt_side, supervised})."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from regen import pipeline
    from regen.generate.stage import prompt_files
    from schemas.io import write_parquet_atomic
    from schemas.prompt import PROMPT_SCHEMA

    pilot = RunDir.at(run.root / "plan" / "pilot")
    if not pilot.manifest(pilot.prompts):
        table = pa.concat_tables([pq.read_table(f, schema=PROMPT_SCHEMA) for f in prompt_files(run)])
        table = table.filter(pa.compute.is_in(table["prompt_id"], pa.array([p["prompt_id"] for p in chosen])))
        info = write_parquet_atomic(table, pilot.prompts / "part-00000.parquet", PROMPT_SCHEMA)
        write_json_atomic({"parts": [info], "pilot_of": str(run.root)}, pilot.prompts / "manifest.json")
    render = effective_render_config(profile.render, profile.serve)
    t0 = time.time()
    gen = pipeline.step_generate(profile.generate, profile.serve, pilot, progress=False, log=log)
    pipeline.step_filter(render, pilot, progress=False)
    shards = pipeline.step_render(render, pilot, progress=False)
    gen_rows = pq.read_table(sorted(pilot.generations.glob("part-*.parquet")),
                             columns=["prompt_id", "category", "turn", "status", "attempts",
                                      "num_completion_tokens", "mode"]).to_pylist()
    files = [pilot.shards / s["path"] for s in shards.get("shards", [])]
    full_rows = pq.read_table(files).to_pylist() if files else []
    mode_of = {p["prompt_id"]: p.get("mode") for p in chosen}
    shard_rows = [{"prompt_id": r["prompt_id"], "category": r["category"], "turn": r["turn"],
                   "mode": mode_of.get(r["prompt_id"]), "prompt_side": r["num_tokens"] - r["num_loss_tokens"],
                   "supervised": r["num_loss_tokens"]}
                  for r in full_rows]
    empty, marginal = shard_bytes_model(full_rows, pilot.root / "bytes-model") if full_rows else (0.0, 0.0)
    acc = gen["accounting"]
    summary = {"dir": str(pilot.root), "prompts": acc["prompts"], "units": acc["units"],
               "attempts": sum(r["attempts"] or 0 for r in gen_rows), "rows": len(shard_rows),
               "wall_s": round(time.time() - t0, 1), "shard_file_bytes": empty, "shard_bytes_per_token": marginal,
               "shard_bytes": sum(s["bytes"] for s in shards.get("shards", []))}
    return summary, gen_rows, shard_rows


def continuation_rates(prompts: dict[str, dict], gen_rows: list[dict]) -> dict[str, dict]:
    """{turn kind: {turns, went_on}} over the pilot's requested turns that have a next turn: went_on counts those
    whose next turn was requested too (not `skipped` after a mismatched tool call or an error row)."""
    status = {(r["prompt_id"], r["turn"]): r["status"] for r in gen_rows}
    out: dict[str, dict] = {}
    for pid, p in prompts.items():
        for turn in range(len(p["positions"]) - 1):
            if status.get((pid, turn), "skipped") == "skipped":
                continue
            c = out.setdefault(turn_kind(p, turn), {"turns": 0, "went_on": 0})
            c["turns"] += 1
            c["went_on"] += status.get((pid, turn + 1)) != "skipped"
    return out


def pilot_rates(measured: dict, gen_rows: list[dict], shard_rows: list[dict], fixed: dict) -> dict[str, dict]:
    """Per stratum: requests, output tokens and kept rows per requested unit, supervised tokens per row (also
    each earlier turn's share of a later turn's history), and prompt_ratio = the rows' real prompt side / their
    estimate (fixed + the earlier turns' supervised tokens per row). `pooled` holds the pilot's overall rates."""
    m: dict[str, dict] = {}
    zero = dict(requested=0, attempts=0, output_tokens=0, rows=0, prompt_side=0, supervised=0, estimate=0)
    for r in gen_rows:
        if r["status"] != "skipped":
            c = m.setdefault(stratum(r["category"], r["turn"], r["mode"]), dict(zero))
            c["requested"] += 1
            c["attempts"] += r["attempts"] or 0
            c["output_tokens"] += (r["num_completion_tokens"] or 0) if r["status"] == "ok" else 0
    for r in shard_rows:
        c = m.setdefault(stratum(r["category"], r["turn"], r["mode"]), dict(zero))
        c["rows"] += 1
        c["prompt_side"] += r["prompt_side"]
        c["supervised"] += r["supervised"]
    m["pooled"] = {k: sum(c[k] for c in m.values()) for k in zero}
    per_row = {k: c["supervised"] / c["rows"] for k, c in m.items() if c["rows"]}
    for r in shard_rows:
        if (r["prompt_id"], r["turn"]) in fixed:
            est = fixed[(r["prompt_id"], r["turn"])] + sum(
                per_row.get(stratum(r["category"], i, r["mode"]), per_row.get("pooled", 0)) for i in range(r["turn"]))
            m[stratum(r["category"], r["turn"], r["mode"])]["estimate"] += est
            m["pooled"]["estimate"] += est
    measured["by_stratum"] = m
    return {k: dict(requests=c["attempts"] / max(1, c["requested"]), output=c["output_tokens"] / max(1, c["requested"]),
                    keep=c["rows"] / max(1, c["requested"]),
                    supervised_per_row=per_row.get(k, per_row.get("pooled", 0.0)),
                    prompt_ratio=c["prompt_side"] / c["estimate"] if c["estimate"] else 1.0)
            for k, c in m.items() if c["requested"]}


# ---------------------------------------------------------------------------------------------- the draft


def target_config(profile: Profile) -> tuple[object | None, str]:
    """The target's text config as attributes (from `train.target`/config.json), else the K3 spec shape for the
    kimi-k3 preset (labelled `assumed`), else None."""
    raw = profile.train.target
    path = resolve_path(raw) if raw else None
    if path is not None and "$" not in str(path) and (path / "config.json").is_file():
        cfg = json.loads((path / "config.json").read_text())
        return SimpleNamespace(**(cfg.get("text_config") or cfg)), f"measured: {path}/config.json"
    if profile.train.draft_preset == "kimi-k3":
        from regen.train.draft_config import DSparkConfig

        d = DSparkConfig()
        return (SimpleNamespace(hidden_size=d.target_hidden_size, num_hidden_layers=d.target_num_hidden_layers,
                                vocab_size=d.vocab_size),
                f"assumed: the spec's K3 target shape (train.target {raw!r} not readable)")
    return None, f"unknown: train.target {raw!r} not readable"


def draft_plan(profile: Profile, a, shard_tokens: float, rows: float = 0.0, supervised: float = 0.0) -> dict:
    """Parameters, memory per GPU under FSDP2, host memory, training FLOPs and time (formulas in the module doc) for
    `rows` shard rows of `shard_tokens` tokens, `supervised` of them supervised."""
    from regen.train.draft_config import build_draft_config
    from regen.train.model import build_meta

    tc, source = target_config(profile)
    if tc is None:
        return {"note": source}
    t = profile.train
    cfg = build_draft_config(t, tc)
    model = build_meta(cfg)
    p_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    p_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    W, T = a["world_size"], t.max_tokens
    v_out = cfg.draft_vocab_size or cfg.vocab_size
    from regen.train.features.staging import DEVICE_RESIDENT_OBJECTS
    from regen.train.memory import step_memory_bytes, step_memory_formulas

    p_layer = sum(p.numel() for p in model.layers[0].parameters()) if len(model.layers) else 0
    producers = t.features == "producers"
    # the producers' client: the micro-batch computing and the next one's copy (regen.train.features.staging)
    resident = DEVICE_RESIDENT_OBJECTS if producers else 1
    c = 4 if t.dtype == "float32" else 2
    mem = step_memory_bytes(cfg, tokens=T, world_size=W, grad_accum=t.grad_accum, p_trainable=p_train,
                            p_frozen=p_frozen, p_layer=p_layer, resident_feature_objects=resident, c=c)
    formulas = step_memory_formulas(cfg, tokens=T, world_size=W, grad_accum=t.grad_accum, p_trainable=p_train,
                                    p_frozen=p_frozen, p_layer=p_layer, resident_feature_objects=resident, c=c,
                                    producers=producers)
    from regen.train.flops import training_figures

    epochs = t.epochs or 1
    train = training_figures(cfg, a, rows=rows, shard_tokens=shard_tokens, supervised=supervised, epochs=epochs,
                             p_trainable=p_train, max_len=t.max_len, max_tokens=T, producers=producers)
    return {
        "target_config": source, "params_trainable": p_train, "params_frozen": p_frozen,
        "draft": {"layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "taps": list(cfg.target_layer_ids),
                  "num_anchors": cfg.num_anchors, "block_size": cfg.block_size, "output_vocab": v_out},
        "memory_per_gpu_gib": {k: round(v / GiB, 2) for k, v in mem.items()} | {"total": round(sum(mem.values()) / GiB, 2)},
        "memory_formulas": formulas, "micro_batch_tokens": T, "world_size": W,
        **host_plan(t, cfg, W, producers),  # regen.train.features.plan: the feature client's host memory
        **train, "serving": support_report(cfg),  # regen.train.flops: FLOPs counted per part, time, MFU
    }


# ---------------------------------------------------------------------------------------------- the plan


def _pct(values: list[int], q: float) -> int:
    return int(np.percentile(values, q)) if values else 0


def assumptions(profile: Profile, flags: dict) -> dict:
    """The profile's `plan:` values with command-line flags (not None) on top."""
    a = profile.plan.model_dump()
    a.update({k: v for k, v in flags.items() if v is not None})
    if flags.get("output_tokens") is not None:
        a["output_tokens"] = {"default": flags["output_tokens"]}
    return a


def build_plan(profile: Profile, run: RunDir, *, pilot: int = 0, sample: int = 2000, flags: dict | None = None,
               log=print) -> dict:
    """The plan of `profile` on `run` (see the module doc); writes `<run>/plan.json` and returns it.

    Raises InputError when the sources or the renderer do not load (the other stages' problems are listed in
    `preflight_problems`), or when a pilot is asked and an endpoint fails its check.
    """
    from regen import pipeline

    a = assumptions(profile, flags or {})
    rep = check_profile(profile, run, network=bool(pilot))
    fatal = [p for p in rep.problems if p.startswith(("source ", "select.", "render."))]
    if pilot:
        fatal += [p for p in rep.problems if p.startswith(("endpoint", "generate.", "no endpoint"))]
    if fatal:
        raise PreflightError(fatal)
    pipeline.step_select(profile.select, run, seed=profile.seed, progress=False,
                         render=effective_render_config(profile.render, profile.serve))  # the run's own selection
    prompts = selected_prompts(run)
    if not prompts:
        raise InputError(f"{run.prompts}: the selection is empty; check select.sources and select.mix")
    render_cfg = effective_render_config(profile.render, profile.serve)
    from regen.render.stage import make_renderer

    renderer = make_renderer(render_cfg)
    set_template_kwargs(prompts, profile.generate, render_cfg, renderer.name)  # each prompt's mode (plan_cells)
    sampled = sorted(prompts, key=lambda p: _rank(profile.seed, p["prompt_id"]))[:sample]
    rendered = render_units(renderer, render_cfg, sampled)
    fixed = rendered["fixed"]
    scale = max(1.0, profile.select.total / len(prompts))
    cats: dict = {}
    for p in prompts:
        c = cats.setdefault(p["category"], {"prompts": 0, "units": 0})
        c["prompts"] += 1
        c["units"] += len(p["positions"])
    units = sum(c["units"] for c in cats.values()) * scale

    measured, go_on_counts = None, {}
    if pilot:
        chosen = pilot_prompts(prompts, pilot, profile.seed)
        measured, gen_rows, shard_rows = run_pilot(profile, run, chosen, log=log)
        src = f"pilot ({measured['units']} units sent for real)"
        rates = pilot_rates(measured, gen_rows, shard_rows, render_units(renderer, render_cfg, chosen)["fixed"])
        go_on_counts = continuation_rates({p["prompt_id"]: p for p in chosen}, gen_rows)
        bpt, file_bytes = measured["shard_bytes_per_token"], measured["shard_file_bytes"]
    else:  # a unit's output: its category's assumption x its mode's factor (regen.report.cells)
        src, f = "assumed (profile plan:)", {(p["category"], p.get("mode")) for p in prompts}
        rates = {stratum(c, t, m): dict(requests=a["requests_per_unit"], output=out_tokens(a, c) * mode_factor(a, m),
                                        keep=a["keep_fraction"], supervised_per_row=out_tokens(a, c) * mode_factor(a, m),
                                        prompt_ratio=1.0) for c, m in f for t in (0, 1)}
        bpt, file_bytes = a["shard_bytes_per_token"], 0.0
    pooled = rates.get("pooled") or next(iter(rates.values()))
    turns_with_next = sum(c["turns"] for c in go_on_counts.values())
    go_on_pooled = sum(c["went_on"] for c in go_on_counts.values()) / turns_with_next if turns_with_next else 1.0
    go_on: dict[str, float] = {}
    for p in prompts:
        for turn in range(len(p["positions"]) - 1):
            c = go_on_counts.get(turn_kind(p, turn))
            go_on[turn_kind(p, turn)] = c["went_on"] / c["turns"] if c else go_on_pooled

    # Per stratum: requested units (units x P(reached)) over the selection; the expected prompt side per requested
    # unit over the rendered sample: (fixed + earlier turns' supervised tokens) x the pilot's ratio.
    def rate(k: str) -> dict:  # a stratum the pilot did not reach takes the pilot's pooled rates
        return rates.get(k) or pooled

    strata: dict[str, dict] = {}
    estimates: list[float] = []
    for p in prompts:
        probs = reach(p, go_on)
        cat, mode = p["category"], p.get("mode")
        for turn, prob in enumerate(probs):
            s = strata.setdefault(stratum(cat, turn, mode), dict(units=0, requested=0.0, weight=0.0, side=0.0, overlong=0.0))
            s["units"] += 1
            s["requested"] += prob
            if (p["prompt_id"], turn) not in fixed:
                continue
            est = (fixed[(p["prompt_id"], turn)] + sum(rate(stratum(cat, i, mode))["supervised_per_row"] for i in range(turn)))
            est *= rate(stratum(cat, turn, mode))["prompt_ratio"]
            estimates.append(est)
            s["weight"] += prob
            s["side"] += prob * est
            if not pilot and profile.render.overlong == "drop" and est + out_tokens(a, cat) > profile.render.max_tokens:
                s["overlong"] += prob
    all_side = sum(s["side"] for s in strata.values()) / max(1e-9, sum(s["weight"] for s in strata.values()))
    for k, s in strata.items():
        r = s["rate"] = dict(rate(k))
        s["side_mean"] = s["side"] / s["weight"] if s["weight"] else all_side
        if not pilot:  # rows whose prompt side + the assumed answer exceed render.max_tokens are dropped
            r["keep"] *= 1 - (s["overlong"] / s["weight"] if s["weight"] else 0.0)
        s["requested"] *= scale
    requested = sum(s["requested"] for s in strata.values())
    output_total = sum(s["requested"] * s["rate"]["output"] for s in strata.values())
    requests = sum(s["requested"] * s["rate"]["requests"] for s in strata.values())
    rows = sum(s["requested"] * s["rate"]["keep"] for s in strata.values())
    supervised = sum(s["requested"] * s["rate"]["keep"] * s["rate"]["supervised_per_row"] for s in strata.values())
    shard_prompt = sum(s["requested"] * s["rate"]["keep"] * s["side_mean"] for s in strata.values())
    prompt_total = sum(s["requested"] * s["side_mean"] for s in strata.values())
    dropped = 1 - rows / (requested * a["keep_fraction"]) if not pilot and requested else 0.0
    per_cat = {c: {n: sum(s["requested"] * s["rate"][n] for k, s in strata.items() if k.startswith(c + "/"))
                   / (cats[c]["units"] * scale) for n in ("output", "requests", "keep")} for c in cats}
    shard_tokens = shard_prompt + supervised
    t = profile.render
    num_files = max(1, int(np.ceil(max(shard_tokens / t.shard_max_tokens, rows / t.shard_max_rows))))
    shard_bytes = num_files * file_bytes + shard_tokens * bpt
    server_hours = output_total / a["server_output_tokens_per_s"] / 3600
    plan = {
        "profile": profile.name, "run": str(run.root), "created": time.time(), "source_of_rates": src,
        "scale": {"selected_prompts": len(prompts), "select_total": profile.select.total, "factor": round(scale, 4),
                  "note": ("counts scaled by select.total / selected (the pool is smaller than the profile asks)"
                           if scale > 1 else "the selection is the profile's; no scaling")},
        "categories": {k: {"prompts": round(c["prompts"] * scale), "units": round(c["units"] * scale),
                           "output_tokens_per_unit": round(per_cat[k]["output"], 1),
                           "requests_per_unit": round(per_cat[k]["requests"], 4), "keep": round(per_cat[k]["keep"], 4)}
                       for k, c in sorted(cats.items())},
        "prompts": round(len(prompts) * scale), "units": round(units), "requested_units": round(requested),
        "continuation": {"source": "pilot" if pilot else "assumed: every turn's tool calls match the recorded ones",
                         "pooled": round(go_on_pooled, 4),
                         "kinds": {k: {**go_on_counts.get(k, {}), "rate": round(v, 4)} for k, v in sorted(go_on.items())}},
        "prompt_tokens": {"rendered_units": len(estimates), "render_errors": rendered["errors"],
                          "p50": _pct(estimates, 50), "p90": _pct(estimates, 90), "max": round(max(estimates, default=0)),
                          "mean": round(prompt_total / max(1e-9, requested), 1), "total": round(prompt_total),
                          "renderer": renderer.name, "tokenizer": renderer.tokenizer_name,
                          "history": "earlier turns count as their supervised tokens per row (" + src + ")"},
        "output_tokens": {"per_unit": round(output_total / units, 1), "total": round(output_total), "source": src},
        "requests": {"total": round(requests), "per_unit": round(requests / units, 4),
                     "formula": "sum over strata of units x P(reached) x requests per requested unit"},
        "servers": {"count": a["servers"], "output_tokens_per_s_each": a["server_output_tokens_per_s"],
                    "server_hours": round(server_hours, 2), "wall_hours": round(server_hours / a["servers"], 2),
                    "formula": (f"server-hours = {round(output_total):,} output tokens / "
                                f"{a['server_output_tokens_per_s']:,} tokens/s / 3600; wall = server-hours / "
                                f"{a['servers']}")},
        "shards": {"rows": round(rows), "keep_fraction": round(rows / units, 4), "overlong_drop_fraction": round(dropped, 4),
                   "prompt_tokens": round(shard_prompt), "supervised_tokens": round(supervised),
                   "tokens": round(shard_tokens), "files": num_files, "file_bytes": round(file_bytes),
                   "bytes_per_token": round(bpt, 3), "bytes": round(shard_bytes),
                   "formula": "bytes = files x empty-file bytes + shard tokens x bytes_per_token; per stratum "
                              "(category, first/later turn), over requested units (units x P(reached)): rows = "
                              "x keep, supervised = rows x supervised per row, prompt side = rows x (rendered "
                              "fixed part + earlier turns' supervised tokens) x the pilot's real/estimated ratio"},
        "draft": draft_plan(profile, a, shard_tokens, rows, supervised) if profile.train.draft_preset else {},
        "features": feature_plan(profile, a, target_config(profile)[0], rows, shard_tokens),
        "strata": {k: {"units": round(s["units"] * scale), "requested": round(s["requested"], 1),
                       "prompt_side_mean": round(s["side_mean"], 1), **{n: round(v, 4) for n, v in s["rate"].items()}}
                   for k, s in sorted(strata.items())},
        "assumptions": a, "pilot": measured, "preflight_problems": rep.problems,
        "cells": cell_plan(prompts, scale, a)}
    write_json_atomic(plan, run.root / "plan.json")
    return plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from regen.config import add_profile_arguments

    add_profile_arguments(parser, run_required=False)
    parser.add_argument("--pilot", type=int, default=0, metavar="N", help="send about N units for real to measure")
    parser.add_argument("--sample", type=int, default=2000, help="prompts whose units are rendered (seeded)")
    parser.add_argument("--servers", type=int, default=None, help="inference servers (plan.servers)")
    parser.add_argument("--server-tokens-per-s", dest="server_output_tokens_per_s", type=float, default=None,
                        help="output tokens/s of one server (plan.server_output_tokens_per_s)")
    parser.add_argument("--world-size", type=int, default=None, help="training GPUs (plan.world_size)")
    parser.add_argument("--mfu", type=float, default=None, help="model FLOPs utilisation (plan.mfu)")
    parser.add_argument("--gpu-tflops", dest="gpu_peak_tflops", type=float, default=None,
                        help="dense bf16 peak TFLOPS per GPU (plan.gpu_peak_tflops)")
    parser.add_argument("--output-tokens", type=int, default=None, help="assumed output tokens per unit, every category")
    parser.add_argument("--formulas", action="store_true",
                        help="print each figure's formula below the figures (engines' refusals in full)")


def main(args) -> int:
    from regen.config import load_profile

    profile = load_profile(args.profile, args.overrides)
    run = RunDir.at(args.run or f"runs/plan-{profile.name}")
    flags = {k: getattr(args, k) for k in ("servers", "server_output_tokens_per_s", "world_size", "mfu",
                                           "gpu_peak_tflops", "output_tokens")}
    plan = build_plan(profile, run, pilot=args.pilot, sample=args.sample, flags=flags)
    from regen.report.plan_table import print_plan

    print_plan(plan, formulas=args.formulas)
    print(f"\nwritten: {run.root / 'plan.json'}")
    return 0
