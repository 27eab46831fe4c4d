"""What a checkpoint was trained on and with, and what a resume may change (docs/train.md, "What a resume may
change").

Each checkpoint's `training.json` holds a `resume_key` (`resume_key`): the shards' manifest digest (over the
listed shards' paths and sha256, in order, and how many), the renderer's tokenizer hash, the target's revision
(`regen.train.target_head.target_revision`) and tokenizer files hash, world size, gradient accumulation and their
product (the global batch in micro-batches), the optimizer and schedule settings, the loss and the seed. On resume,
`check_resume` compares it with this run's: a setting of `REFUSED` that differs stops the run before anything is
loaded, naming both values and the remedy; one of `APPLIED` is taken on purpose and reported old -> new in the log
and in summary.json's `resume.changes`. Torch would otherwise restore the old optimizer settings without a word
(AdamW's `load_state_dict` keeps the saved param groups) and the feed position would count through a different
stream (NeMo-RL #2519).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from regen.errors import InputError


class ResumeMismatch(InputError):
    """A resume whose data, target, tokenizer, batch or optimizer settings differ from the checkpoint's."""


# the settings a resume refuses to change: (key in resume_key, the --set that restores it, why)
REFUSED = {
    "shards": (None, "the feed position would count through another stream of rows"),
    "shards_tokenizer": (None, "the shards were rendered with another tokenizer"),
    "target_revision": ("train.target", "another target checkpoint gives other features"),
    "target_tokenizer": ("train.target", "the same vocabulary size with other ids would be trained silently"),
    "global_batch": ("train.grad_accum", "the step count and the feed position are in other units"),
    "lr": ("train.lr", "the optimizer state keeps the old value"),
    "betas": ("train.betas", "the optimizer state keeps the old value"),
    "adam_eps": ("train.adam_eps", "the optimizer state keeps the old value"),
    "weight_decay": ("train.weight_decay", "the optimizer state keeps the old value"),
    "warmup_frac": ("train.warmup_frac", "the schedule would jump at the restored step"),
    "min_lr_frac": ("train.min_lr_frac", "the schedule would jump at the restored step"),
    "loss_weights": ("train.loss_weights", "the objective would change mid-run"),
    "loss_normalization": ("train.loss_normalization", "the objective would change mid-run"),
    "seed": ("train.seed", "anchors and feed order are drawn from it"),
}
# taken on purpose, reported old -> new
APPLIED = ("total_steps", "world_size", "grad_accum", "grad_clip", "num_shards")


def shards_digest(manifest: dict, count: int | None = None) -> str:
    """sha256 over the first `count` (default all) shard entries' (path, sha256) of a shards manifest."""
    entries = [(e.get("path"), e.get("sha256")) for e in (manifest.get("shards") or [])]
    if count is not None:
        entries = entries[:count]
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


TOKENIZER_EXTRA = ("vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")


def tokenizer_files_hash(path: Path) -> str:
    """sha256 over a model directory's tokenizer files (name and content): `tokenizer*`, `*.tiktoken` and
    TOKENIZER_EXTRA, in name order. The same vocabulary size with other ids changes it."""
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if f.is_file() and (f.name.startswith("tokenizer") or f.name.endswith(".tiktoken") or f.name in TOKENIZER_EXTRA):
            h.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def resume_key(cfg, *, shards_manifest: dict | None, target_path: Path, world_size: int, total_steps: int) -> dict:
    """This run's record (module docstring); JSON-ready."""
    from regen.train.target_head import target_revision

    manifest = shards_manifest or {}
    return {
        "shards": shards_digest(manifest), "num_shards": len(manifest.get("shards") or []),
        "shards_tokenizer": (manifest.get("contract") or {}).get("tokenizer_hash"),
        "target_revision": target_revision(target_path), "target_tokenizer": tokenizer_files_hash(target_path),
        "world_size": world_size, "grad_accum": cfg.grad_accum, "global_batch": world_size * cfg.grad_accum,
        "lr": cfg.lr, "betas": list(cfg.betas), "adam_eps": cfg.adam_eps, "weight_decay": cfg.weight_decay,
        "warmup_frac": cfg.warmup_frac, "min_lr_frac": cfg.min_lr_frac, "total_steps": total_steps,
        "grad_clip": cfg.grad_clip, "loss_weights": list(cfg.loss_weights),
        "loss_normalization": cfg.loss_normalization, "seed": cfg.seed,
    }


def check_resume(checkpoint: Path, now: dict, *, shards_manifest: dict | None, follow: bool,
                 lr_lambda=None) -> list[dict]:
    """Compare `checkpoint`'s training.json `resume_key` with `now` (`resume_key`). Raises ResumeMismatch naming
    every refused difference (both values, the --set that restores it, and the way to change it instead); returns
    the applied changes [{"setting", "old", "new", "note"}] (one note for a checkpoint written before the record).
    `lr_lambda(total_steps, warmup_frac, min_lr_frac) -> f(step)`: the schedule (`regen.train.trainer.lr_lambda`),
    to report the lr multiplier a schedule-length change gives at the restored step."""
    training = (json.loads((Path(checkpoint) / "training.json").read_text())
                if (Path(checkpoint) / "training.json").is_file() else {})
    saved, step = training.get("resume_key"), int(training.get("step") or 0)
    if not saved:
        return [{"setting": "resume_key", "old": None, "new": "recorded",
                 "note": f"{checkpoint} holds no resume record (written before it existed): not checked"}]
    now = dict(now)
    if follow or now["num_shards"] > saved["num_shards"]:  # shards appended since: compare the ones trained on
        count = min(saved["num_shards"], now["num_shards"])
        now["shards"] = shards_digest(shards_manifest or {}, count)
        saved = {**saved, "shards": saved["shards"] if count == saved["num_shards"]
                 else "(more shards than listed now)"}
    refused = []
    for key, (flag, why) in REFUSED.items():
        if key in saved and saved[key] != now.get(key):
            restore = f"--set {flag}={_fmt(saved[key])}" if flag and key not in (
                "target_revision", "target_tokenizer", "global_batch") else {
                "shards": "restore the shards it was trained on (regen render with the same settings and rows)",
                "shards_tokenizer": "re-render with the tokenizer it was trained on",
                "target_revision": "point train.target at the checkpoint it was trained with",
                "target_tokenizer": "point train.target at the checkpoint it was trained with",
                "global_batch": f"make world size x train.grad_accum = {saved[key]} (the checkpoint's "
                                f"{saved.get('world_size')} x {saved.get('grad_accum')})"}.get(key)
            refused.append(f"{key}: checkpoint {_fmt(saved[key])}, now {_fmt(now.get(key))} ({why}; to resume: "
                           f"{restore})")
    if refused:
        raise ResumeMismatch(f"{checkpoint}: this run differs from the checkpoint it would resume: "
                             + "; ".join(refused) + ". To train with the new settings instead, start a new training "
                             f"directory from these weights: --out <new dir> --init-from {checkpoint}")
    applied = []
    for key in APPLIED:
        if key in saved and saved[key] != now.get(key):
            note = ""
            if key == "total_steps" and lr_lambda is not None:
                old_f = lr_lambda(saved[key], saved["warmup_frac"], saved["min_lr_frac"])
                new_f = lr_lambda(now[key], now["warmup_frac"], now["min_lr_frac"])
                note = (f"the schedule is recomputed over {now[key]} steps: the lr multiplier at step {step} goes "
                        f"from {old_f(step):.4g} to {new_f(step):.4g}")
            elif key == "num_shards":
                note = "shards appended since the checkpoint; the ones it was trained on are unchanged"
            applied.append({"setting": key, "old": saved[key], "new": now.get(key), "note": note})
    return applied


def _fmt(v) -> str:
    if isinstance(v, str) and len(v) == 64:
        return v[:12] + "..."
    return json.dumps(v) if isinstance(v, (list, dict)) else str(v)
