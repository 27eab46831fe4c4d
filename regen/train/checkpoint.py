"""Trainer checkpoints: a servable draft plus the state that resumes training exactly.

    <run>/train/checkpoints/step-000100/
      model.safetensors   trainable draft weights (names of spec §8; frozen embed_tokens/lm_head are the
                          target's and left out unless asked: `regen.train.model.load_draft(dir, target_model=)`)
      config.json         `DSparkConfig.to_dict()`: every field serving needs (target_layer_ids, fc_norm,
                          aux_hidden_stream, mask_token_id, block_size, markov_rank, num_target_layers, ...)
      training.json       the train profile section, target path, shards manifest digest, metrics at save
      resume/             the resumable weights and AdamW state, sharded as FSDP2 holds them (torch's distributed
        .metadata         checkpoint, `regen.train.sharded_state`): each rank writes its own `__<rank>_0.distcp`,
        __0_0.distcp ...  rank 0 the `.metadata`; read back at any world size
      train_state.pt      step, scheduler, feed position (regen.train.feed), RNG states, world size
      MANIFEST.json       {"step", "files": {name: {"bytes", "sha256"}}} of the files above ("resume/__0_0.distcp")
    <run>/train/latest.json   {"step": 100, "path": "checkpoints/step-000100"}, written after the folder is complete

The servable files (model.safetensors + config.json: `regen eval`, `regen export-draft`, `train.init_from`) are
the trainable weights gathered to rank 0 (one all-gather per tensor, fp32: a third of what the full-state
checkpoint gathered, which added the two AdamW moments and the frozen embed_tokens/lm_head); the optimizer state,
twice the weights, never leaves its rank. A folder written before `resume/` holds `optimizer.pt` (the full AdamW
state keyed by parameter name) instead; it still resumes (rank 0 reads it and broadcasts).

A step folder is written under a temporary name: every rank checks its own shards for a NaN or inf (nothing is
written when any rank finds one), writes them, fsyncs and hashes its own files; after that agreement on the
control plane rank 0 writes the servable files and train_state.pt, the MANIFEST.json over every file, fsyncs the
folder, renames it and fsyncs its parent; `latest.json` only then points at it (replaced atomically), so a crash
mid-save or a host crash after it leaves an intact latest. A failed write on any rank stops every rank. Resume
(`find_resume`), `regen eval` and the exports verify a folder against its MANIFEST.json (`check_intact`). The
step folder must be on a filesystem every rank sees (it already was: every rank reads train_state.pt). The
functions that take a model are collective: all ranks call them.
"""
from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from regen.errors import InputError
from regen.train.model import CONFIG_NAME, FROZEN_PREFIXES, WEIGHTS_NAME
from regen.train.parallel import full_model_state, load_full_model_state, load_full_optim_state
from schemas.io import _fsync_dir, read_json, sha256_file, write_json_atomic  # fsync of a file or a directory

log = logging.getLogger(__name__)
LATEST = "latest.json"
MANIFEST = "MANIFEST.json"
RESUME_DIR = "resume"  # the sharded resumable state (torch's distributed checkpoint), one file per rank
# a folder written before manifests (and before the sharded state) needs these
REQUIRED = (WEIGHTS_NAME, CONFIG_NAME, "training.json", "optimizer.pt", "train_state.pt")


class CheckpointError(InputError):
    """A checkpoint that cannot be trusted or written: damaged (a file missing, of another size or sha256 than its
    MANIFEST.json), none intact to resume from, non-finite tensors, or a failed write on any rank."""


def _rng_state() -> dict:
    """CPU and Python RNG states, and this rank's own CUDA device's (training draws no CUDA random numbers; one
    device's state, not every visible device's, so a resume sees no difference in the number of GPUs)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_current"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    """Restore `_rng_state`'s states. A CUDA state is restored on this rank's current device when there is one;
    an older checkpoint's list of every visible device's states gives its entry for the current device, if any
    (`set_rng_state_all` raised where the resuming host saw fewer GPUs)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if not torch.cuda.is_available():
        return
    cuda = state.get("cuda_current")
    if cuda is None and state.get("cuda"):
        i = torch.cuda.current_device()
        cuda = state["cuda"][i] if i < len(state["cuda"]) else None
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def _strip(state: dict, prefix: str) -> dict:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}


def save_checkpoint(train_dir: Path, step: int, model, optimizer, scheduler, feed, *, training: dict,
                    keep: int = 2, include_frozen: bool = False) -> Path:
    """Write `checkpoints/step-{step:06d}` (see the module docstring) and point `latest.json` at it.

    `model` is the sharded root whose `draft` attribute is the DSparkDraft (regen.train.step.make_objective) or the
    draft itself. Every rank writes its own shards of the resumable state (`resume/`, torch's distributed
    checkpoint) and hashes them; rank 0 then writes the servable weights (gathered), the JSON files,
    `train_state.pt`, the MANIFEST.json over every file, renames the folder and replaces `latest.json`. Keeps the
    newest `keep` step folders (0 = all; by step number, never the one `latest.json` names). Returns the folder's
    path (on every rank). Raises CheckpointError on every rank when any rank's shard of the weights or of the
    optimizer state holds a non-finite value (nothing is written), or when any rank fails to write (out of disk:
    the partial folder is removed, `latest.json` still names the previous checkpoint).
    """
    from regen.train.collectives import control_all_gather_object, control_barrier
    from regen.train.guard import describe
    from regen.train.parallel import raise_if_any_rank_failed
    from regen.train.sharded_state import hash_own_files, nonfinite_local, save_sharded, sharded_state

    draft, prefix = _draft_of(model)
    rank, world, is_main = dist.get_rank(), dist.get_world_size(), dist.get_rank() == 0
    root = Path(train_dir) / "checkpoints"
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"

    def failed(exc: BaseException, who: str) -> CheckpointError:
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        return CheckpointError(f"{who} could not write {final}: {exc}; latest.json still names "
                               f"{latest_checkpoint(train_dir) or 'no checkpoint'}: free space or fix the directory "
                               "and rerun to resume")

    # 1. every rank checks its own shards; nothing is written when any holds a NaN or inf
    state = sharded_state(model, optimizer)
    bad = [k if k.startswith("optimizer.") else k.removeprefix("model.").removeprefix(prefix)
           for k in nonfinite_local(state)]
    if include_frozen and is_main:  # replicated on every rank: rank 0 checks them
        from regen.train.guard import nonfinite_tensors

        bad += nonfinite_tensors({k: v for k, v in draft.state_dict().items() if k.startswith(FROZEN_PREFIXES)})
    error = None
    if bad:
        error = CheckpointError(f"{final}: not written: non-finite values in {describe(bad)}; the run diverged "
                                f"after {latest_checkpoint(train_dir) or 'its start'}: lower train.lr and rerun")
    raise_if_any_rank_failed(error)
    # 2. rank 0 makes the temporary folder, then every rank writes and hashes its shards of the resumable state
    if is_main:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / RESUME_DIR).mkdir(parents=True)
        except OSError as exc:  # out of disk, a read-only mount: every rank stops now, not at the PG timeout
            error = failed(exc, "rank 0")
    raise_if_any_rank_failed(error)
    own = {}
    try:
        save_sharded(tmp / RESUME_DIR, model, optimizer, state)  # DCP: CheckpointException on every rank
        own = hash_own_files(tmp / RESUME_DIR, rank, is_main)
    except Exception as exc:  # noqa: BLE001 - DCP wraps a rank's OSError in its CheckpointException
        error = failed(exc, f"rank {rank}")
    raise_if_any_rank_failed(error)
    del state
    hashed = [own]
    if world > 1:
        hashed = [None] * world
        control_all_gather_object(hashed, own)
    # 3. the servable export: the trainable weights gathered to rank 0 (the frozen embed_tokens/lm_head never)
    weights = servable_weights(model, include_frozen=include_frozen)
    if is_main:
        try:
            files = {k: v for h in hashed for k, v in h.items()}
            _write_step_folder(train_dir, root, final, tmp, step, draft, weights, files, scheduler, feed, training,
                               keep)
        except OSError as exc:
            error = failed(exc, "rank 0")
    del weights
    raise_if_any_rank_failed(error)
    control_barrier()  # the others wait under the control plane's timeout, not the NCCL watchdog's
    return final


def servable_weights(model, *, include_frozen: bool = False) -> dict:
    """The draft's weights as its step folder's model.safetensors holds them (names without the sharded root's
    prefix), gathered to rank 0 on CPU ({} elsewhere): the trainable weights and buffers, and the frozen
    embed_tokens/lm_head only with `include_frozen` (they are the target's and never leave it otherwise).
    Collective (`regen.train.parallel.gathered_model_state`)."""
    from regen.train.parallel import gathered_model_state

    _, prefix = _draft_of(model)
    keep = lambda name: include_frozen or not name.removeprefix(prefix).startswith(FROZEN_PREFIXES)  # noqa: E731
    return _strip(gathered_model_state(model, keep), prefix)


def _write_step_folder(train_dir, root, final, tmp, step, draft, weights, files, scheduler, feed, training,
                       keep) -> None:
    """Rank 0's part of save_checkpoint, after every rank wrote and hashed its shards in `tmp/resume/` (`files`):
    the servable files and train_state.pt fsynced and hashed, MANIFEST (sizes and sha256 of every file), folder
    fsynced, renamed, parent fsynced, then `latest.json` replaced atomically, then pruning."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    write_json_atomic(draft.config.to_dict(), tmp / CONFIG_NAME)
    write_json_atomic({**training, "step": step}, tmp / "training.json")
    torch.save({"step": step, "scheduler": scheduler.state_dict(), "feed": feed.state_dict(),
                "rng": _rng_state(), "world_size": dist.get_world_size()}, tmp / "train_state.pt")
    files = dict(files)
    for f in sorted(tmp.iterdir()):
        if f.is_file():
            _fsync_dir(f)
            files[f.name] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
    _fsync_dir(tmp / RESUME_DIR)
    write_json_atomic({"step": step, "files": dict(sorted(files.items()))}, tmp / MANIFEST)
    _fsync_dir(tmp)
    if final.exists():  # this run's own later step folder, or a damaged one it fell back past (checked at start)
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_dir(root)
    write_json_atomic({"step": step, "path": str(final.relative_to(train_dir))}, Path(train_dir) / LATEST)
    if keep > 0:  # by step number; only older ones, never the folder latest.json names
        older = [d for d in step_folders(root) if _step_of(d) < step]
        for old in older[:max(0, len(older) - (keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)


def _step_of(folder: Path) -> int:
    return int(folder.name.removeprefix("step-"))


def step_folders(root: Path) -> list[Path]:
    """`root`'s `step-NNNNNN` folders sorted by step number (temporary `.tmp-step-*` ones left out)."""
    out = [d for d in Path(root).glob("step-*") if d.is_dir() and d.name.removeprefix("step-").isdigit()]
    return sorted(out, key=_step_of)


def verify_checkpoint(folder: Path, required: tuple[str, ...] = REQUIRED) -> str | None:
    """None when the step folder is intact, else why not: a file of its MANIFEST missing or of another size or
    sha256, or (a folder written before manifests) a file of `required` missing or empty."""
    folder = Path(folder)
    if not folder.is_dir():
        return "missing"
    manifest = read_json(folder / MANIFEST)
    if manifest is None:
        for name in required:
            f = folder / name
            if not f.is_file() or f.stat().st_size == 0:
                return f"{name} missing or empty (no {MANIFEST})"
        return None
    for name, want in manifest["files"].items():
        f = folder / name
        if not f.is_file():
            return f"{name} missing"
        size = f.stat().st_size
        if size != want["bytes"]:
            return f"{name} has {size} bytes, its {MANIFEST} says {want['bytes']}"
        if sha256_file(f) != want["sha256"]:
            return f"{name} sha256 differs from its {MANIFEST}"
    return None


def check_intact(folder: Path) -> None:
    """Raise CheckpointError when `verify_checkpoint(folder)` finds a fault (`regen eval`, the exports,
    `train.init_from`; without a MANIFEST.json only the draft's config.json and model.safetensors are needed)."""
    why = verify_checkpoint(folder, (WEIGHTS_NAME, CONFIG_NAME))
    if why is not None:
        others = [d.name for d in step_folders(Path(folder).parent) if d != Path(folder)]
        raise CheckpointError(f"{folder}: damaged checkpoint: {why}; use another step folder"
                              f"{' (' + ', '.join(others) + ')' if others else ''} or retrain")


def load_servable_weights(folder: Path) -> dict:
    """The draft tensors of a step folder ({name: torch.Tensor}), after `check_intact`; InputError when a weight
    holds a NaN or inf (a diverged run: an engine would serve NaN). Used by `regen eval` and the exports."""
    from safetensors.torch import load_file

    from regen.train.guard import describe, nonfinite_tensors

    folder = Path(folder)
    weights = folder / WEIGHTS_NAME
    if not weights.is_file():
        raise InputError(f"{weights}: missing; the step folder is incomplete (a crash mid-save?): use an earlier "
                         "step or rerun training")
    check_intact(folder)  # against its MANIFEST.json (CheckpointError: a damaged or truncated file)
    tensors = load_file(str(weights))
    bad = nonfinite_tensors(tensors)
    if bad:
        raise InputError(f"{weights}: non-finite values in {describe(bad)}: the run diverged before this checkpoint; "
                         "use (export, evaluate) the last finite step (runs/<name>/train/checkpoints/) or retrain "
                         "with a lower train.lr")
    return tensors


def latest_checkpoint(train_dir: Path) -> Path | None:
    """The folder `latest.json` points at, or None when there is none yet (no verification: `find_resume`)."""
    latest = read_json(Path(train_dir) / LATEST)
    if not latest:
        return None
    path = Path(train_dir) / latest["path"]
    return path if path.is_dir() else None


def find_draft(path: str | Path, setting: str = "--draft") -> Path:
    """The draft folder `path` names: itself when it holds a config.json (a step folder, or an exported draft
    folder), else the step `latest.json` points at in `path` (a training directory) or in `path/train` (a run
    directory). `setting` is what the user gave the path as (`--draft`, `train.init_from`, `--compare NAME=`): the
    InputError raised when none holds a draft names it, the path and the fix. No verification (`load_servable_
    weights` and `verify_checkpoint` check the files)."""
    from regen.errors import InputError

    p = Path(path)
    for cand in (p, p / "train"):
        if (cand / "config.json").exists():
            return cand
        latest = read_json(cand / LATEST) if (cand / LATEST).exists() else None
        if latest and (cand / latest["path"] / "config.json").exists():
            return cand / latest["path"]
    shown = f"{setting}{p}" if setting.endswith("=") else f"{setting} {str(p)!r}"  # `--compare NAME=PATH`
    raise InputError(f"{shown}: no draft there (config.json, latest.json of a training directory, or "
                     "train/latest.json of a run directory); give a step folder such as "
                     "runs/local/train/checkpoints/step-000100, the training or run directory for its latest step, "
                     "or an exported K3DSparkModel / Qwen3DSparkModel folder")


def find_resume(train_dir: Path) -> tuple[Path | None, str | None]:
    """(the step folder to resume from, a warning to log loudly or None). Never a silent fresh start:

    - `latest.json` names an intact folder: that one;
    - `latest.json` is missing, dangling or names a damaged folder while step folders exist: the newest intact
      one by step number, with a warning naming what was skipped and why;
    - step folders exist and none is intact: CheckpointError listing them (move them away or use another --out);
    - no step folder: (None, None), a fresh start.
    """
    train_dir = Path(train_dir)
    folders = step_folders(train_dir / "checkpoints")
    pointer = read_json(train_dir / LATEST)
    named = train_dir / pointer["path"] if pointer else None
    if named is not None and named.is_dir() and verify_checkpoint(named) is None:
        return named, None
    if not folders:
        if named is not None:
            raise CheckpointError(f"{train_dir / LATEST} names {named}, which is missing, and no step folder is left "
                                  f"in {train_dir / 'checkpoints'}: remove {train_dir / LATEST} to start afresh")
        return None, None
    skipped = []
    for folder in reversed(folders):
        why = verify_checkpoint(folder)
        if why is None:
            if named is None:
                head = f"{train_dir / LATEST} is missing"
            elif not named.is_dir():
                head = f"{train_dir / LATEST} names {named.name}, which is missing"
            else:
                head = f"{train_dir / LATEST} names {named.name}, which is damaged ({verify_checkpoint(named)})"
            more = f"; skipped damaged: {'; '.join(skipped)}" if skipped else ""
            return folder, (f"RESUME FALLBACK: {head}; resuming from {folder.name}, the newest intact checkpoint{more}. "
                            "Its later step folders will be overwritten as training reaches them; stop now and move "
                            "the checkpoints away (or train into another --out) to start afresh instead")
        skipped.append(f"{folder.name} ({why})")
    raise CheckpointError(f"{train_dir / 'checkpoints'}: no intact checkpoint to resume from: {'; '.join(skipped)}; "
                          f"move the step folders away (and {LATEST}) to start afresh, or train into another --out")


def _draft_of(model):
    """(the DSparkDraft, the state-dict prefix of its tensors in `model`)."""
    inner = getattr(model, "draft", None)
    return (inner, "draft.") if inner is not None else (model, "")


def load_checkpoint(path: Path, model, optimizer, scheduler, feed) -> int:
    """Restore model, optimizer, scheduler, feed position and RNG from a step folder; returns the step. Collective.

    The weights and the optimizer state come from the sharded `resume/` (torch's distributed checkpoint, resharded
    to this world size: every rank reads its own parts); a folder written before it (`optimizer.pt`, the full
    state) is read on rank 0 and broadcast. Raises ValueError when the checkpoint's config.json differs from the
    draft being trained (a different architecture or contract cannot resume; start a new run directory instead),
    CheckpointError when the folder holds neither form of the resumable state.
    """
    from regen.train.model import DSparkConfig

    draft, prefix = _draft_of(model)
    path = Path(path)
    saved_cfg = DSparkConfig.from_json(path / CONFIG_NAME)
    if saved_cfg != draft.config:
        diff = {k: (v, draft.config.to_dict().get(k)) for k, v in saved_cfg.to_dict().items()
                if draft.config.to_dict().get(k) != v}
        raise ValueError(f"{path / CONFIG_NAME}: draft config differs from this run's (saved, now): {diff}; "
                         "resume with the same train.* settings or use a new run directory")
    state = torch.load(path / "train_state.pt", weights_only=False)
    if (path / RESUME_DIR / ".metadata").is_file():
        from regen.train.sharded_state import load_sharded

        load_sharded(path / RESUME_DIR, model, optimizer)
    elif (path / "optimizer.pt").is_file():
        _load_full_state(path, model, optimizer, prefix)
    else:
        raise CheckpointError(f"{path}: no resumable state ({RESUME_DIR}/.metadata, or optimizer.pt of an older "
                              "checkpoint): resume from another step folder, or start a new --out with "
                              f"--init-from {path} (its weights, a fresh optimizer)")
    scheduler.load_state_dict(state["scheduler"])
    feed.load_state_dict(state["feed"])
    _set_rng_state(state["rng"])
    return int(state["step"])


def _load_full_state(path: Path, model, optimizer, prefix: str) -> None:
    """A checkpoint written before the sharded state: model.safetensors and optimizer.pt (full, keyed by name)
    read on rank 0 and broadcast into the sharded model and optimizer. Collective."""
    from safetensors.torch import load_file

    is_main = dist.get_rank() == 0
    model_sd = load_file(str(path / WEIGHTS_NAME)) if is_main else {}
    optim_sd = torch.load(path / "optimizer.pt", weights_only=False) if is_main else {}
    full = _strip(full_model_state(model), prefix)  # collective
    if is_main:  # frozen tensors are the target's: take them from the freshly built draft
        model_sd = {prefix + k: v for k, v in {**{k: v for k, v in full.items() if k.startswith(FROZEN_PREFIXES)},
                                               **model_sd}.items()}
    load_full_model_state(model, model_sd)
    load_full_optim_state(model, optimizer, optim_sd)


def agreed_resume(train_dir: Path, info):
    """(step folder to resume from or None, the fallback warning or None), chosen on rank 0 (it verifies the
    folders, `regen.train.checkpoint.find_resume`) and the same on every rank; CheckpointError on every rank when
    step folders exist and none is intact."""
    from regen.train.parallel import raise_if_any_rank_failed

    box, error = [None, None], None
    if info.is_main:
        try:
            box = list(find_resume(train_dir))
        except InputError as exc:
            error = exc
    raise_if_any_rank_failed(error)
    if info.world_size > 1:
        from regen.train.collectives import control_broadcast_object_list

        control_broadcast_object_list(box, src=0)
    if box[1] and info.is_main:
        log.warning("%s", box[1])
    return (Path(box[0]) if box[0] else None), box[1]
