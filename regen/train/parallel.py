"""Distribution for `regen train`: the process group and FSDP2 sharding, applied in one function.

Process group from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); without
it, a world of one in this process (an in-memory store), so one process takes the same code path as many.
Backend: NCCL on CUDA, gloo on CPU, plus a gloo control group for host-side agreement
(`regen.train.collectives`, through which every collective goes). Sharding follows torchtitan
`models/llama3/parallelize.py`: `fully_shard` on each block of `model.layers`, then on the root; the training loop has
no `if distributed` branches.

The servable weights of a checkpoint gather to rank 0 on CPU (`gathered_model_state`); the resumable state is
sharded (`regen.train.sharded_state`). Full state dicts (`full_model_state`, `full_optim_state`, and their loads
broadcast from rank 0) serve the older checkpoints that hold `optimizer.pt`, tests and evaluation.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job. `device`: cuda:LOCAL_RANK with NCCL, or cpu with gloo."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(device: str = "auto", local_rank: int = 0) -> torch.device:
    """`auto` -> cuda:LOCAL_RANK when CUDA is available, else cpu (logged); `cpu`/`cuda` taken as given.

    Raises InputError for `cuda` when this torch sees no CUDA device (a CPU-only wheel, no driver, no visible
    GPU: a run that expected GPUs never trains on CPU silently), and for a local rank beyond the visible devices
    (`--nproc_per_node` larger than the node's GPUs, e.g. 8 on a 4-GPU GB200 tray).
    """
    from regen.errors import InputError

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            import logging

            logging.getLogger(__name__).warning(
                "train.device=auto: no CUDA device visible to torch %s (CUDA build: %s); training on CPU. Set "
                "train.device=cuda on GPU nodes so this is an error", torch.__version__, torch.version.cuda)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise InputError(
                f"train.device=cuda but torch {torch.__version__} sees no CUDA device (CUDA build: "
                f"{torch.version.cuda}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): install "
                "a CUDA build of torch on the GPU nodes, check the driver and the visible devices, or set "
                "train.device=cpu to train on CPU on purpose")
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise InputError(
                f"LOCAL_RANK={local_rank} but this node has {count} visible CUDA device(s): launch at most "
                f"{count} processes per node (torchrun --nproc_per_node {count}; a GB200 tray has 4 GPUs, see "
                "docs/cluster.md)")
        return torch.device("cuda", local_rank)
    return torch.device(device)


def init_distributed(device: str = "auto", timeout_s: float | None = None,
                     control_timeout_s: float | None = None) -> DistInfo:
    """Initialise (or reuse) the default process group from torchrun's env vars; world size 1 without them.

    Then the control group (`regen.train.collectives.setup`, gloo). Timeouts default to
    `collectives.collective_timeouts()`: control 1,800 s, hot (NCCL) longer, so the clear error wins.
    Raises InputError from `resolve_device`.
    """
    from regen.train import collectives

    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = resolve_device(device, local_rank)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    default_control, default_hot = collectives.collective_timeouts()
    control_timeout_s = control_timeout_s or default_control
    timeout_s = timeout_s or max(default_hot, control_timeout_s + collectives.MARGIN_S)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        extra = {"device_id": dev} if dev.type == "cuda" else {}  # eager NCCL init on this rank's GPU
        if "MASTER_ADDR" in os.environ and world > 1 or "TORCHELASTIC_RUN_ID" in os.environ:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **extra)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **extra)
        collectives.setup(backend, control_timeout_s=control_timeout_s, hot_timeout_s=timeout_s)
    elif not collectives.is_set_up():  # a group made elsewhere (or planes left from a destroyed one)
        collectives.setup(dist.get_backend(), control_timeout_s=control_timeout_s, hot_timeout_s=timeout_s)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend)


def destroy_distributed() -> None:
    from regen.train import collectives

    collectives.teardown()
    if dist.is_initialized():
        dist.destroy_process_group()


def shard_model(model: nn.Module, info: DistInfo, *, blocks=None, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = torch.float32, reshard_after_forward: bool = True,
                replicate_frozen: bool = True) -> nn.Module:
    """Apply FSDP2 `fully_shard` to each block (`blocks`, default `model.layers`), then to `model` (in place).

    `param_dtype` (e.g. bf16) is the compute dtype of unsharded parameters; sharded master weights keep their
    dtype (fp32), and gradients are reduced in `reduce_dtype`. Gradients are averaged over ranks: losses are
    normalised by the global denominator times world size (spec §5) to cancel that average.
    Frozen parameters (the draft's embed_tokens/lm_head, copies of the target's) are left out of FSDP when
    `replicate_frozen`: every rank holds them whole and nothing gathers them each step (for the 262K x 640
    Gemma vocabulary that copy was most of a CPU step).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    frozen = {p for p in model.parameters() if not p.requires_grad} if replicate_frozen else set()
    for block in (model.layers if blocks is None else blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    ignored_params={p for p in block.parameters() if p in frozen} or None)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                ignored_params=frozen or None)
    return model


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """Skip (False) or do (True) the gradient reduce-scatter of the next backward (accumulation micro-batches)."""
    model.set_requires_gradient_sync(sync)


def raise_if_any_rank_failed(error: BaseException | None) -> None:
    """See `regen.train.collectives.raise_if_any_rank_failed` (on the control plane)."""
    from regen.train.collectives import raise_if_any_rank_failed as agree

    agree(error)


def clip_grad_norm(model: nn.Module, max_norm: float, *, as_tensor: bool = False):
    """Clip the global gradient norm of the (sharded) trainable parameters; returns the norm before clipping:
    a float, or with `as_tensor` a 0-d tensor on the training device (no host synchronisation)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.detach() if as_tensor else float(norm)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded state dict on CPU, complete on rank 0 (empty elsewhere). Collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def gathered_model_state(model: nn.Module, keep=None) -> dict[str, torch.Tensor]:
    """The unsharded tensors of `model`'s state dict whose name `keep(name)` accepts (default all), on CPU on
    rank 0 (empty elsewhere). Collective: one all-gather per sharded tensor (`DTensor.full_tensor`, on the hot
    plane through FSDP's mesh), in state-dict order on every rank; each full tensor is freed on the device once
    rank 0 has its CPU copy. Unlike `full_model_state`, the tensors left out are never copied (the frozen
    embed_tokens/lm_head, replicated and the target's)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    main = not dist.is_initialized() or dist.get_rank() == 0
    out = {}
    for name, value in get_model_state_dict(model).items():
        if keep is not None and not keep(name):
            continue
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        if main:
            out[name] = full.detach().to("cpu", copy=True)
        del full
    return out


def load_full_model_state(model: nn.Module, state: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load an unsharded state dict read on rank 0 (others may pass {}) into the sharded model. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=strict))


def full_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Unsharded optimizer state keyed by parameter name, complete on rank 0. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load an optimizer state from `full_optim_state` (read on rank 0) into the sharded optimizer. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))
