"""The engine's own arithmetic, without a draft: llama.cpp's target computes the same position from the same tokens
once with the answer prefix decoded one token at a time and once with it prefilled in one batch; the top
log-probabilities of the two differ by what its batched and one-token kernels differ by, per weight type.

    .venv/bin/python -P bench/batch_vs_decode.py --run runs/local [--profile local] [--gguf-types q8_0,f32]

The positions are the first differences of the run's `engine-eval.json` that `recheck_in_one_batch` rechecked
(`one_batch_top` set: kind `batched_arithmetic` or not), each with its prompt (the run's held-out prompts) and the
shared answer prefix (`shared_prefix`). For each weight type, the target alone (regen.target.server.EmbeddedTarget,
one slot) answers:

* **one token at a time**: prompt + prefix[:k] for k = 0..i, each request reusing the slot's KV cache
  (`cache_prompt`), so each new prefix token is computed in a batch of one, as a decode step computes it;
* **one batch**: prompt + prefix without the cache, as `recheck_in_one_batch` (and a verification round) computes it;

and the top-2 at position i of each is printed with the largest |Δ log-probability| over the tokens both list.
The weights differ, the tokens do not: a gap that is wide for q8_0 and narrow for f32 is the quantized kernels' own.
"""
from __future__ import annotations

import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
from _preamble import sibling  # noqa: E402 - bench/ off sys.path, the repository root first, HF offline

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402


def tops_both_ways(serve_cfg, prompt_ids: list[int], prefix: list[int], log_path: Path, n_probs: int = 4):
    """(top at len(prefix) decoded one token at a time, top in one batch): [(token, logprob), ...] each."""
    from regen.serve.engines.llama_client import complete
    from regen.target.server import EmbeddedTarget

    cfg = serve_cfg.model_copy(update={"parallel": 1, "warmup": True})
    with EmbeddedTarget(cfg, log_path=log_path, log=lambda *_: None) as t:
        one_batch = complete(t.base_url, prompt_ids + prefix, 1, n_probs=n_probs).top[0]
        for k in range(len(prefix) + 1):  # k = 0: the prompt prefilled, as the reference run did
            stepwise = complete(t.base_url, prompt_ids + prefix[:k], 1, n_probs=n_probs, cache_prompt=True).top[0]
    return stepwise, one_batch


def max_delta(a, b) -> float | None:
    da, db = dict(a), dict(b)
    common = set(da) & set(db)
    return max(abs(da[t] - db[t]) for t in common) if common else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--profile", default="local")
    ap.add_argument("--gguf-types", default="q8_0,f32")
    ap.add_argument("--gguf-type-of-answers", default="q8_0", help="the weight type whose engine-eval answers "
                    "give the positions")
    args = ap.parse_args()

    from regen.config import load_profile
    from regen.rundir import RunDir
    from regen.serve.engines.spec_eval import ensure_engine_gguf
    from regen.train.checkpoint import find_draft
    from regen.train.eval import heldout_prompts
    from regen.train.heldout import eval_heldout_split
    from schemas.io import read_json

    profile, run = load_profile(args.profile), RunDir.at(args.run)
    res = read_json(run.root / "engine-eval.json")
    if not res:
        print(f"{run.root / 'engine-eval.json'}: missing; run `regen engine-eval --run {args.run}` first")
        return 2
    ll = res["by_gguf_type"][args.gguf_type_of_answers]["lossless"]
    diffs = [d for d in ll["first_differences"] if d.get("one_batch_top")]
    t = profile.train
    held, _ = eval_heldout_split(run, t.heldout_fraction, t.heldout_per_cell, {"trained": find_draft(res["draft"])})
    prompts = {p["prompt_id"]: p for p in heldout_prompts(run, held, res["num_prompts"])}
    print(json.dumps({"machine": sibling("spec_decode").cpu_line(), "positions": len(diffs)}), flush=True)
    if not diffs:
        print("no rechecked difference in engine-eval.json: nothing to reproduce")
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="bench-batch-vs-decode-"))
    rows = []
    for qtype in [x.strip() for x in args.gguf_types.split(",") if x.strip()]:
        ensure_engine_gguf(profile.serve, qtype, log=lambda *_: None)
        serve = profile.serve.model_copy(update={"gguf_type": qtype})
        for d in diffs:
            p = prompts[d["prompt_id"]]
            prefix = list(d["shared_prefix"])
            step, batch = tops_both_ways(serve, list(p["prompt_ids"]), prefix, tmp / f"{qtype}.log")
            rows.append({"gguf_type": qtype, "prompt_id": d["prompt_id"], "position": d["position"],
                         "one_token_at_a_time": step[:2], "one_batch": batch[:2], "max_abs_delta": max_delta(step, batch),
                         "argmax_flips": step[0][0] != batch[0][0]})
            print(json.dumps(rows[-1]), flush=True)
    print("\n| weights | prompt | position | one token at a time (top 2) | one batch (top 2) | max abs delta (nats) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        fmt = lambda top: ", ".join(f"{tok} {lp:.3f}" for tok, lp in top)  # noqa: E731
        print(f"| {r['gguf_type']} | {r['prompt_id'][:12]} | {r['position']} | {fmt(r['one_token_at_a_time'])} | "
              f"{fmt(r['one_batch'])} | {r['max_abs_delta']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
