"""Sharded resumable state with torch's distributed checkpoint (DCP): every rank writes its own shards, nothing is
gathered to rank 0, and a load reshards to the world size it runs at (torchtitan `components/checkpointer/dcp.py`,
TorchSpec `dcp.save`).

    state = sharded_state(model, optimizer)      # this rank's views: DTensors of the FSDP2 shards, no copy
    nonfinite_local(state)                        # names of this rank's shards holding a NaN or inf
    save_sharded(dir, model, optimizer, state)    # collective: <dir>/.metadata (rank 0) + __<rank>_0.distcp each
    hash_own_files(dir, rank, is_main)            # {relative name: {"bytes", "sha256"}} of what this rank wrote
    load_sharded(dir, model, optimizer)           # collective, at any world size
    read_sharded(dir)                             # the whole state as plain tensors, one process (tests, tools)

The trainable weights, the persistent buffers and the optimizer state go in; the frozen embed_tokens/lm_head do
not (they are the target's, and every rank has them). The DCP calls run on the control plane's gloo group
(`regen.train.collectives.control_dcp_save`/`control_dcp_load`): DCP's own collectives only exchange plans and
metadata (pickled objects); the tensor bytes go from each rank to its own file, never through rank 0.
`regen.train.checkpoint` writes these files into a step folder's `resume/` and lists them in its MANIFEST.json.

Synchronous, not `dcp.async_save`: an async save finishes its metadata in a background thread with collectives of
its own, which would have to be ordered against the control plane's and the manifest's (every file's sha256) and
`latest.json` would wait for it; each rank writing its own shard in parallel already removes the wait behind
rank 0 that the full-state checkpoint had (shared/docs/gpu-readiness.md finding 8).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def _frozen_keys(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if not p.requires_grad}


def _model_state(model: nn.Module) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    frozen = _frozen_keys(model)
    return {k: v for k, v in get_model_state_dict(model).items() if k not in frozen}


def sharded_state(model: nn.Module, optimizer) -> dict:
    """{"model": trainable weights and buffers, "optimizer": AdamW state keyed by parameter name}: this rank's
    views (DTensors sharded as FSDP2 holds them; plain tensors where replicated). Collective (cheap: no copy)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {"model": _model_state(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def _local(tree):
    """`tree` with every DTensor replaced by this rank's local shard (no communication)."""
    if hasattr(tree, "to_local"):
        return tree.to_local()
    if isinstance(tree, dict):
        return {k: _local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_local(v) for v in tree]
    return tree


def nonfinite_local(state: dict) -> list[str]:
    """Sorted names ("model.<fqn>", "optimizer.state.<fqn>.exp_avg", ...) of this rank's shards of `state`
    (`sharded_state`) holding a NaN or inf. Local: the ranks agree on the verdict over the control plane."""
    from regen.train.guard import nonfinite_tensors

    return nonfinite_tensors(_local(state))


def save_sharded(path, model: nn.Module, optimizer, state: dict | None = None) -> None:
    """Write the model's trainable state and the optimizer's state, sharded as they are, to `path` (files fsynced
    by DCP's writer). Collective. `state`: `sharded_state(model, optimizer)` when already taken. Raises DCP's
    CheckpointException on every rank when any rank fails to write."""
    from regen.train.collectives import control_dcp_save

    control_dcp_save(state if state is not None else sharded_state(model, optimizer), Path(path))


def hash_own_files(path, rank: int, is_main: bool) -> dict:
    """{name relative to `path`'s parent ("resume/__1_0.distcp"): {"bytes", "sha256"}} of the files this rank
    wrote into `path` (DCP names them `__<rank>_<n>.distcp`), each fsynced; the main rank also takes every other
    file (`.metadata`, any file no rank's prefix claims), so the union over ranks covers the folder. Each rank
    reads only its own shards: the hashing is as parallel as the writing."""
    from schemas.io import _fsync_dir, sha256_file

    path = Path(path)
    out = {}
    for f in sorted(path.iterdir()):
        name = f.name
        own = name.startswith(f"__{rank}_")
        claimed = name.startswith("__") and name[2:].split("_", 1)[0].isdigit()
        if f.is_file() and (own or (is_main and not claimed)):
            _fsync_dir(f)
            out[f"{path.name}/{name}"] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
    return out


def load_sharded(path, model: nn.Module, optimizer) -> None:
    """Load `save_sharded`'s state into a sharded model and its optimizer at this world size. Collective. Raises
    RuntimeError (DCP's CheckpointException) for a missing or mismatched tensor."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    from regen.train.collectives import control_dcp_load

    state = sharded_state(model, optimizer)
    control_dcp_load(state, Path(path))
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def read_sharded(path, work_dir) -> dict:
    """The whole state `save_sharded` wrote to `path`, as plain CPU tensors, read in this one process (no process
    group): {"model": {fqn: tensor}, "optimizer": {"state": ..., "param_groups": ...}}. `work_dir`: a scratch
    folder for DCP's conversion (`torch.distributed.checkpoint.format_utils.dcp_to_torch_save`)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    Path(work_dir).mkdir(parents=True, exist_ok=True)
    out = Path(work_dir) / "state.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)
