"""`regen engine-eval`: the round trip. The trained draft, exported for llama.cpp, serves the embedded target
through llama.cpp's own DSpark speculative decoding; acceptance is read from the engine's counters on the same
held-out prompts and budget as `regen eval`, and checked against regen's own replay.

    regen engine-eval --profile local --run runs/local [--draft STEP_DIR] [--num-prompts 32] [--max-new-tokens 64]
                      [--gguf-types q8_0,f32] [--no-regen]

For each engine weight type (`--gguf-types`: the served `q8_0` and the trainer's exact weights `f32`) the target is
served twice, one request at a time, greedy, the prompt sent as token ids: without the draft (the reference, with
the top-2 log-probabilities of every position) and with it (`--spec-type draft-dspark`, n_max = block_size, p_min 0).
Reported (`<run>/engine-eval.json`):
- engine acc_len = 1 + accepted / drafts from the `/metrics` counters, per position, averaged per round and per
  request; tokens/s with and without the draft (one request in flight) and their ratio;
- lossless: the answer with the draft against the answer without it, token for token; where they differ, the
  first differing position and the target's own top-2 log-probability gap there (a near-tie flipped by batched
  verification's floating point when the gap is below NEAR_TIE_NATS);
- regen's side (`--no-regen` skips it): the trainer's fp32 target and draft (regen.train.eval) give acc_len under
  regen eval's protocol and under the engine's budget rule (`replay_rounds(..., n_predict=)`: a round drafts
  min(block_size, n_predict - generated - 1) tokens, the last token is decoded without a draft), and the share of
  the engine's answer equal to the trainer target's greedy continuation. Differences have three sources, each
  reported: the budget rule (the two regen figures), the engine's weights (q8_0 against f32) and the engine's
  float arithmetic (f32 engine against regen).
- per cell (where the draft is weak): the engine's figures and regen's replay per category x length band x mode of the held-out
  prompts (`engine_breakdown`, `regen.train.eval_cells.breakdown`), printed as one table per weight type.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

NEAR_TIE_NATS = 0.05  # a top-2 log-probability gap below this is a near-tie batched arithmetic may flip
AGREEMENT_TOLERANCE = 0.05  # |engine acc_len - regen acc_len (engine budget)| on the f32 target, stated in the docs


def _acc(accepted: float, rounds: float) -> float | None:
    return 1.0 + accepted / rounds if rounds else None


def serve_and_measure(serve_cfg, prompts: list[dict], max_new_tokens: int, *, draft_gguf=None, block_size: int = 7,
                      log_path: Path, n_probs: int = 0, log=print) -> list[dict]:
    """Serve the embedded target (with `draft_gguf` when given), one greedy request per prompt in turn; each
    result: {prompt_id, tokens, stop_type, drafts, accepted, draft_tokens, per_pos, predicted_n, predicted_ms, top}."""
    from regen.serve.engines.llama_client import complete, spec_counters
    from regen.target.server import EmbeddedTarget

    cfg = serve_cfg.model_copy(update={"parallel": 1, "warmup": True})
    out = []
    with EmbeddedTarget(cfg, log_path=log_path, draft=draft_gguf, draft_n_max=block_size, log=log) as target:
        for p in prompts:
            before = spec_counters(target.base_url)
            c = complete(target.base_url, p["prompt_ids"], max_new_tokens, n_probs=n_probs)
            d = spec_counters(target.base_url) - before
            out.append({"prompt_id": p["prompt_id"], "category": p.get("category"), "tokens": c.tokens,
                        "stop_type": c.stop_type, "drafts": d.drafts, "accepted": d.accepted,
                        "draft_tokens": d.draft_tokens, "per_pos": d.accepted_per_pos,
                        "predicted_n": c.predicted_n, "predicted_ms": c.predicted_ms, "top": c.top})
    return out


def summarize_engine(results: list[dict], block_size: int) -> dict:
    """acc_len per round (Σaccepted/Σdrafts) and per request (mean of each request's), per-position rates."""
    drafts = sum(r["drafts"] for r in results)
    accepted = sum(r["accepted"] for r in results)
    per_req = [_acc(r["accepted"], r["drafts"]) for r in results if r["drafts"]]
    per_pos = {str(k): (sum(r["per_pos"].get(k, 0.0) for r in results) / drafts if drafts else None)
               for k in range(block_size)}
    return {"acc_len": _acc(accepted, drafts), "acc_len_per_request": sum(per_req) / len(per_req) if per_req else None,
            "num_rounds": drafts, "accepted_draft_tokens": accepted,
            "draft_tokens": sum(r["draft_tokens"] for r in results), "accept_rate_per_position": per_pos,
            "averaging": "acc_len: 1 + Σaccepted / Σrounds over every round of every request (per round); "
                         "acc_len_per_request: the mean of each request's 1 + accepted / rounds"}


def engine_breakdown(prompts: list[dict], results: list[dict], block_size: int) -> dict:
    """The engine's figures per category x length band x mode and per dimension alone, in the
    layout of `regen.train.eval_cells.breakdown`: {"cells": [{category, length_band, mode, **figures}], "by":
    {dimension: {value: figures}}, "overall", "averaging"}. `prompts[i]` is the held-out prompt of `results[i]`
    (`serve_and_measure`). Each figures dict: num_requests, num_rounds (the engine's drafts), acc_len_per_round
    (1 + Σaccepted / Σdrafts), acc_len_per_request (the mean of each request's own), position_acceptance[k]
    (the share of the cell's rounds whose draft k+1 was accepted: llama.cpp's per-position counter / drafts,
    unconditional) and accepted_draft_tokens. The engine reports no per-round proposal lengths, so the
    conditional per-position rate of `regen eval` is not available here."""
    from regen.train.eval_cells import AVERAGING, breakdown

    if len(prompts) != len(results):
        raise ValueError(f"engine_breakdown: {len(prompts)} prompts but {len(results)} results")

    def figures(pairs: list[tuple[dict, dict]]) -> dict:
        rs = [r for _, r in pairs]
        s = summarize_engine(rs, block_size)
        r6 = (lambda x: None if x is None else round(x, 6))  # noqa: E731
        return {"num_requests": len(rs), "num_requests_without_rounds": sum(1 for r in rs if not r["drafts"]),
                "num_rounds": int(s["num_rounds"]), "acc_len_per_round": r6(s["acc_len"]),  # counters: whole numbers
                "acc_len_per_request": r6(s["acc_len_per_request"]),
                "accepted_draft_tokens": int(s["accepted_draft_tokens"]),
                "position_acceptance": [r6(s["accept_rate_per_position"][str(k)]) for k in range(block_size)]}

    return breakdown(list(zip(prompts, results)), block_size, measure=figures, averaging={
        k: AVERAGING[k] for k in ("acc_len_per_round", "acc_len_per_request")} | {
        "position_acceptance": "per position k: llama.cpp's accepted-at-position-k counter / the cell's drafts "
                               "(unconditional)"})


ENGINE_CELL_COLUMNS = ["weights", "category", "length band", "mode", "requests", "rounds", "engine acc_len/round",
                       "engine acc_len/request", "regen replay acc_len/round", "engine - replay"]


def engine_cell_rows(res: dict) -> list[list]:
    """One row per weight type and cell of an engine-eval result (`ENGINE_CELL_COLUMNS`): the engine's acc_len per
    round and per request beside regen's replay of the same prompts under the engine's budget rule, and the
    difference (None where a figure is missing); [] when `res` has no per-cell figures."""
    replay = {(c["category"], c["length_band"], c["mode"]): c
              for c in (((res.get("regen") or {}).get("cells") or {}).get("engine_budget_rule") or {}).get("cells", [])}
    rows = []
    for qtype, r in (res.get("by_gguf_type") or {}).items():
        for c in (r.get("cells") or {}).get("cells", []):
            g = (replay.get((c["category"], c["length_band"], c["mode"])) or {}).get("acc_len_per_round")
            e = c["acc_len_per_round"]
            rows.append([qtype, c["category"], c["length_band"], c["mode"], c["num_requests"], c["num_rounds"], e,
                         c["acc_len_per_request"], g, None if e is None or g is None else round(e - g, 6)])
    return rows


def format_engine_cells(res: dict, gguf_type: str) -> str:
    """`engine_cell_rows` of one weight type as a markdown table; '' when `res` has no per-cell figures."""
    rows = [r[1:] for r in engine_cell_rows(res) if r[0] == gguf_type]
    if not rows:
        return ""

    def cell(x):
        return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)

    head = ENGINE_CELL_COLUMNS[1:]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows])


# What a first difference between the answers with and without the draft is, by what the target's top two and
# the request's end say (`difference_kind`); only a near-tie is explained (greedy verification is lossless, so any
# other kind is a bug in the draft's export or in the engine until shown otherwise).
DIFFERENCE_KINDS = {
    "near_tie": f"the target's top two within {NEAR_TIE_NATS} nats and the other one taken: batched verification's "
                "floating point may flip it",
    "second_choice": f"the target's second choice taken at a gap of {NEAR_TIE_NATS} nats or more: more than arithmetic "
                     "flips; the engine's weights (q8_0) or its verification",
    "stop_not_chosen": "the answer with the draft ends on an end-of-generation token the target did not choose "
                       "there: a stop proposed by the draft emitted without verification",
    "length": "one answer is the other's prefix: they end at different lengths (budget, context or a stop string)",
    "other": "a token outside the target's top two: the draft's tokens emitted without the target's check",
    "batched_arithmetic": "the target alone, given the shared prefix as one batch (as a verification round computes "
                          "it) instead of one token at a time, takes the same token as the answer with the draft: "
                          "the engine's batched and one-token forwards differ in floating point, reproduced without "
                          "the draft (recheck_in_one_batch)",
}
EXPLAINED_KINDS = ("near_tie", "batched_arithmetic")


def difference_kind(without: list[int], with_draft: list[int], i: int, top: list, gap: float | None,
                    stop_type: str | None, batched_top: list | None = None) -> str:
    """The kind (`DIFFERENCE_KINDS`) of the first difference at position `i` of two answers' token ids; `top`: the
    target's top (token, log-probability) pairs at `i` from the run without the draft; `stop_type`: llama.cpp's
    `stop_type` of the request with the draft ("eos", "limit", "word"); `batched_top`: the target alone's top pairs
    at `i` with the shared prefix prefilled in one batch (`recheck_in_one_batch`), None when not rechecked."""
    if i >= len(without) or i >= len(with_draft):
        return "length"
    choices = [t for t, _ in top[:2]]
    if gap is not None and gap < NEAR_TIE_NATS and with_draft[i] in choices:
        return "near_tie"
    if batched_top and batched_top[0][0] == with_draft[i]:
        return "batched_arithmetic"
    if i == len(with_draft) - 1 and stop_type == "eos":
        return "stop_not_chosen"
    if len(choices) == 2 and with_draft[i] == choices[1]:
        return "second_choice"
    return "other"


def lossless(reference: list[dict], with_draft: list[dict], batched: dict | None = None) -> dict:
    """Token-for-token comparison of the answers with and without the draft: the first difference of each
    differing prompt, the target's top-2 log-probability gap there (from the reference run) and its kind
    (`difference_kind`; `batched`: `recheck_in_one_batch`'s {prompt_id: top pairs}, when rechecked). Every
    difference of a kind outside EXPLAINED_KINDS is unexplained and `warning` names them (None when there are
    none)."""
    batched = batched or {}
    same, diffs = 0, []
    for ref, spec in zip(reference, with_draft):
        a, b = ref["tokens"], spec["tokens"]
        if a == b:
            same += 1
            continue
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        top = ref["top"][i] if i < len(ref["top"]) else []
        gap = (top[0][1] - top[1][1]) if len(top) >= 2 else None
        one_batch = batched.get(ref["prompt_id"])
        kind = difference_kind(a, b, i, top, gap, spec.get("stop_type"), one_batch)
        diffs.append({"prompt_id": ref["prompt_id"], "position": i, "without_draft": a[i] if i < len(a) else None,
                      "with_draft": b[i] if i < len(b) else None, "top2": top[:2], "logprob_gap": gap,
                      "one_batch_top": one_batch[:4] if one_batch else None, "shared_prefix": a[:i],
                      "near_tie": kind == "near_tie", "kind": kind, "kind_means": DIFFERENCE_KINDS[kind]})
    kinds = {k: sum(1 for d in diffs if d["kind"] == k) for k in DIFFERENCE_KINDS}
    unexplained = [d for d in diffs if d["kind"] not in EXPLAINED_KINDS]
    warning = None
    if unexplained:
        warning = (f"{len(unexplained)} of {len(reference)} answers differ from the target alone beyond a near-tie ("
                   + ", ".join(f"{d['prompt_id']} at token {d['position']}: {d['kind']}" for d in unexplained)
                   + "): greedy verification is lossless, so check the draft's export and the engine")
    return {"num_prompts": len(reference), "identical": same, "differing": len(diffs),
            "differing_near_tie": kinds["near_tie"], "differing_batched_arithmetic": kinds["batched_arithmetic"],
            "differing_unexplained": len(unexplained), "kinds": kinds,
            "first_differences": diffs, "near_tie_nats": NEAR_TIE_NATS, "warning": warning}


def recheck_in_one_batch(serve_cfg, prompts: list[dict], first: dict, *, log_path: Path, n_probs: int = 8,
                         log=print) -> dict:
    """The target alone (no draft), asked again at each first difference of `first` (`lossless`'s result without
    a recheck) that is neither explained (EXPLAINED_KINDS) nor a `length` difference: the prompt and the shared
    answer prefix (`prompt_ids + shared_prefix`) sent as one prompt, so the engine computes the position in one
    prefilled batch, as a verification round does, not one token at a time as the reference run did. Returns
    {prompt_id: [(token, log-probability), ...] its top `n_probs` there, best first}; {} when nothing needs it (no
    server is started)."""
    from regen.serve.engines.llama_client import complete
    from regen.target.server import EmbeddedTarget

    by_id = {p["prompt_id"]: p for p in prompts}
    todo = [(by_id[d["prompt_id"]], d["shared_prefix"]) for d in first["first_differences"]
            if d["kind"] not in (*EXPLAINED_KINDS, "length")]
    if not todo:
        return {}
    cfg = serve_cfg.model_copy(update={"parallel": 1, "warmup": True})
    out = {}
    with EmbeddedTarget(cfg, log_path=log_path, log=log) as target:
        for p, prefix in todo:
            c = complete(target.base_url, list(p["prompt_ids"]) + list(prefix), 1, n_probs=n_probs)
            out[p["prompt_id"]] = c.top[0] if c.top else []
    return out


def speed(reference: list[dict], with_draft: list[dict]) -> dict:
    tps = [sum(r["predicted_n"] for r in rs) / max(1e-9, sum(r["predicted_ms"] for r in rs) / 1e3)
           for rs in (reference, with_draft)]
    return {"tokens_per_s_target_alone": tps[0], "tokens_per_s_with_draft": tps[1], "speedup": tps[1] / tps[0],
            "in_flight": 1, "note": "decode tokens / decode seconds from llama.cpp's timings, one request at a time"}


REFERENCE_BATCH = 8  # prompts per batched greedy generation of `regen_side` (the fp32 trainer target, on the CPU)


def regen_side(train_cfg, prompts: list[dict], ddir: Path, max_new_tokens: int, *, engine_tokens=None) -> dict:
    """regen's own acc_len of the trained draft on the same prompts (trainer fp32 target): regen eval's protocol
    and the engine's budget rule; `engine_tokens` {gguf_type: [tokens per prompt]}: how much of each engine's
    answer equals the fp32 target's greedy continuation. `ddir`: a step folder, a training directory or a run
    (its latest step: `regen.train.checkpoint.find_draft`); InputError when none holds a checkpoint."""
    import torch

    from regen.config import resolve_path
    from regen.train.checkpoint import find_draft
    from regen.train.draft_config import DSparkConfig
    from regen.train.eval import greedy_continuations, greedy_reference, proposal_table, replay_rounds, summarize
    from regen.train.eval_cells import breakdown
    from regen.train.model import load_draft
    from regen.train.target import TargetContract, TargetFeatures

    ddir = find_draft(ddir)
    dcfg = DSparkConfig.from_json(ddir / "config.json")
    target = TargetFeatures.from_pretrained(resolve_path(train_cfg.target), TargetContract.from_draft_config(dcfg),
                                            device="cpu")
    draft = load_draft(ddir, target_model=target.model).eval()
    gen = getattr(target.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    stop = sorted({*(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])),
                   *dcfg.eos_token_id})
    K = dcfg.block_size
    standard, engine_rule, agree = [], [], {k: [] for k in (engine_tokens or {})}
    per_prompt: dict[str, list] = {"protocol": [], "engine_budget_rule": []}  # (prompt, rounds) for the cells
    with torch.no_grad():
        generated = [seq for i in range(0, len(prompts), REFERENCE_BATCH) for seq in greedy_continuations(
            target, [p["prompt_ids"] for p in prompts[i:i + REFERENCE_BATCH]], max_new_tokens + K + 1, stop)]
        for n, p in enumerate(prompts):
            seq, argmax, taps = greedy_reference(target, p["prompt_ids"], max_new_tokens + K + 1, stop,
                                                 sequence=generated[n])
            P = len(p["prompt_ids"])
            table = proposal_table(draft, taps, seq, P)
            std = replay_rounds(lambda pos, t=table: t[pos - P], seq, argmax, P, max_new_tokens=max_new_tokens,
                                block_size=K, stop_ids=stop)
            eng = replay_rounds(lambda pos, t=table: t[pos - P] if pos - P < len(t) else None, None, argmax, P,
                                n_predict=max_new_tokens, block_size=K, stop_ids=stop)
            standard += std
            engine_rule += eng
            per_prompt["protocol"].append((p, std))
            per_prompt["engine_budget_rule"].append((p, eng))
            ref = seq[P:]
            for k, toks in (engine_tokens or {}).items():
                e = toks[n]
                same = next((i for i, (x, y) in enumerate(zip(e, ref)) if x != y), min(len(e), len(ref)))
                agree[k].append((same, len(e)))
    target.close()
    out = {"protocol": summarize(standard, K), "engine_budget_rule": summarize(engine_rule, K), "stop_token_ids": stop,
           "cells": {k: breakdown(v, K) for k, v in per_prompt.items()}}
    out["engine_answer_equal_to_fp32_greedy"] = {
        k: {"tokens_equal_before_first_difference": sum(s for s, _ in v), "tokens": sum(n for _, n in v),
            "prompts_identical": sum(1 for s, n in v if s >= n)} for k, v in agree.items()}
    return out


def ensure_engine_gguf(serve_cfg, gguf_type: str, log=print) -> None:
    """The embedded target's `engine-<gguf_type>.gguf`, written from the same source GGUF when missing."""
    from regen.config import resolve_path
    from regen.target.prepare_model import MODELS, prepare_model

    name = resolve_path(serve_cfg.model_dir).name
    if name in MODELS:
        prepare_model(name, resolve_path(serve_cfg.model_dir), gguf_types=(gguf_type,), log=log)


def export_for_llama_cpp(profile, run, draft_dir: Path, out: Path | None = None, log=print) -> tuple[Path, dict]:
    """The llama.cpp export of `draft_dir` (reused when `out/launch.json` names the same weights). Returns
    (gguf path, launch record)."""
    from regen.serve.engines import export_draft
    from regen.serve.engines.cli import default_target_gguf
    from regen.serve.engines.llama_cpp import GGUF_NAME
    from schemas.io import read_json, sha256_file

    out = out or run.root / "export" / "llama.cpp"
    done = read_json(out / "launch.json")
    sha = sha256_file(draft_dir / "model.safetensors")
    if done and (done.get("draft") or {}).get("model_safetensors_sha256") == sha and (out / GGUF_NAME).exists():
        return out / GGUF_NAME, done
    rec = export_draft(draft_dir, "llama.cpp", out, target_gguf=default_target_gguf(profile),
                       target_path=profile.train.target)
    log(f"engine-eval: exported {draft_dir} -> {out / GGUF_NAME}")
    return out / GGUF_NAME, rec


def run_engine_eval(profile, run, *, draft_dir=None, num_prompts: int | None = None,
                    max_new_tokens: int | None = None, gguf_types=("q8_0",), regen: bool = True,
                    out_path: Path | None = None, log=print) -> dict:
    """The round trip (module docstring) on the run's held-out prompts; writes `<run>/engine-eval.json`.

    Raises InputError when the profile serves no embedded llama.cpp target, the run has no checkpoint or no
    held-out prompt, or the draft does not fit llama.cpp (EngineRefused, with every reason)."""
    from regen.errors import InputError
    from regen.target.server import resolve_engine
    from regen.train.checkpoint import find_draft
    from regen.train.draft_config import DSparkConfig
    from regen.train.eval import heldout_prompts
    from schemas.io import write_json_atomic

    t0 = time.time()
    serve = profile.serve
    if not serve.enabled or resolve_engine(serve, log) != "llama.cpp":
        raise InputError("regen engine-eval serves the embedded target with llama.cpp: the profile needs "
                         "serve.enabled true and serve.engine llama.cpp (with xllamacpp installed: scripts/setup.sh)")
    ddir = find_draft(draft_dir or run.train)
    cfg = DSparkConfig.from_json(ddir / "config.json")
    gguf, launch = export_for_llama_cpp(profile, run, ddir, log=log)
    t = profile.train
    n = num_prompts or t.eval_prompts or 32
    max_new = max_new_tokens or t.eval_max_new_tokens or 64
    from regen.train.heldout import eval_heldout_split

    held, _ = eval_heldout_split(run, t.heldout_fraction, t.heldout_per_cell, {"trained": ddir})
    prompts = heldout_prompts(run, held, n)
    if not prompts:
        raise InputError(f"no held-out prompts in {run.shards} at train.heldout_fraction={held.fraction}: "
                         "raise it or train.heldout_per_cell (and retrain) or add prompts")
    K = cfg.block_size
    logs = run.root / "serve"
    result = {"engine": "llama.cpp", "engine_version": launch["engine_version"], "draft": str(ddir),
              "draft_gguf": str(gguf), "block_size": K, "num_prompts": len(prompts), "max_new_tokens": max_new,
              "protocol": "greedy; prompt as token ids; one request at a time; acc_len = 1 + accepted / rounds from "
                          "llama.cpp's /metrics (prefill token not counted, bonus counted: spec §7)",
              "by_gguf_type": {}}
    tokens = {}
    for qtype in gguf_types:
        ensure_engine_gguf(serve, qtype, log)
        s = serve.model_copy(update={"gguf_type": qtype})
        log(f"engine-eval: {qtype}: target alone, {len(prompts)} prompts x {max_new} tokens")
        ref = serve_and_measure(s, prompts, max_new, log_path=logs / f"engine-eval-{qtype}-alone.log", n_probs=2,
                                log=log)
        log(f"engine-eval: {qtype}: with the draft ({gguf.name}, n_max {K})")
        spec = serve_and_measure(s, prompts, max_new, draft_gguf=gguf, block_size=K,
                                 log_path=logs / f"engine-eval-{qtype}-draft.log", log=log)
        tokens[qtype] = [r["tokens"] for r in spec]
        batched = recheck_in_one_batch(s, prompts, lossless(ref, spec),
                                       log_path=logs / f"engine-eval-{qtype}-recheck.log", log=log)
        result["by_gguf_type"][qtype] = {
            "engine": summarize_engine(spec, K), "cells": engine_breakdown(prompts, spec, K),
            "lossless": lossless(ref, spec, batched), "speed": speed(ref, spec),
            "per_request": [{k: r[k] for k in ("prompt_id", "category", "drafts", "accepted", "predicted_n",
                                               "stop_type")} | {"length_band": p.get("length_band"),
                                                                "mode": p.get("mode")} for p, r in zip(prompts, spec)]}
    if regen:
        log("engine-eval: regen's replay of the same prompts (trainer fp32 target)")
        result["regen"] = regen_side(t, prompts, ddir, max_new, engine_tokens=tokens)
        for qtype, r in result["by_gguf_type"].items():
            e, g = r["engine"]["acc_len"], result["regen"]["engine_budget_rule"]["acc_len"]
            r["agreement"] = {"engine_minus_regen_engine_budget": None if e is None or g is None else e - g,
                              "tolerance_f32": AGREEMENT_TOLERANCE}
    result["elapsed_s"] = round(time.time() - t0, 1)
    write_json_atomic(result, out_path or run.root / "engine-eval.json")
    return result


def headline(res: dict) -> str:
    """One line per weight type: engine acc_len, regen's, the speedup, the lossless count."""
    lines = []
    for qtype, r in res["by_gguf_type"].items():
        e, sp, ll = r["engine"], r["speed"], r["lossless"]
        rg = (res.get("regen") or {}).get("engine_budget_rule", {}).get("acc_len")
        lines.append(f"llama.cpp {qtype}: acc_len {e['acc_len']:.3f} (regen replay {rg:.3f}) " if rg is not None
                     else f"llama.cpp {qtype}: acc_len {e['acc_len']:.3f} ")
        lines[-1] += (f"over {int(e['num_rounds'])} rounds; {sp['tokens_per_s_with_draft']:.1f} tok/s with the draft "
                      f"vs {sp['tokens_per_s_target_alone']:.1f} alone ({sp['speedup']:.2f}x); identical answers "
                      f"{ll['identical']}/{ll['num_prompts']} ({ll['differing_near_tie']} near-ties, "
                      f"{ll.get('differing_batched_arithmetic', 0)} reproduced by the target alone in one batch)")
        if ll.get("warning"):
            lines.append(f"warning: llama.cpp {qtype}: {ll['warning']}")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    from regen.config import add_profile_arguments

    add_profile_arguments(parser)
    parser.add_argument("--draft", default=None, help="a step folder (default: the run's latest)")
    parser.add_argument("--num-prompts", type=int, default=None, help="held-out prompts (default train.eval_prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens per answer (default "
                        "train.eval_max_new_tokens)")
    parser.add_argument("--gguf-types", default="q8_0", help="engine weight types to serve the target with, comma "
                        "separated: q8_0 (served), f32 (the trainer's weights exactly), f16")
    parser.add_argument("--no-regen", action="store_true", help="skip regen's own replay of the same prompts")
    g = parser.add_argument_group("a served endpoint regen does not start (regen.serve.engines.endpoint_eval)")
    g.add_argument("--endpoint", default=None, help="base URL of the engine serving the target with the draft "
                   "(e.g. http://10.0.0.5:8000): measure it instead of starting llama.cpp")
    g.add_argument("--metrics-url", default=None, help="its Prometheus metrics (default <endpoint>/metrics)")
    g.add_argument("--baseline-endpoint", default=None, help="the same target served without the draft: tokens/s "
                   "and the speedup at each concurrency")
    g.add_argument("--concurrency", default="1", help="requests in flight, comma separated (default 1; 1 also "
                   "gives acc_len per request)")
    g.add_argument("--benchmark", default=None, help="bundled benchmark sets, comma separated (data/contamination: "
                   "fastchat_mt_bench, humaneval, mbpp, ...), each reported on its own")
    g.add_argument("--benchmarks-only", action="store_true", help="measure the benchmark sets only, not the "
                   "run's held-out cells")
    g.add_argument("--engine", default=None, choices=["vllm", "sglang", "tokenspeed", "llama.cpp"],
                   help="the engine behind --endpoint (default: from its metric names)")
    g.add_argument("--model", default=None, help="the model id the endpoint must serve (default generate.model)")
    g.add_argument("--out", default=None, help="result JSON (default <run>/engine-eval-endpoint.json)")


def main(args) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from regen.config import load_profile_from_args
    from regen.errors import InputError
    from regen.target.gguf_weights import GGUF_TYPES

    profile, run = load_profile_from_args(args)
    if args.endpoint:
        from regen.serve.engines.endpoint_eval import format_endpoint, run_endpoint_eval

        res = run_endpoint_eval(profile, run, args)
        print(format_endpoint(res))
        return 0
    types = tuple(x.strip() for x in args.gguf_types.split(",") if x.strip())
    bad = [x for x in types if x not in GGUF_TYPES]
    if bad or not types:
        raise InputError(f"--gguf-types {args.gguf_types!r}: choose from {', '.join(GGUF_TYPES)}")
    res = run_engine_eval(profile, run, draft_dir=args.draft, num_prompts=args.num_prompts,
                          max_new_tokens=args.max_new_tokens, gguf_types=types, regen=not args.no_regen)
    print(headline(res))
    for qtype in res["by_gguf_type"]:
        table = format_engine_cells(res, qtype)
        if table:
            print(f"\nllama.cpp {qtype}, per category x length band x mode:\n{table}")
    print(json.dumps({k: v for k, v in res.items() if k != "by_gguf_type"} | {
        "by_gguf_type": {q: {k: v for k, v in r.items() if k != "per_request"} for q, r in res["by_gguf_type"].items()}},
        indent=2, default=str)[:6000])
    return 0
