"""`regen generate --recheck`: judge the `ok` rows a run already holds by the checks and policies it has now.

Runs made before a check existed hold rows it would have refused (a finish_reason "abort" stored as a
finished answer, text after the end-of-turn marker, usage that contradicts itself). `recheck` rebuilds each `ok`
row's completion from the row (content, reasoning, tool calls, finish_reason, token counts and ids) and judges it
as the runner judges a fresh answer (`regen.generate.checks.judge`, the profile's policies, end-of-turn markers
and think markers):

* a class whose policy acts (retry, retry_larger, drop) makes the row an error row of that class (its
  `error_detail` says `recheck` and the numbers; it keeps no answer text: the ok row, with its text, stays in
  `quarantine/`), and
  the later turns of that conversation, whose history held the faulty answer, become `skipped` rows
  (`previous_turn_error`): `--retry-errors` then re-sends them (unfinished, text_after_end and over_max_tokens
  are in its default classes; name the others with --classes);
* a row that would only gain a flag (a keep_flagged class, an echoed end-of-turn marker) is counted
  (`would_flag`) and left as it is: keep_flagged keeps it, and render's guards strip or reject what they must;
* every other row is left as it is.

The replaced rows go to `generations/quarantine/` (`ledger.replace_rows`, reason `recheck`; `SELECT * FROM
superseded` shows them); the accounting is unchanged (one row per unit). The max_tokens an answer is checked
against is the request's, grown as retry_larger would have grown it over the row's attempts (an upper bound: a
row is never called over its limit because it was retried larger).
"""
from __future__ import annotations

import json
from pathlib import Path

from regen.config.generate import GenerateConfig
from regen.generate import ledger as ledger_mod
from regen.generate.checks import END_MARKER_STRIPPED, QUALITY_KIND, Completion, judge, strip_echoed_end
from regen.generate.conversation import PREVIOUS_TURN_ERROR, skipped_key

ANSWER_FIELDS = ("content", "reasoning_content", "tool_calls", "prompt_token_ids", "completion_token_ids")


def completion_of(row: dict) -> Completion:
    """The completion an `ok` generation row was made from (usage rebuilt from its token counts)."""
    usage = {k: row.get(f"num_{k}") for k in ("prompt_tokens", "completion_tokens") if row.get(f"num_{k}") is not None}
    if row.get("num_reasoning_tokens") is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": row["num_reasoning_tokens"]}
    calls = [{"id": c.get("id"), "type": c.get("type") or "function", "function": dict(c.get("function") or {})}
             for c in row.get("tool_calls") or []] or None
    return Completion(content=row.get("content"), reasoning_content=row.get("reasoning_content"), tool_calls=calls,
                      finish_reason=row.get("finish_reason"), usage=usage or None,
                      prompt_token_ids=row.get("prompt_token_ids"), completion_token_ids=row.get("completion_token_ids"))


def max_tokens_bound(row: dict, cfg: GenerateConfig) -> int | None:
    """The largest max_tokens the row's attempts can have had (request_params, grown by retry_larger per attempt)."""
    try:
        base = json.loads(row.get("request_params") or "{}").get("max_tokens")
    except (ValueError, AttributeError):
        return None
    if not isinstance(base, int):
        return None
    if cfg.policy("truncated") == "retry_larger":
        factor = cfg.retry.larger_factor ** max(0, (row.get("attempts") or 1) - 1)
        return max(base, min(cfg.retry.max_tokens_cap, int(base * factor)))
    return base


def rejudge(row: dict, cfg: GenerateConfig) -> tuple[dict | None, list[str]]:
    """`(error row or None, flags)`: the error row (no answer text: the ok row keeps it in quarantine/) that
    replaces `row` when a class whose policy acts is found, and the flags the runner would give it now."""
    c = completion_of(row)
    stripped = strip_echoed_end(c, cfg.end_of_turn_markers)
    found = dict(judge(c, cfg.think_markers, cfg.end_of_turn_markers, max_tokens_bound(row, cfg)))
    flags = list(found) + ([END_MARKER_STRIPPED] if stripped else [])
    acting = [k for k in found if cfg.policy(k) != "keep_flagged"]
    if not acting:
        return None, flags
    klass = acting[0]
    new = {**row, "status": "error", "error_class": klass, "flags": list(found), "stop_reason": None,
           "error_detail": f"{QUALITY_KIND[klass]}: recheck ({cfg.policy(klass)}); {found[klass]}"}
    new.update({k: None for k in ANSWER_FIELDS})
    return new, flags


def recheck(cfg: GenerateConfig, gen_dir: Path) -> dict:
    """Judge every `ok` row of `gen_dir` by cfg's checks (module doc) and replace the faulty ones; returns
    {"checked", "now_error": {class: n}, "later_turns_skipped", "would_flag": {flag: n}}. Rows that would only gain
    a flag are left as they are (keep_flagged keeps them; render's guards still apply). Reads one part at a time;
    holds only the (text-free) replacement rows. Must run under the run lock, after `ledger.recover`."""
    gen_dir = Path(gen_dir)
    report = {"checked": 0, "now_error": {}, "later_turns_skipped": 0, "would_flag": {}}
    first: dict[str, dict] = {}  # prompt_id -> the error row of its earliest faulty turn
    for name in sorted(ledger_mod.listed_parts(gen_dir)):
        for row in ledger_mod.read_part(gen_dir / name).to_pylist():
            if row["status"] != "ok":
                continue
            report["checked"] += 1
            new, flags = rejudge(row, cfg)
            for f in set(flags) - set(row.get("flags") or []):
                report["would_flag"][f] = report["would_flag"].get(f, 0) + (new is None)
            if new is not None and (row["prompt_id"] not in first or row["turn"] < first[row["prompt_id"]]["turn"]):
                first[row["prompt_id"]] = new
    report["would_flag"] = {k: v for k, v in report["would_flag"].items() if v}
    if not first:
        return report
    cols = ["request_key", "prompt_id", "turn", "category", "language", "model", "tools", "request_params",
            "finished_at"]
    idx = ledger_mod.read_index(gen_dir, cols).to_pylist()
    remove = {r["request_key"] for r in first.values()}
    new_rows = list(first.values())
    for r in idx:
        stop = first.get(r["prompt_id"])
        if stop is not None and r["turn"] > stop["turn"]:
            remove.add(r["request_key"])
            new_rows.append(_skipped(r, stop))
            report["later_turns_skipped"] += 1
    for r in first.values():
        report["now_error"][r["error_class"]] = report["now_error"].get(r["error_class"], 0) + 1
    ledger_mod.replace_rows(gen_dir, remove, new_rows, "recheck")
    return report


def _skipped(row: dict, stop: dict) -> dict:
    """The skipped row that replaces a later turn of a conversation stopped by the error row `stop`."""
    out = {k: None for k in stop}
    out.update({k: row.get(k) for k in ("prompt_id", "turn", "category", "language", "model", "tools",
                                         "request_params", "finished_at")})
    out.update(request_key=skipped_key(row["prompt_id"], row["turn"], stop["request_key"]), status="skipped",
               stop_reason=PREVIOUS_TURN_ERROR, attempts=0, flags=[])
    return out
