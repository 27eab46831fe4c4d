"""Sharded resumable state with torch's distributed checkpoint (DCP): every rank writes its own shards, nothing is
gathered to rank 0, and a load reshards to the world size it runs at (torchtitan `components/checkpointer/dcp.py`,
TorchSpec `dcp.save`).

    save_sharded(dir, model, optimizer)   # collective: <dir>/.metadata + one file per rank
    load_sharded(dir, model, optimizer)   # collective, at any world size

The trainable weights, the persistent buffers and the optimizer state go in; the frozen embed_tokens/lm_head do
not (they are the target's, and every rank has them). `regen.train.checkpoint` still writes the full-state
checkpoint and the servable export; this module is its sharded counterpart for resuming at scale (issue 26,
point 6), tested 2 ranks -> 1 -> 2 with gloo (tests/train/test_gpu_paths.py), not wired into the loop yet.
"""
from __future__ import annotations

from pathlib import Path

from torch import nn


def _frozen_keys(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if not p.requires_grad}


def _model_state(model: nn.Module) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    frozen = _frozen_keys(model)
    return {k: v for k, v in get_model_state_dict(model).items() if k not in frozen}


def save_sharded(path, model: nn.Module, optimizer) -> None:
    """Write the model's trainable state and the optimizer's state, sharded as they are, to `path`. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {"model": _model_state(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=str(Path(path)))


def load_sharded(path, model: nn.Module, optimizer) -> None:
    """Load `save_sharded`'s state into a sharded model and its optimizer at this world size. Collective. Raises
    RuntimeError (DCP's) for a missing or mismatched tensor."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)

    state = {"model": _model_state(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(Path(path)))
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
