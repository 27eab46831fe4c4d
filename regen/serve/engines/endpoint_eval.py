"""`regen engine-eval --endpoint URL`: acceptance measured on a served endpoint that regen does not start (the user's
own deployment), the way the draft's users report it: chat requests through `/v1/chat/completions` with the
profile's mode bodies (`generate.modes`: the card's `thinking` / `thinking_effort` among them), streamed, at a stated
concurrency, and acceptance read from the engine's own Prometheus counters (`regen.serve.engines.endpoint`).

    regen engine-eval --profile kimi-k3 --run runs/k3 --endpoint http://10.0.0.5:8000 [--metrics-url URL]
        [--baseline-endpoint http://10.0.0.6:8000] [--concurrency 1,8] [--benchmark fastchat_mt_bench,humaneval]
        [--engine vllm] [--model NAME] [--num-prompts 32] [--max-new-tokens 256]

Prompts: the run's held-out prompts (`regen.train.eval.heldout_prompts`, round robin over the category x length band
x mode cells; their first user turn from the selection, sent as messages), and each named benchmark set
(`benchmarks()`: the evaluation sets bundled in data/contamination/, the texts the selection's contamination filter
keeps out of training), each set reported on its own. Attribution: the engine's counters are server-wide, so the
groups run one after another and the counters are read before and after each group (`Counters.__sub__`: a counter
that goes backwards is an error; each read waits for the counters to settle, `settled`); with concurrency 1 they are
also read around each request, which gives acc_len per request. Reported per group and concurrency: requests, rounds
(the engine's drafts), acc_len per round (1 + Σaccepted / Σdrafts) and per request, acceptance per draft position
(accepted at k / drafts, where the engine counts it), completion tokens per second (all of the group's tokens / its
wall time) and, with a baseline endpoint serving the target without the draft, the same requests' tokens/s there and
the speedup. A group whose requests completed but which the engine never drafted for is reported as such (acc_len
None, `num_rounds` 0), never as 1.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BENCHMARK_DIR = Path(__file__).resolve().parents[3] / "data" / "contamination"


def benchmarks() -> list[str]:
    """The names of the bundled benchmark sets (data/contamination/<name>.jsonl)."""
    return sorted(p.stem for p in BENCHMARK_DIR.glob("*.jsonl"))


def benchmark_prompts(name: str, limit: int | None = None) -> list[dict]:
    """The first `limit` prompts of benchmark set `name` (one per user message of the set, in file order) as
    {prompt_id, category, length_band, mode, messages}. InputError naming the sets for an unknown name."""
    import json

    from regen.errors import InputError

    path = BENCHMARK_DIR / f"{name}.jsonl"
    if not path.is_file():
        raise InputError(f"--benchmark {name!r}: no such set; choose from {', '.join(benchmarks())}")
    out = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if limit is not None and len(out) >= limit:
                break
            text = json.loads(line)["prompt"]
            out.append({"prompt_id": f"{name}:{i}", "category": name, "length_band": None, "mode": None,
                        "messages": [{"role": "user", "content": text}], "tools": None})
    return out


def heldout_messages(run, prompts: list[dict]) -> list[dict]:
    """The held-out prompts with the messages of their first generated turn and their tools from the run's selection
    (`prompts/part-*.parquet`). InputError when a prompt is not in the selection."""
    import json

    from regen.errors import InputError
    from regen.generate.runner import iter_prompts
    from schemas.prompt import turn_positions

    want = {p["prompt_id"] for p in prompts}
    parts = sorted(run.prompts.glob("part-*.parquet"))
    rows = {r["prompt_id"]: r for r in iter_prompts(parts) if r["prompt_id"] in want}
    out = []
    for p in prompts:
        row = rows.get(p["prompt_id"])
        if row is None:
            raise InputError(f"held-out prompt {p['prompt_id']} is not in {run.prompts}: the shards and the selection "
                             "are of different runs; give the run both came from")
        first = (turn_positions(row["messages"]) or [len(row["messages"])])[0]
        out.append({**p, "messages": row["messages"][:first], "tools": json.loads(row["tools"]) if row["tools"]
                    else None})
    return out


def groups_of(prompts: list[dict]) -> dict[tuple, list[dict]]:
    """{(category, length_band, mode): prompts} in first-seen order."""
    out: dict[tuple, list[dict]] = {}
    for p in prompts:
        out.setdefault((p.get("category") or "unknown", p.get("length_band"), p.get("mode")), []).append(p)
    return out


def request_body_of(gen_cfg, prompt: dict, max_tokens: int, model: str) -> dict:
    """The chat body of `prompt` under its mode's settings (`GenerateConfig.for_mode`, `request_body`)."""
    from regen.generate.conversation import request_body

    cfg = gen_cfg.for_mode(prompt.get("mode"))
    return {**request_body(cfg, prompt["messages"], prompt.get("tools")), "model": model, "max_tokens": max_tokens}


def run_group(endpoint: str, bodies: list[dict], concurrency: int, *, metrics_url: str | None, engine: str | None):
    """Send `bodies`, `concurrency` at a time; returns (answers, counters of the group or None, per-request counters
    (concurrency 1 only, else []), wall seconds)."""
    from regen.serve.engines.endpoint import settled, stream_chat

    before = settled(metrics_url, engine) if metrics_url else None
    t0 = time.perf_counter()
    per_request = []
    if concurrency == 1 and metrics_url:
        answers = []
        for b in bodies:
            s0 = settled(metrics_url, engine)
            answers.append(stream_chat(endpoint, b))
            per_request.append((settled(metrics_url, engine) - s0).with_requests(1))
    else:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            answers = list(pool.map(lambda b: stream_chat(endpoint, b), bodies))
    wall = time.perf_counter() - t0
    delta = (settled(metrics_url, engine) - before).with_requests(len(bodies)) if metrics_url else None
    return answers, delta, per_request, wall


def group_figures(answers, delta, per_request, wall: float, block_size: int | None) -> dict:
    """The figures of one group (module docstring); acceptance from `delta` (None: a baseline without a draft)."""
    r6 = (lambda x: None if x is None else round(x, 6))  # noqa: E731
    tokens = [a.completion_tokens for a in answers]
    out = {"num_requests": len(answers), "completion_tokens": sum(t or 0 for t in tokens),
           "requests_without_usage": sum(1 for t in tokens if t is None), "wall_s": round(wall, 3),
           "tokens_per_s": r6(sum(t or 0 for t in tokens) / wall) if wall > 0 else None,
           "finish_reasons": {f: sum(1 for a in answers if a.finish_reason == f) for f in {a.finish_reason
                                                                                         for a in answers}}}
    if delta is None:
        return out
    drafts, acc = delta.drafts, delta.accepted
    per_req = [1 + c.accepted / c.drafts for c in per_request if c.drafts and c.accepted is not None]
    K = block_size or (max(delta.per_pos) + 1 if delta.per_pos else 0)
    out.update({"num_rounds": int(drafts), "accepted_draft_tokens": None if acc is None else int(acc),
                "draft_tokens": None if delta.draft_tokens is None else int(delta.draft_tokens),
                "acc_len_per_round": r6(1 + acc / drafts) if drafts and acc is not None else None,
                "acc_len_per_request": r6(sum(per_req) / len(per_req)) if per_req else None,
                "position_acceptance": ([r6(delta.per_pos.get(k, 0.0) / drafts) if drafts else None
                                         for k in range(K)] if delta.per_pos else None)})
    if not drafts and out["completion_tokens"] > len(answers):
        out["warning"] = ("the engine drafted nothing for these requests (its draft counters did not move): is "
                          "speculative decoding on, and is --metrics-url the endpoint's own?")
    return out


def measure(profile, run, *, endpoint: str, metrics_url: str | None = None, baseline: str | None = None,
            concurrency=(1,), benchmark_sets=(), engine: str | None = None, model: str | None = None,
            num_prompts: int = 32, max_new_tokens: int = 256, heldout: bool = True, block_size: int | None = None,
            drafts: dict | None = None, log=print) -> dict:
    """Every group (held-out cells, then each benchmark set) at every concurrency against `endpoint` (and
    `baseline`); the result `run_endpoint_eval` writes. `drafts` {name: step folder}: the trained draft(s) whose
    recorded held-out split is used (`eval_heldout_split`). EndpointError (from `regen.serve.engines.endpoint`) for an
    endpoint that serves another model, lacks a metric or restarts."""
    from regen.serve.engines.endpoint import check_model, detect_engine, get

    model = model or profile.generate.model
    metrics_url = metrics_url or endpoint.rstrip("/") + "/metrics"
    check_model(endpoint, model)
    if baseline:
        check_model(baseline, model)
    engine = engine or detect_engine(get(metrics_url).text)
    sets: dict[str, list[dict]] = {}
    if heldout:
        from regen.train.eval import heldout_prompts
        from regen.train.heldout import eval_heldout_split

        t = profile.train
        held, _ = eval_heldout_split(run, t.heldout_fraction, t.heldout_per_cell, drafts or {})
        sets["heldout"] = heldout_messages(run, heldout_prompts(run, held, num_prompts))
    for name in benchmark_sets:
        sets[name] = benchmark_prompts(name, num_prompts)
    from schemas.io import read_json

    regen = regen_cells(read_json(run.eval_json)) if heldout and run.eval_json.exists() else {}
    result = {"endpoint": endpoint, "metrics_url": metrics_url, "baseline_endpoint": baseline, "engine": engine,
              "model": model, "max_new_tokens": max_new_tokens, "concurrency": list(concurrency), "sets": {}}
    for set_name, prompts in sets.items():
        cells = []
        for key, group in groups_of(prompts).items():
            bodies = [request_body_of(profile.generate, p, max_new_tokens, model) for p in group]
            row = {"category": key[0], "length_band": key[1], "mode": key[2], "by_concurrency": {},
                   **({"regen": regen[key]} if set_name == "heldout" and key in regen else {})}
            for c in concurrency:
                log(f"engine-eval endpoint: {set_name} {'/'.join(str(x or '-') for x in key)}: {len(bodies)} "
                    f"requests at concurrency {c}")
                fig = group_figures(*run_group(endpoint, bodies, c, metrics_url=metrics_url, engine=engine),
                                    block_size)
                if baseline:
                    base = group_figures(*run_group(baseline, bodies, c, metrics_url=None, engine=None), None)
                    fig["baseline_tokens_per_s"] = base["tokens_per_s"]
                    fig["speedup"] = (round(fig["tokens_per_s"] / base["tokens_per_s"], 4)
                                      if fig["tokens_per_s"] and base["tokens_per_s"] else None)
                row["by_concurrency"][str(c)] = fig
            cells.append(row)
        result["sets"][set_name] = {"num_prompts": len(prompts), "cells": cells}
    low = str(min(concurrency))
    aim = aim_breakdown(result["sets"].get("heldout"), low)
    if aim is not None:  # `regen select --aim <this file>` aims the next selection from the engine's figures
        result["draft"] = f"{engine} at {endpoint}"
        result["trained"] = {"breakdown": aim}
    result["averaging"] = {"acc_len_per_round": "1 + Σaccepted / Σdrafts of the group's counters",
                           "acc_len_per_request": "the mean of each request's 1 + accepted / drafts (counters read "
                                                  "around each request; concurrency 1 only)",
                           "tokens_per_s": "the group's completion tokens / its wall seconds (all requests in flight)",
                           "regen": "regen eval's acc_len per round of the same cell (the run's eval.json, trained "
                                    "draft): greedy, token-level at T and each served protocol"}
    return result


def regen_cells(eval_json: dict | None) -> dict[tuple, dict]:
    """{(category, length_band, mode): {protocol: regen eval's acc_len per round}} of the trained draft in an
    eval.json (`regen.train.eval.run_eval`): "greedy" (T = 0), "T=<t>" (token-level rejection sampling) and each
    served protocol ("T=<t> <draft_sample_method>+<rejection_sample_method>"); {} without one."""
    if not eval_json:
        return {}
    out: dict[tuple, dict] = {}
    t = ((eval_json.get("sampled") or {}).get("protocol") or {}).get("temperature")
    sources = [("greedy", eval_json)] + ([(f"T={t:g}", eval_json["sampled"])] if "sampled" in eval_json else []) + [
        (f"T={t:g} {k}", v) for k, v in (eval_json.get("served") or {}).items() if k != "probabilistic+standard"]
    for name, res in sources:
        for c in (((res.get("trained") or {}).get("breakdown") or {}).get("cells") or []):
            out.setdefault((c["category"], c["length_band"], c["mode"]), {})[name] = c["acc_len_per_round"]
    return out


def aim_breakdown(heldout: dict | None, concurrency: str) -> dict | None:
    """The engine's held-out cells at one concurrency in the layout `regen select --aim` reads from an eval.json
    (`trained.breakdown`: cells, by category, overall; `regen.select.aim.cell_figures`), so the next selection can be
    aimed at the cells where the served engine accepts least. Categories and the overall pool the cells' counters
    (1 + Σaccepted / Σdrafts). None without held-out cells."""
    if not heldout:
        return None
    cells, pooled = [], {}
    for c in heldout["cells"]:
        f = c["by_concurrency"].get(concurrency) or {}
        cells.append({"category": c["category"], "length_band": c["length_band"], "mode": c["mode"],
                      "num_requests": f.get("num_requests", 0), "num_rounds": f.get("num_rounds", 0),
                      "acc_len_per_round": f.get("acc_len_per_round")})
        if f.get("num_rounds") and f.get("accepted_draft_tokens") is not None:
            for key in (c["category"], None):
                r, a, n = pooled.get(key, (0, 0, 0))
                pooled[key] = (r + f["num_rounds"], a + f["accepted_draft_tokens"], n + f["num_requests"])

    def fig(key):
        r, a, n = pooled.get(key, (0, 0, 0))
        return {"num_requests": n, "num_rounds": r, "acc_len_per_round": round(1 + a / r, 6) if r else None}

    return {"cells": cells, "by": {"category": {k: fig(k) for k in pooled if k is not None}}, "overall": fig(None),
            "source": f"the engine's counters at concurrency {concurrency}"}


ENDPOINT_COLUMNS = ["set", "category", "length band", "mode", "concurrency", "requests", "rounds", "acc_len/round",
                    "acc_len/request", "tokens/s", "baseline tokens/s", "speedup", "regen eval acc_len"]


def format_endpoint(res: dict) -> str:
    """The result as one markdown table (`ENDPOINT_COLUMNS`)."""
    def cell(x):
        return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)

    rows = []
    for set_name, s in res["sets"].items():
        for c in s["cells"]:
            for conc, f in c["by_concurrency"].items():
                regen = "; ".join(f"{k} {v:.3f}" for k, v in (c.get("regen") or {}).items() if v is not None)
                rows.append([set_name, c["category"], c["length_band"], c["mode"], conc, f["num_requests"],
                             f.get("num_rounds"), f.get("acc_len_per_round"), f.get("acc_len_per_request"),
                             f.get("tokens_per_s"), f.get("baseline_tokens_per_s"), f.get("speedup"), regen or None])
    return "\n".join(["| " + " | ".join(ENDPOINT_COLUMNS) + " |", "|" + "---|" * len(ENDPOINT_COLUMNS)]
                     + ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows])


def run_endpoint_eval(profile, run, args, log=print) -> dict:
    """`regen engine-eval --endpoint`: `measure` with the command's flags; writes `--out` (default
    `<run>/engine-eval-endpoint.json`). InputError for a bad --concurrency or --benchmark."""
    from regen.errors import InputError
    from schemas.io import write_json_atomic

    try:
        conc = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    except ValueError:
        conc = []
    if not conc or min(conc) < 1:
        raise InputError(f"--concurrency {args.concurrency!r}: give positive integers, comma separated (e.g. 1,8)")
    sets = [x.strip() for x in (args.benchmark or "").split(",") if x.strip()]
    for name in sets:
        if name not in benchmarks():
            raise InputError(f"--benchmark {name!r}: no such set; choose from {', '.join(benchmarks())}")
    drafts = {}
    if not args.benchmarks_only:
        from regen.train.checkpoint import find_draft

        try:
            drafts = {"trained": find_draft(args.draft or run.train)}
        except InputError:
            if args.draft:
                raise
    res = measure(profile, run, endpoint=args.endpoint, metrics_url=args.metrics_url, baseline=args.baseline_endpoint,
                  concurrency=conc, benchmark_sets=sets, engine=args.engine, model=args.model,
                  num_prompts=args.num_prompts or profile.train.eval_prompts or 32,
                  max_new_tokens=args.max_new_tokens or profile.train.eval_max_new_tokens or 256,
                  heldout=not args.benchmarks_only, drafts=drafts, log=log)
    write_json_atomic(res, Path(args.out) if args.out else run.root / "engine-eval-endpoint.json")
    return res
