"""Trainer checkpoints: a servable draft plus the state that resumes training exactly.

    <run>/train/checkpoints/step-000100/
      model.safetensors   trainable draft weights (names of spec §8; frozen embed_tokens/lm_head are the
                          target's and left out unless asked: `regen.train.model.load_draft(dir, target_model=)`)
      config.json         `DSparkConfig.to_dict()`: every field serving needs (target_layer_ids, fc_norm,
                          aux_hidden_stream, mask_token_id, block_size, markov_rank, num_target_layers, ...)
      training.json       the train profile section, target path, shards manifest digest, metrics at save
      optimizer.pt        full (unsharded) AdamW state keyed by parameter name (rank 0 writes, rank 0 reads)
      train_state.pt      step, scheduler, feed position (regen.train.feed), RNG states, world size
      MANIFEST.json       {"step", "files": {name: {"bytes", "sha256"}}} of the files above
    <run>/train/latest.json   {"step": 100, "path": "checkpoints/step-000100"}, written after the folder is complete

A step folder is written under a temporary name, each file fsynced, its MANIFEST.json written, the folder fsynced,
renamed and its parent fsynced; `latest.json` only then points at it (replaced atomically), so a crash mid-save
or a host crash after it leaves an intact latest. Resume (`find_resume`), `regen eval` and the exports verify a
folder against its MANIFEST.json (`check_intact`). A step folder with a non-finite tensor is never written. Full state dicts make a checkpoint independent of
the world size it was written with. Every function here is collective: all ranks call it.
"""
from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from regen.train.model import CONFIG_NAME, FROZEN_PREFIXES, WEIGHTS_NAME
from regen.errors import InputError
from regen.train.parallel import full_model_state, full_optim_state, load_full_model_state, load_full_optim_state
from schemas.io import _fsync_dir, read_json, sha256_file, write_json_atomic  # fsync of a file or a directory

log = logging.getLogger(__name__)
LATEST = "latest.json"
MANIFEST = "MANIFEST.json"
REQUIRED = (WEIGHTS_NAME, CONFIG_NAME, "training.json", "optimizer.pt", "train_state.pt")


class CheckpointError(InputError):
    """A checkpoint that cannot be trusted or written: damaged (a file missing, of another size or sha256 than its
    MANIFEST.json), none intact to resume from, non-finite tensors, or a failed write on rank 0."""


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

    `model` is the sharded root whose `draft` attribute is the DSparkDraft (regen.train.loop.make_objective) or the
    draft itself. Keeps the newest `keep` step folders (0 = all; by step number, never the one `latest.json`
    names). Returns the folder's path (on every rank). Raises CheckpointError on every rank when the weights or
    the optimizer state hold a non-finite value (nothing is written) or when rank 0 fails to write (out of disk:
    the partial folder is removed, `latest.json` still names the previous checkpoint).
    """
    from regen.train.guard import describe, nonfinite_tensors
    from regen.train.parallel import raise_if_any_rank_failed

    draft, prefix = _draft_of(model)
    model_sd = _strip(full_model_state(model), prefix)
    optim_sd = full_optim_state(model, optimizer)
    root = Path(train_dir) / "checkpoints"
    final = root / f"step-{step:06d}"
    error = None
    if dist.get_rank() == 0:
        bad = nonfinite_tensors(model_sd) + [f"optimizer.{k}" for k in nonfinite_tensors(optim_sd)]
        if bad:
            error = CheckpointError(f"{final}: not written: non-finite values in {describe(bad)}; the run diverged "
                                    f"after {latest_checkpoint(train_dir) or 'its start'}: lower train.lr and rerun")
        else:
            try:
                _write_step_folder(train_dir, root, final, step, draft, model_sd, optim_sd, scheduler, feed,
                                   training, include_frozen, keep)
            except OSError as exc:  # out of disk, a read-only mount: every rank stops now, not at the PG timeout
                shutil.rmtree(root / f".tmp-step-{step:06d}", ignore_errors=True)
                error = CheckpointError(f"rank 0 could not write {final}: {exc}; latest.json still names "
                                        f"{latest_checkpoint(train_dir) or 'no checkpoint'}: free space or fix "
                                        "the directory and rerun to resume")
    raise_if_any_rank_failed(error)
    from regen.train.collectives import control_barrier

    control_barrier()  # the others wait under the control plane's timeout, not the NCCL watchdog's
    return final


def _write_step_folder(train_dir, root, final, step, draft, model_sd, optim_sd, scheduler, feed, training,
                       include_frozen, keep) -> None:
    """Rank 0's part of save_checkpoint: temporary folder, files fsynced, MANIFEST (sizes and sha256), folder
    fsynced, renamed, parent fsynced, then `latest.json` replaced atomically, then pruning."""
    from safetensors.torch import save_file

    tmp = root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {k: v.contiguous() for k, v in model_sd.items() if include_frozen or not k.startswith(FROZEN_PREFIXES)}
    save_file(weights, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    write_json_atomic(draft.config.to_dict(), tmp / CONFIG_NAME)
    write_json_atomic({**training, "step": step}, tmp / "training.json")
    torch.save(optim_sd, tmp / "optimizer.pt")
    torch.save({"step": step, "scheduler": scheduler.state_dict(), "feed": feed.state_dict(),
                "rng": _rng_state(), "world_size": dist.get_world_size()}, tmp / "train_state.pt")
    files = {}
    for f in sorted(tmp.iterdir()):
        _fsync_dir(f)
        files[f.name] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
    write_json_atomic({"step": step, "files": files}, tmp / MANIFEST)
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
    """Restore model, optimizer, scheduler, feed position and RNG from a step folder; returns the step.

    Raises ValueError when the checkpoint's config.json differs from the draft being trained (a different
    architecture or contract cannot resume; start a new run directory instead).
    """
    from safetensors.torch import load_file

    from regen.train.model import DSparkConfig

    draft, prefix = _draft_of(model)
    saved_cfg = DSparkConfig.from_json(path / CONFIG_NAME)
    if saved_cfg != draft.config:
        diff = {k: (v, draft.config.to_dict().get(k)) for k, v in saved_cfg.to_dict().items()
                if draft.config.to_dict().get(k) != v}
        raise ValueError(f"{path / CONFIG_NAME}: draft config differs from this run's (saved, now): {diff}; "
                         "resume with the same train.* settings or use a new run directory")
    is_main = dist.get_rank() == 0
    model_sd = load_file(str(path / WEIGHTS_NAME)) if is_main else {}
    optim_sd = torch.load(path / "optimizer.pt", weights_only=False) if is_main else {}
    state = torch.load(path / "train_state.pt", weights_only=False)
    full = _strip(full_model_state(model), prefix)  # collective
    if is_main:  # frozen tensors are the target's: take them from the freshly built draft
        model_sd = {prefix + k: v for k, v in {**{k: v for k, v in full.items() if k.startswith(FROZEN_PREFIXES)},
                                               **model_sd}.items()}
    load_full_model_state(model, model_sd)
    load_full_optim_state(model, optimizer, optim_sd)
    scheduler.load_state_dict(state["scheduler"])
    feed.load_state_dict(state["feed"])
    _set_rng_state(state["rng"])
    return int(state["step"])


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
