"""`regen eval`'s command line: the flags of `regen.train.eval.run_eval`, its printed summary and tables.

    regen eval --profile local --run runs/local [--draft STEP_DIR] [--num-prompts 32] [--max-new-tokens 64]
               [--temperature 1.0 [--top-p 1] [--draft-sample-method probabilistic,greedy]
                                  [--rejection-sample-method standard,block]]

With --temperature T the drafts are also measured under rejection sampling at T; each pair of
--draft-sample-method x --rejection-sample-method (the names of the engines' speculative configs,
`regen.train.verification`) is measured on the same random streams and printed beside the others.
"""
from __future__ import annotations

from regen.train.eval import run_eval
from regen.train.eval_cells import format_cells


def add_arguments(parser) -> None:
    from regen.config import add_profile_arguments, add_responses_argument

    add_profile_arguments(parser)
    add_responses_argument(parser, "the shard set whose held-out prompts are measured (-> eval.json or "
                                   "eval-original.json)")
    parser.add_argument("--draft", default=None, help="checkpoint folder, or a folder with latest.json (default: "
                        "the run's training directory, <run>/train or train-original/, its latest step)")
    parser.add_argument("--num-prompts", type=int, default=32, help="held-out prompts to evaluate (default 32)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="generated tokens per prompt (default 64)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the untrained draft (default: profile)")
    parser.add_argument("--compare", action="append", default=[], metavar="NAME=DIR",
                        help="another trained draft to measure on the same prompts, e.g. markov_rank_0=runs/abl/train "
                             "(repeatable)")
    parser.add_argument("--confidence-threshold", type=float, default=0.0,
                        help="cut each block before the first slot with confidence < this (default 0: full block)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="also measure under speculative rejection sampling at this temperature (the paper's "
                             "tables: 1.0); default 0: greedy only")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus of the sampled measurement (default 1)")
    parser.add_argument("--draft-sample-method", default=None, help="served protocols at --temperature: "
                        "probabilistic and/or greedy drafting, comma separated (with --rejection-sample-method; "
                        "default probabilistic)")
    parser.add_argument("--rejection-sample-method", default=None, help="standard (token-level) and/or block "
                        "(Sun et al. 2024), comma separated (default standard); each pair is reported under served")


def main(args) -> int:
    import json
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from regen.config import load_profile_from_args

    profile, run = load_profile_from_args(args)
    seed = args.seed if args.seed is not None else profile.train.seed  # null: the profile's (resolved on load)
    from regen.errors import InputError

    compare = {}
    for item in args.compare:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise InputError(f"--compare {item!r}: write NAME=DIR, e.g. markov_rank_0=runs/ablation/train")
        if name in compare:
            raise InputError(f"--compare {name}=...: given twice; use one name per draft")
        compare[name] = path
    from regen.train.verification import parse_methods

    methods = None
    if args.draft_sample_method or args.rejection_sample_method:
        methods = parse_methods(args.draft_sample_method or "probabilistic", args.rejection_sample_method or "standard")
    out = run_eval(profile.train, run, draft_dir=args.draft or run.train, seed=seed, num_prompts=args.num_prompts,
                   max_new_tokens=args.max_new_tokens, confidence_threshold=args.confidence_threshold,
                   compare=compare, temperature=args.temperature, top_p=args.top_p, methods=methods)
    brief = {k: {"acc_len": out[k]["acc_len"], "num_rounds": out[k]["num_rounds"]} for k in out["drafts"]}
    if "sampled" in out:
        for k in out["drafts"]:
            brief[k][f"acc_len_T{args.temperature:g}"] = out["sampled"][k]["acc_len"]
            for key, res in (out.get("served") or {}).items():
                brief[k][f"acc_len_T{args.temperature:g}_{key}"] = res[k]["acc_len"]
    print(json.dumps({**brief, "num_prompts": out["num_prompts"], "seed": out["seed"],
                      "eval_json": str(run.eval_json)}, indent=2))
    print(format_table(out))
    print(format_cells(out))
    held = out.get("heldout") or {}
    if held.get("cells_selected") is not None:
        missing = ", ".join("/".join(str(x or "-") for x in c) for c in held.get("cells_not_measured") or [])
        print(f"cells of the selection measured: {held['cells_measured']} of {held['cells_selected']}"
              + (f" (not measured: {missing}; raise train.heldout_per_cell or --num-prompts)" if missing else ""))
    return 0


def format_table(out: dict) -> str:
    """The per-category acc_len (accept_rate@0) of each draft at T = 0 and, when measured, at the sampled T: token-level
    rejection sampling of probabilistic drafts, then each further served protocol (`--rejection-sample-method`)."""
    t = f"T={out['sampled']['protocol']['temperature']:g}" if "sampled" in out else ""
    temps = [("T=0", out)] + ([(t, out["sampled"])] if "sampled" in out else []) + [
        (f"{t} {key}", res) for key, res in (out.get("served") or {}).items() if key != "probabilistic+standard"]
    cats = sorted({c for name in out["drafts"] for c in out[name]["per_category"]})
    head = ["draft", "category"] + [f"{t} acc_len (accept@0)" for t, _ in temps]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cell(s):
        return "-" if not s or s.get("acc_len") is None else f"{s['acc_len']:.3f} ({s['accept_rate']['0'] or 0:.3f})"

    for name in out["drafts"]:
        for cat in ["all", *cats]:
            row = [name, cat] + [cell(res[name] if cat == "all" else res[name]["per_category"].get(cat))
                                 for _, res in temps]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
