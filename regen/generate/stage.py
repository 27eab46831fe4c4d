"""`regen generate`: regenerate every prompt with the target over OpenAI-compatible HTTP into generations/.

    regen generate --profile P --run DIR [--endpoint URL ...] [--max-in-flight N] [--ray ADDRESS|auto|local]

Reads `prompts/part-*.parquet`, writes `generations/` (see `regen.generate.ledger` for the layout and the exactly-once
rules): one GENERATION_SCHEMA row per (prompt_id, turn) unit (`regen.generate.conversation` defines units, history and
keys), with status ok | error | skipped. Failures are rows: transport classes are retried with jittered
backoff, quality classes follow the profile's policies (`regen.generate.checks`); only a fatal class (`auth`) stops
the run. The same command resumes after a crash: recorded units are never requested again.

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


from regen.generate import ledger as ledger_mod
from regen.generate.client import redact_url
from regen.config.generate import GenerateConfig
from regen.generate.conversation import (request_config, turn_positions)
from regen.errors import InputError
from regen.generate.metrics import merge_summaries, write_throughput
from regen.rundir import RunDir
from schemas.generation import SCHEMA_VERSION, STATUSES
from schemas.io import read_json, write_json_atomic
from schemas.prompt import canonical_json

from regen.generate.runner import FatalStop, iter_prompts, run_shard  # noqa: F401 (FatalStop re-exported)
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


def run_generate(cfg: GenerateConfig, run: RunDir, *, endpoints: list[str] | None = None,
                 ray_address: str | None = None, progress: bool = True) -> dict:
    """Regenerate every prompt of `run` into run.generations; returns the generations manifest.

    Resumable: recorded units are not requested again; a complete run with the same request config
    returns its manifest at once. Raises InputError for missing prompts/endpoints/API key, a directory
    produced with a different request config, or a fatal endpoint error (401/403).
    """
    gen_dir = run.generations
    files = prompt_files(run)
    chash = config_hash(cfg)
    gen_dir.mkdir(parents=True, exist_ok=True)
    stamp = read_json(gen_dir / "request_config.json")
    if stamp and stamp.get("config_hash") != chash:
        raise InputError(f"{gen_dir} was generated with another request config ({stamp.get('config_hash')} != {chash}: "
                         "model, sampling or extra_body changed); use a new --run directory or remove generations/")
    old = run.manifest(gen_dir)
    if old and old.get("complete") and old.get("config_hash") == chash and not list(gen_dir.glob("journal-*.jsonl")):
        acc = accounting(gen_dir, files)
        if acc["balanced"] and acc["rows"] == old["accounting"]["rows"]:
            return old
    urls = resolve_endpoints(cfg, endpoints)
    api_key = api_key_from_env(cfg)
    with _run_lock(gen_dir):
        return _generate_locked(cfg, run, files, urls, api_key, chash, stamp, old, ray_address, progress)


@contextlib.contextmanager
def _run_lock(gen_dir: Path):
    """One `regen generate` per run directory at a time (flock; released by the kernel even on kill -9)."""
    import fcntl

    with open(gen_dir / ".lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(f"another `regen generate` is writing {gen_dir}: wait for it or stop it first") from None
        yield


def _generate_locked(cfg, run, files, urls, api_key, chash, stamp, old, ray_address, progress) -> dict:
    gen_dir = run.generations
    if not stamp:
        write_json_atomic({"config_hash": chash, "request_config": request_config(cfg)}, gen_dir / "request_config.json")
    repaired = ledger_mod.recover(gen_dir)
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
    }
    run.write_manifest(gen_dir, manifest)
    return manifest


def format_accounting(acc: dict) -> str:
    sign = "==" if acc["balanced"] else "!="
    extra = "" if acc["balanced"] else f" (missing {acc['missing']}, duplicates {acc['duplicates']}, stray {acc['stray']})"
    return (f"generated {acc['generated']} + error {acc['error']} + skipped {acc['skipped']} {sign} "
            f"{acc['units']} (prompt, turn) units of {acc['prompts']} prompts{extra}")


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
    manifest = run_generate(cfg, run, endpoints=args.endpoint, ray_address=args.ray, progress=not args.no_progress)
    print(format_accounting(manifest["accounting"]))
    errs = manifest["metrics"].get("error_rows_by_class") or {}
    if errs:
        print("error rows by class: " + ", ".join(f"{k}={v}" for k, v in sorted(errs.items())))
    return 0 if manifest["accounting"]["balanced"] else 1
