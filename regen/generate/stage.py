"""`regen generate`: regenerate every prompt with the target over OpenAI-compatible HTTP into generations/.

    regen generate --profile P --run DIR [--endpoint URL ...] [--max-in-flight N] [--ray ADDRESS|auto|local]
                   [--repair] [--recheck] [--retry-errors [--classes server_error,timeout,...]]

Reads `prompts/part-*.parquet`, writes `generations/` (see `regen.generate.ledger` for the layout and the exactly-once
rules): one GENERATION_SCHEMA row per (prompt_id, turn) unit (`regen.generate.conversation` defines units, history and
keys), with status ok | error | skipped. Failures are rows: transport classes are retried with jittered
backoff, quality classes follow the profile's policies (`regen.generate.checks`); only a fatal class (`auth`) stops
the run. The same command resumes after a crash: recorded units are never requested again.

Identity checked on resume (`generations/request_config.json`): the request config (model, sampling, extra
body: changes every request key) and the acceptance rules (`generate.policies.*` with defaults filled in, and
`generate.think_markers`: they decide which answers became rows). A change in either is refused with the fields
that changed; rows accepted under other rules are never mixed in.

Damaged parts (`regen.generate.ledger.verify_parts`: sha256, size, footer, rows against the ledger) stop the run
with an InputError naming each file; `--repair` quarantines them and re-requests exactly their rows.
`--recheck` judges the `ok` rows already held by the current checks (runs made before a check existed:
`regen.generate.recheck`); faulty ones become error rows that `--retry-errors` re-sends. A stamp that predates a
rule (a policy added later, the end-of-turn markers) is not a change: the rule is adopted and recorded.
`--retry-errors` re-sends the error rows of the chosen classes (default: RETRY_DEFAULT, the transient ones and
the server faults a new sample fixes) and the
later turns skipped after them: those rows move to `generations/quarantine/` (listed in the ledger, visible in
`regen query` as `superseded`), the units are requested again, and the manifest's `retries` says what came back.

The run ends with the accounting `generated + error rows + skipped == units` (units = sum over prompts of
their turn positions), printed and stored in `generations/manifest.json` with a metrics summary; the
per-minute throughput table goes to `generations/throughput.parquet`.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import time
from pathlib import Path

from regen.config.generate import DEFAULT_POLICIES, GenerateConfig
from regen.errors import InputError
from regen.generate import ledger as ledger_mod
from regen.generate.checks import PERMANENT, QUALITY_CLASSES, RETRY_DEFAULT, TRANSIENT
from regen.generate.client import redact_url
from regen.generate.conversation import request_config, turn_positions
from regen.generate.endpoints import require_endpoints
from regen.generate.metrics import merge_summaries, write_throughput
from regen.generate.runner import FatalStop, iter_prompts, run_shard  # noqa: F401 (FatalStop re-exported)
from regen.rundir import RunDir
from schemas.generation import SCHEMA_VERSION, STATUSES
from schemas.io import read_json, write_json_atomic
from schemas.prompt import canonical_json

# ---------------------------------------------------------------- inputs


def resolve_endpoints(cfg: GenerateConfig, endpoints: list[str] | None) -> list[str]:
    """Endpoint base URLs from the command line, else the profile (env vars expanded, comma lists split).

    Raises InputError when none is given or a `${VAR}` is unset.
    """
    raw = list(endpoints or cfg.endpoints)
    out = []
    for item in raw:
        value = os.path.expandvars(item)
        if "${" in value or (value.startswith("$") and value[1:].isidentifier()):
            raise InputError(f"generate.endpoints: {item!r} names an unset environment variable; export it "
                             "or pass --endpoint http://HOST:PORT/v1")
        out.extend(u.strip().rstrip("/") for u in value.split(",") if u.strip())
    if not out:
        raise InputError("no endpoint: pass --endpoint http://HOST:PORT/v1 or set generate.endpoints in the profile")
    for u in out:
        if not re.match(r"^https?://", u):
            raise InputError(f"endpoint {u!r} must start with http:// or https:// (e.g. http://127.0.0.1:8000/v1)")
    return out


def api_key_from_env(cfg: GenerateConfig) -> str | None:
    """The API key from the variable named by `generate.api_key_env` (never from the profile itself)."""
    if not cfg.api_key_env:
        return None
    key = os.environ.get(cfg.api_key_env)
    if not key:
        raise InputError(f"generate.api_key_env names {cfg.api_key_env!r}, which is not set: export {cfg.api_key_env}=...")
    return key


def prompt_files(run: RunDir) -> list[Path]:
    """Prompt parts listed in prompts/manifest.json (else the directory's part-*.parquet). InputError if none."""
    manifest = read_json(run.prompts / "manifest.json") or {}
    listed = [run.prompts / (p["path"] if isinstance(p, dict) else p) for p in manifest.get("parts", [])]
    files = [p for p in listed if p.exists()] or sorted(run.prompts.glob("part-*.parquet"))
    if not files:
        raise InputError(f"no prompts in {run.prompts}: run `regen select --run {run.root}` first")
    return files


# ---------------------------------------------------------------- the stage


def config_hash(cfg: GenerateConfig) -> str:
    return hashlib.sha256(canonical_json(request_config(cfg)).encode()).hexdigest()[:16]


def accounting(gen_dir: Path, files: list[Path]) -> dict:
    """Count rows by status from disk and check them against the units of the prompts.

    `balanced` is true when every (prompt_id, turn) unit has exactly one row:
    generated (ok) + error + skipped == units, with no duplicate and no stray unit.
    """
    idx = ledger_mod.read_index(gen_dir, ["prompt_id", "turn", "status"]).to_pydict()
    counts = {s: 0 for s in STATUSES}
    for s in idx["status"]:
        counts[s] = counts.get(s, 0) + 1
    units = set()
    num_prompts = 0
    for p in iter_prompts(files):
        num_prompts += 1
        units.update((p["prompt_id"], t) for t in range(len(turn_positions(p["messages"]))))
    seen = list(zip(idx["prompt_id"], idx["turn"]))
    unique = set(seen)
    return {
        "prompts": num_prompts, "units": len(units), "generated": counts["ok"], "error": counts["error"],
        "skipped": counts["skipped"], "rows": len(seen), "duplicates": len(seen) - len(unique),
        "missing": len(units - unique), "stray": len(unique - units),
        "balanced": len(seen) == len(unique) == len(units) and unique == units,
    }


def acceptance(cfg: GenerateConfig) -> dict:
    """The rules that decide which answers become rows: every quality class's policy (defaults filled in), the
    think markers and the end-of-turn markers. Part of the identity checked on resume."""
    return {"policies": {k: cfg.policy(k) for k in sorted(DEFAULT_POLICIES)}, "think_markers": list(cfg.think_markers),
            "end_of_turn_markers": list(cfg.end_of_turn_markers)}


def adopted_rules(stamp: dict | None, cfg: GenerateConfig) -> list[str]:
    """Acceptance rules the stamp of a run made before they existed does not record (a policy added later, the
    end-of-turn markers): `field = value` lines, adopted at the value `cfg` gives them (its default unless the
    profile sets it). The rows recorded before were not judged by them; `regen generate --recheck` judges them."""
    was = (stamp or {}).get("acceptance")
    if was is None:
        return []
    now = acceptance(cfg)
    out = [f"generate.policies.{k} = {v}" for k, v in now["policies"].items() if k not in was.get("policies", {})]
    if "end_of_turn_markers" not in was:
        out.append(f"generate.end_of_turn_markers = {now['end_of_turn_markers']}")
    return out


def check_identity(cfg: GenerateConfig, gen_dir: Path) -> dict | None:
    """The stamp of `gen_dir` (None for a new directory). Raises InputError when the request config or the
    acceptance rules differ from the stamp's, naming what changed and what to do. A rule the stamp does not
    record (it predates the rule) is not a change: it is adopted (`adopted_rules`, recorded by the run)."""
    stamp = read_json(gen_dir / "request_config.json")
    chash = config_hash(cfg)
    if stamp and stamp.get("config_hash") != chash:
        raise InputError(f"{gen_dir} was generated with another request config ({stamp.get('config_hash')} != {chash}: "
                         "model, sampling or extra_body changed); use a new --run directory or remove generations/")
    if stamp and stamp.get("acceptance") is not None:
        was, now = stamp["acceptance"], acceptance(cfg)
        known = was.get("policies", {})
        changed = [f"generate.policies.{k}: {known[k]} -> {v}"
                   for k, v in now["policies"].items() if k in known and known[k] != v]
        restore = [f"--set generate.policies.{k}={known[k]}"
                   for k, v in now["policies"].items() if k in known and known[k] != v]
        if "end_of_turn_markers" in was and was["end_of_turn_markers"] != now["end_of_turn_markers"]:
            changed.append(f"generate.end_of_turn_markers: {was['end_of_turn_markers']} -> {now['end_of_turn_markers']}")
            restore.append("generate.end_of_turn_markers as before")
        if was.get("think_markers") != now["think_markers"]:
            changed.append(f"generate.think_markers: {was.get('think_markers')} -> {now['think_markers']}")
            restore.append("generate.think_markers as before")
        if changed:
            raise InputError(f"{gen_dir} was generated under other response policies ({'; '.join(changed)}): its rows "
                             "were accepted or rejected under the recorded ones and would be mixed with rows judged "
                             f"by the new ones. Restore the recorded values ({' '.join(restore)}), or use a new --run "
                             "directory (or remove generations/) to apply the new policies")
    return stamp


def parse_retry_classes(text: str | list[str] | None) -> tuple[str, ...]:
    """`--classes` (comma list or list) -> error classes; None/empty -> RETRY_DEFAULT (the transient classes and
    the server faults a new sample fixes: unfinished, text_after_end, over_max_tokens).

    Raises InputError for a class that no error row can have (the allowed ones are listed)."""
    if not text:
        return RETRY_DEFAULT
    items = [c.strip() for c in (text.split(",") if isinstance(text, str) else text) if c.strip()]
    allowed = TRANSIENT + PERMANENT + QUALITY_CLASSES
    bad = [c for c in items if c not in allowed]
    if bad:
        raise InputError(f"--classes: unknown error class(es) {bad}; allowed: {', '.join(allowed)} "
                         f"(default: {','.join(RETRY_DEFAULT)})")
    return tuple(dict.fromkeys(items))


def _prepare_retry(gen_dir: Path, classes: tuple[str, ...]) -> dict:
    """Supersede the error rows of `classes` and every later turn of their prompts (see module doc); record the
    units in `generations/retry.json` until the run that re-requests them completes."""
    idx = ledger_mod.read_index(gen_dir, ["request_key", "prompt_id", "turn", "status", "error_class"]).to_pydict()
    rows = list(zip(idx["request_key"], idx["prompt_id"], idx["turn"], idx["status"], idx["error_class"]))
    first: dict[str, int] = {}
    for _, pid, turn, status, klass in rows:
        if status == "error" and klass in classes:
            first[pid] = min(first.get(pid, turn), turn)
    units = [(key, pid, turn, status, klass) for key, pid, turn, status, klass in rows
             if pid in first and turn >= first[pid]]
    pending = read_json(gen_dir / "retry.json") or {"classes": [], "units": []}
    if units:
        pending["classes"] = sorted(set(pending["classes"]) | set(classes))
        pending["units"] += [[pid, turn, status, klass] for _, pid, turn, status, klass in units]
        write_json_atomic(pending, gen_dir / "retry.json")
        ledger_mod.supersede(gen_dir, {u[0] for u in units}, "retry_errors")
    return {"classes": list(classes), "error_rows": sum(u[3] == "error" for u in units),
            "later_turns": sum(u[3] != "error" for u in units)}


def _retry_report(gen_dir: Path) -> dict | None:
    """What a pending retry (`retry.json`) got back: per re-sent unit its new status, by its old class."""
    pending = read_json(gen_dir / "retry.json")
    if not pending:
        return None
    idx = ledger_mod.read_index(gen_dir, ["prompt_id", "turn", "status", "error_class"]).to_pydict()
    now = {(p, t): (s, k) for p, t, s, k in zip(idx["prompt_id"], idx["turn"], idx["status"], idx["error_class"])}
    report = {"classes": pending["classes"], "units_resent": len(pending["units"]), "error_rows_resent": 0,
              "recovered": 0, "still_error": {}, "now": {"ok": 0, "error": 0, "skipped": 0}}
    for pid, turn, old_status, _ in pending["units"]:
        status, klass = now.get((pid, turn), ("missing", None))
        report["now"][status] = report["now"].get(status, 0) + 1
        if old_status == "error":
            report["error_rows_resent"] += 1
            report["recovered"] += status == "ok"
            if status == "error":
                report["still_error"][klass] = report["still_error"].get(klass, 0) + 1
    return report


def prepare(cfg: GenerateConfig, run: RunDir, *, repair: bool = False,
            retry_classes: tuple[str, ...] | list[str] | str | None = None) -> dict:
    """Before a generate run (flows call this, then the usual generate step): recover the directory, with
    `repair` quarantine damaged parts, with `retry_classes` supersede those error rows. Returns what it did."""
    run.generations.mkdir(parents=True, exist_ok=True)
    check_identity(cfg, run.generations)
    with _run_lock(run.generations):
        return _prepare_locked(run.generations, repair, retry_classes)


def _prepare_locked(gen_dir: Path, repair: bool, retry_classes) -> dict:
    out = {"recovered": ledger_mod.recover(gen_dir, repair=repair)}
    if retry_classes is not None:
        out["retry"] = _prepare_retry(gen_dir, parse_retry_classes(retry_classes))
    return out


def complete(cfg: GenerateConfig, run: RunDir, *, verify_parts: bool = False) -> dict | None:
    """What "complete" means: the generations manifest when `run_generate(cfg, run)` would return it without a
    request, else None: a manifest marked complete with this request config (`config_hash`), no journal
    (rows not yet in a part), no retry prepared (`retry.json`), and accounting from disk that balances with the
    manifest's row count. `verify_parts`: first check every listed part's sha256 (`ledger.check_parts`: raises
    InputError on a damaged part). Callers that must not start a server for nothing ask it first."""
    gen_dir = run.generations
    old = run.manifest(gen_dir)
    if not (old and old.get("complete") and old.get("config_hash") == config_hash(cfg)):
        return None
    if list(gen_dir.glob("journal-*.jsonl")) or (gen_dir / "retry.json").exists():
        return None
    if verify_parts:
        ledger_mod.check_parts(gen_dir, run.root)
    acc = accounting(gen_dir, prompt_files(run))
    return old if acc["balanced"] and acc["rows"] == old["accounting"]["rows"] else None


def run_generate(cfg: GenerateConfig, run: RunDir, *, endpoints: list[str] | None = None,
                 ray_address: str | None = None, progress: bool = True, repair: bool = False,
                 retry_classes: tuple[str, ...] | list[str] | str | None = None) -> dict:
    """Regenerate every prompt of `run` into run.generations; returns the generations manifest.

    Resumable: recorded units are not requested again; a complete run with the same request config
    returns its manifest at once (after checking every part's sha256). `repair`: quarantine damaged parts and
    re-request their rows; `retry_classes` (a comma list, list, or "" for RETRY_DEFAULT): re-send those
    error rows (module doc). Before any request, every endpoint must answer `GET /models`, accept the key and
    list `cfg.model` (`regen.generate.endpoints.require_endpoints`). Raises InputError for missing
    prompts/endpoints/API key, an endpoint that fails that check (EndpointsRefused), a directory produced with
    another request config or other response policies, damaged parts without `repair`, or a fatal endpoint error
    (401/403).
    """
    gen_dir = run.generations
    files = prompt_files(run)
    chash = config_hash(cfg)
    gen_dir.mkdir(parents=True, exist_ok=True)
    stamp = check_identity(cfg, gen_dir)
    old = run.manifest(gen_dir)
    if not (repair or retry_classes is not None) and (done := complete(cfg, run, verify_parts=True)):
        return done
    urls = resolve_endpoints(cfg, endpoints)
    api_key = api_key_from_env(cfg)
    require_endpoints(urls, cfg.model, api_key, cfg.timeouts.connect)  # before any request, whoever called
    with _run_lock(gen_dir):
        prepared = _prepare_locked(gen_dir, repair, retry_classes)
        return _generate_locked(cfg, run, files, urls, api_key, chash, stamp, old, ray_address, progress, prepared)


@contextlib.contextmanager
def _run_lock(gen_dir: Path):
    """One `regen generate` per run directory at a time: flock (released by the kernel even on kill -9) and a
    lease in the run directory (`regen.rundir.Lease`: across hosts of a shared filesystem); none while `regen select`
    holds its lease (it rewrites the prompts this stage reads)."""
    import fcntl

    from regen.rundir import Lease

    with open(gen_dir / ".lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(f"another `regen generate` is writing {gen_dir}: wait for it or stop it first") from None
        with Lease(gen_dir.parent, "generate", name=f"generate-{gen_dir.name}", exclude="select"):
            yield


def _write_stamp(cfg: GenerateConfig, gen_dir: Path, stamp: dict | None) -> list[str]:
    """Write `request_config.json` where it is missing or predates a rule (`adopted_rules`, kept in its `adopted`
    history); returns the rules adopted now."""
    adopted = adopted_rules(stamp, cfg)
    if not stamp or stamp.get("acceptance") is None or adopted:  # a stamp from before a rule existed: adopt it
        history = (stamp or {}).get("adopted", []) + [{"at": round(time.time(), 3), "rules": adopted}] * bool(adopted)
        write_json_atomic({"config_hash": config_hash(cfg), "request_config": request_config(cfg),
                           "acceptance": acceptance(cfg), **({"adopted": history} if history else {})},
                          gen_dir / "request_config.json")
    return adopted


def recheck_run(cfg: GenerateConfig, run: RunDir) -> dict:
    """`regen generate --recheck`: judge the `ok` rows already held by cfg's checks and policies
    (`regen.generate.recheck`); faulty ones become error rows (and their later turns skipped rows) that
    `--retry-errors` re-sends. Sends no request. Updates the manifest (parts, accounting, `rechecks`) when there
    is one; returns {"recheck": report, "manifest": manifest or None}. Raises InputError like `run_generate` for
    a directory made with another request config or changed policies, or damaged parts."""
    from regen.generate.recheck import recheck

    files = prompt_files(run)
    gen_dir = run.generations
    if not ledger_mod.listed_parts(gen_dir) and not list(gen_dir.glob("journal-*.jsonl")):
        raise InputError(f"{gen_dir}: no generation rows to recheck; run `regen generate --run {run.root}` first")
    stamp = check_identity(cfg, gen_dir)
    with _run_lock(gen_dir):
        recovered = ledger_mod.recover(gen_dir)
        adopted = _write_stamp(cfg, gen_dir, stamp)
        report = {"at": round(time.time(), 3), **recheck(cfg, gen_dir), "adopted_rules": adopted}
        manifest = run.manifest(gen_dir)
        if manifest:
            acc = accounting(gen_dir, files)
            manifest.update(parts=sorted(ledger_mod.listed_parts(gen_dir).values(), key=lambda e: e["path"]),
                            accounting=acc, complete=acc["balanced"],
                            rechecks=(manifest.get("rechecks") or []) + [report])
            if recovered.get("journal_rows_recovered") or recovered.get("parts_adopted"):
                manifest["recovered"] = recovered
            run.write_manifest(gen_dir, manifest)
    return {"recheck": report, "manifest": manifest or None}


def format_recheck(report: dict) -> str:
    errs = ", ".join(f"{k}={v}" for k, v in sorted(report["now_error"].items())) or "none"
    flags = ", ".join(f"{k}={v}" for k, v in sorted(report["would_flag"].items()))
    return (f"recheck: {report['checked']} ok rows judged by the current checks; now error rows: {errs} (and "
            f"{report['later_turns_skipped']} later turns skipped after them; `--retry-errors` re-sends them)"
            + (f"; left as they are but would be flagged now: {flags}" if flags else ""))


def _generate_locked(cfg, run, files, urls, api_key, chash, stamp, old, ray_address, progress, prepared) -> dict:
    gen_dir = run.generations
    adopted = _write_stamp(cfg, gen_dir, stamp)
    repaired = prepared["recovered"]
    t0 = time.time()
    if ray_address:
        from regen.generate.ray_runner import run_on_ray  # Ray only when asked for

        summaries = run_on_ray(cfg, gen_dir, files, urls, api_key, ray_address, progress)
    else:
        summaries = [run_shard(cfg, gen_dir, files, urls, api_key, "w0", (0, 1), progress)]
    throughput = [r for s in summaries for r in s.pop("throughput")]
    write_throughput(gen_dir / "throughput.parquet", throughput)
    acc = accounting(gen_dir, files)
    manifest = {
        "stage": "generate", "schema_version": SCHEMA_VERSION, "config_hash": chash,
        "request_config": request_config(cfg), "endpoints": [redact_url(u) for u in urls], "ray": bool(ray_address),
        "parts": sorted(ledger_mod.listed_parts(gen_dir).values(), key=lambda e: e["path"]),
        "accounting": acc, "complete": acc["balanced"], "recovered": repaired,
        "metrics": merge_summaries(summaries), "throughput_table": "throughput.parquet",
        "session_wall_s": round(time.time() - t0, 3),
        "sessions": ((old or {}).get("sessions") or []) + [{"started": t0, "wall_s": round(time.time() - t0, 3)}],
        "retries": (old or {}).get("retries") or [],
        **({"adopted_rules": adopted} if adopted else {}),
    }
    retry = _retry_report(gen_dir)
    if retry is not None:
        manifest["retry_pending" if not acc["balanced"] else "last_retry"] = retry
        if acc["balanced"]:
            manifest["retries"] = manifest["retries"] + [retry]
    run.write_manifest(gen_dir, manifest)
    if retry is not None and acc["balanced"]:
        (gen_dir / "retry.json").unlink()
    return manifest


def format_accounting(acc: dict) -> str:
    sign = "==" if acc["balanced"] else "!="
    extra = "" if acc["balanced"] else f" (missing {acc['missing']}, duplicates {acc['duplicates']}, stray {acc['stray']})"
    return (f"generated {acc['generated']} + error {acc['error']} + skipped {acc['skipped']} {sign} "
            f"{acc['units']} (prompt, turn) units of {acc['prompts']} prompts{extra}")


def format_retry(report: dict | None, classes: tuple[str, ...]) -> str:
    if not report:
        return f"retry-errors: no error rows of classes {','.join(classes)}; nothing re-sent"
    still = ", ".join(f"{k}={v}" for k, v in sorted(report["still_error"].items())) or "none"
    return (f"retry-errors ({','.join(report['classes'])}): re-sent {report['error_rows_resent']} error rows and "
            f"{report['units_resent'] - report['error_rows_resent']} later turns; recovered "
            f"{report['recovered']}/{report['error_rows_resent']}; still error: {still}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from regen.config import add_profile_arguments

    add_profile_arguments(parser)
    parser.add_argument("--endpoint", action="append", default=None, metavar="URL",
                        help="OpenAI-compatible base URL ending in /v1 (repeatable; overrides generate.endpoints)")
    parser.add_argument("--max-in-flight", type=_in_flight_arg, default=None,
                        help="requests in flight, or auto: per endpoint from its signals (generate.max_in_flight)")
    parser.add_argument("--ray", default=None, metavar="ADDRESS|auto|local",
                        help="split the work across Ray actors (auto: the running cluster, else a loopback one)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--repair", action="store_true",
                        help="move damaged generations parts to generations/quarantine/ and re-request exactly their rows")
    parser.add_argument("--recheck", action="store_true",
                        help="judge the ok rows already held by the current checks and policies first: faulty ones "
                             "become error rows (their later turns skipped) that --retry-errors re-sends; alone, "
                             "sends no request")
    parser.add_argument("--retry-errors", action="store_true",
                        help="re-send the error rows of --classes and the later turns skipped after them")
    parser.add_argument("--classes", default=None, metavar="CLASS,...",
                        help=f"with --retry-errors: error classes to re-send (default: {','.join(RETRY_DEFAULT)}; "
                             "bad_request, context_overflow and the other quality classes only when named)")


def _in_flight_arg(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give a number of requests or auto") from None


def main(args) -> int:
    from regen.config import load_profile_from_args

    profile, run = load_profile_from_args(args)
    cfg = profile.generate
    if args.max_in_flight is not None:
        cfg = cfg.model_copy(update={"max_in_flight": args.max_in_flight})
    if args.classes and not args.retry_errors:
        raise InputError("--classes needs --retry-errors (it names the error classes to re-send)")
    retry = (args.classes or "") if args.retry_errors else None
    if args.recheck:
        done = recheck_run(cfg, run)
        print(format_recheck(done["recheck"]))
        for rule in done["recheck"]["adopted_rules"]:
            print(f"adopted {rule}: generations/ predates this rule")
        if retry is None and not args.repair:
            acc = (done["manifest"] or {}).get("accounting") or accounting(run.generations, prompt_files(run))
            print(format_accounting(acc))
            return 0 if acc["balanced"] else 1
    manifest = run_generate(cfg, run, endpoints=args.endpoint, ray_address=args.ray, progress=not args.no_progress,
                            repair=args.repair, retry_classes=retry)
    rep = (manifest.get("recovered") or {}).get("repair")
    if rep:
        print(f"repaired: quarantined {', '.join(rep['parts_quarantined'])} ({rep['rows_lost']} rows lost, "
              f"{rep['dependent_rows_superseded']} later-turn rows superseded); their units were requested again")
    for rule in manifest.get("adopted_rules") or []:
        print(f"adopted {rule}: generations/ predates this rule; the rows recorded before were not judged by it "
              f"(`regen generate --recheck` judges them)")
    if args.retry_errors:
        print(format_retry(manifest.get("last_retry") or manifest.get("retry_pending"), parse_retry_classes(retry)))
    print(format_accounting(manifest["accounting"]))
    errs = manifest["metrics"].get("error_rows_by_class") or {}
    if errs:
        print("error rows by class: " + ", ".join(f"{k}={v}" for k, v in sorted(errs.items())))
    return 0 if manifest["accounting"]["balanced"] else 1
