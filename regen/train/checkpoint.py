"""Trainer checkpoints: a servable draft plus the state that resumes training exactly.

    <run>/train/checkpoints/step-000100/
      model.safetensors   trainable draft weights (names of spec §8; frozen embed_tokens/lm_head are the
                          target's and left out unless asked: `regen.train.model.load_draft(dir, target_model=)`)
      config.json         `DSparkConfig.to_dict()`: every field serving needs (target_layer_ids, fc_norm,
                          aux_hidden_stream, mask_token_id, block_size, markov_rank, num_target_layers, ...)
      training.json       the train profile section, target path, shards manifest digest, metrics at save
      optimizer.pt        full (unsharded) AdamW state keyed by parameter name (rank 0 writes, rank 0 reads)
      train_state.pt      step, scheduler, feed position (regen.train.feed), RNG states, world size
    <run>/train/latest.json   {"step": 100, "path": "checkpoints/step-000100"}, written after the folder is complete

A step folder is written under a temporary name and renamed, and `latest.json` only then points at it, so a
crash mid-save leaves the previous checkpoint as the latest. Full state dicts make a checkpoint independent of
the world size it was written with. Every function here is collective: all ranks call it.
"""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from regen.train.model import CONFIG_NAME, FROZEN_PREFIXES, WEIGHTS_NAME
from regen.train.parallel import full_model_state, full_optim_state, load_full_model_state, load_full_optim_state
from schemas.io import read_json, write_json_atomic

LATEST = "latest.json"


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
    draft itself. Keeps the newest `keep` step folders (0 = all). Returns the folder's path (on every rank).
    """
    from safetensors.torch import save_file

    draft, prefix = _draft_of(model)
    model_sd = _strip(full_model_state(model), prefix)
    optim_sd = full_optim_state(model, optimizer)
    root = Path(train_dir) / "checkpoints"
    final = root / f"step-{step:06d}"
    if dist.get_rank() == 0:
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
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        write_json_atomic({"step": step, "path": str(final.relative_to(train_dir))}, Path(train_dir) / LATEST)
        if keep > 0:
            for old in sorted(root.glob("step-*"))[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    from regen.train.collectives import control_barrier

    control_barrier()  # the others wait under the control plane's timeout, not the NCCL watchdog's
    return final


def latest_checkpoint(train_dir: Path) -> Path | None:
    """The folder `latest.json` points at, or None when there is none yet."""
    latest = read_json(Path(train_dir) / LATEST)
    if not latest:
        return None
    path = Path(train_dir) / latest["path"]
    return path if path.is_dir() else None


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
