"""Every collective of `regen train` in one place, on the plane that serves it, with its tensors checked.

Two planes (torchtitan's `cpu:gloo,cuda:nccl`, TorchSpec's separate gloo group):

* **hot**: the default process group (NCCL on CUDA, gloo on CPU), for tensors on the training device. FSDP2's
  all-gathers and reduce-scatters use it through the device mesh; our own hot collectives (`hot_all_reduce_sum`)
  take device tensors only, so they never force a host-device synchronisation.
* **control**: a gloo group with its own timeout, for host-side agreement: the step's loss weights, flags,
  counts, the any-rank-failed agreement (`raise_if_any_rank_failed`), object broadcasts, barriers around
  checkpoints, and the coordination of the sharded checkpoint (`control_dcp_save`, `control_dcp_load`: torch's
  distributed checkpoint exchanges plans and metadata there; the tensors go to files). Its tensors are CPU tensors,
  which NCCL cannot carry at all (`RuntimeError: No backend type associated with device type cpu`, the crash of the
  first GPU run, shared/docs/gpu-readiness.md finding 1).

The check: every collective states its plane; each tensor's device is checked against the backend that serves
that plane on a real run (`nccl` -> cuda, gloo control -> cpu). `declare_backend("nccl")` (or the environment
variable `REGEN_TRAIN_DECLARE_BACKEND=nccl`, read by `setup`) makes a CPU run check as a GPU run would, so a CPU
tensor reaching the hot plane raises `CollectiveDeviceError` in CI instead of on the first GPU.

Timeouts (`collective_timeouts`): the control plane waits longer than any designed wait of one rank (producer
start-up, no producer, `--follow` for shards), so the clear error of the waiting rank reaches every rank over
gloo; the hot (NCCL) timeout is longer still, so its watchdog never kills the job first.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

DECLARE_ENV = "REGEN_TRAIN_DECLARE_BACKEND"
DEFAULT_TIMEOUT_S = 1800.0
MARGIN_S = 300.0  # beyond the longest designed wait: time for the failing rank's message to travel


class CollectiveDeviceError(RuntimeError):
    """A tensor on a plane whose backend cannot carry it (a CPU tensor into NCCL, a device tensor into the gloo
    control plane): a programming error, raised before the collective runs."""


@dataclass
class _Planes:
    hot_backend: str  # the real backend of the default group ("nccl" | "gloo")
    declared: str  # the backend checked against ("nccl" on GPU runs, or declared on CPU for tests)
    control: object | None  # the gloo group (None: the default group, when it is gloo and has no own timeout)
    control_timeout_s: float
    hot_timeout_s: float
    world: object = None  # the default group these planes were made beside (a later group makes them stale)


_planes: _Planes | None = None


def collective_timeouts(cfg=None) -> tuple[float, float]:
    """(control_s, hot_s) for a `TrainConfig`: control = max(1800, longest designed wait + 300), hot = control
    + 300. The longest designed wait is what one rank may spend before it reaches the next agreement while the
    others wait there: `producers.startup_timeout_s`, `producers.no_producer_timeout_s`, `follow_timeout_s`."""
    waits = [0.0]
    if cfg is not None:
        waits.append(float(getattr(cfg, "follow_timeout_s", 0.0) or 0.0))
        p = getattr(cfg, "producers", None)
        if p is not None and getattr(cfg, "features", "") == "producers":
            waits += [float(p.startup_timeout_s), float(p.no_producer_timeout_s)]
    control = max(DEFAULT_TIMEOUT_S, max(waits) + MARGIN_S)
    return control, control + MARGIN_S


def setup(hot_backend: str, *, control_timeout_s: float, hot_timeout_s: float,
          declared: str | None = None) -> None:
    """Create the control group (gloo, `control_timeout_s`) beside the initialised default group. Collective."""
    global _planes
    declared = declared or os.environ.get(DECLARE_ENV) or hot_backend
    if declared not in ("nccl", "gloo"):
        raise ValueError(f"{DECLARE_ENV}={declared!r}: use nccl or gloo")
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=control_timeout_s))
    _planes = _Planes(hot_backend, declared, control, control_timeout_s, hot_timeout_s, dist.group.WORLD)


def teardown() -> None:
    global _planes
    _planes = None


def is_set_up() -> bool:
    """True when `setup` ran beside the current default process group (not one destroyed since)."""
    return _planes is not None and dist.is_initialized() and _planes.world is dist.group.WORLD


def planes() -> _Planes:
    """The current planes; without `setup` (a process group made elsewhere) the default group serves both."""
    if is_set_up():
        return _planes
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return _Planes(backend, os.environ.get(DECLARE_ENV) or backend, None, DEFAULT_TIMEOUT_S, DEFAULT_TIMEOUT_S)


@contextlib.contextmanager
def declare_backend(backend: str):
    """Check collectives as if the hot plane were `backend` (tests: "nccl" on a CPU run)."""
    global _planes
    saved = _planes
    p = planes()
    _planes = _Planes(p.hot_backend, backend, p.control, p.control_timeout_s, p.hot_timeout_s,
                      dist.group.WORLD if dist.is_initialized() else None)
    try:
        yield
    finally:
        _planes = saved


def check(tensors, plane: str, what: str) -> None:
    """Raise CollectiveDeviceError when a tensor of `what` cannot travel on `plane` ("hot" | "control")."""
    p = planes()
    for t in tensors:
        if plane == "control" and t.device.type != "cpu":
            raise CollectiveDeviceError(
                f"{what}: a {t.device} tensor on the control plane (gloo, CPU tensors): move it with one "
                "`.cpu()` where the value is needed on the host, or use the hot plane for device tensors")
        if plane == "hot" and p.declared == "nccl" and t.device.type != "cuda":
            raise CollectiveDeviceError(
                f"{what}: a {t.device} tensor on the hot plane, which NCCL serves on a GPU run (NCCL carries CUDA "
                "tensors only: 'No backend type associated with device type cpu'); keep it on the training device "
                "or send host values over the control plane (regen.train.collectives.control_*)")


def _control_group():
    return planes().control


def hot_all_reduce_sum(x: torch.Tensor, what: str) -> torch.Tensor:
    """Σ over ranks of a training-device tensor (a copy), on the default group: no host synchronisation."""
    check([x], "hot", what)
    out = x.detach().clone()
    dist.all_reduce(out)
    return out


def control_all_reduce_sum(x: torch.Tensor, what: str) -> torch.Tensor:
    """Σ over ranks of a CPU tensor (a copy), on the control group."""
    check([x], "control", what)
    out = x.detach().clone()
    dist.all_reduce(out, group=_control_group())
    return out


def control_broadcast(x: torch.Tensor, src: int, what: str) -> None:
    """Broadcast a CPU tensor from global rank `src` in place, on the control group."""
    check([x], "control", what)
    dist.broadcast(x, src=src, group=_control_group())


def control_broadcast_object_list(box: list, src: int = 0) -> None:
    """`dist.broadcast_object_list` on the control group (pickled on the host, never through the device)."""
    dist.broadcast_object_list(box, src=src, group=_control_group())


def control_all_gather_object(out: list, obj) -> None:
    """`dist.all_gather_object` on the control group."""
    dist.all_gather_object(out, obj, group=_control_group())


def control_barrier() -> None:
    """A barrier on the control group: ranks wait for rank 0's checkpoint or evaluation under its timeout, not
    under the NCCL watchdog's."""
    dist.barrier(group=_control_group())


def control_dcp_save(state: dict, path) -> None:
    """`torch.distributed.checkpoint.save` of `state` (DTensors, tensors, objects) to the folder `path`, its
    coordination on the control group: DCP exchanges only plans and metadata (pickled objects) between ranks;
    each rank writes its own shards' bytes to its own files (fsynced), rank 0 the `.metadata`. Raises DCP's
    CheckpointException on every rank when any rank failed."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True),
             process_group=_control_group())


def control_dcp_load(state: dict, path) -> None:
    """`torch.distributed.checkpoint.load` into `state` in place (resharded to this world size), coordinated on the
    control group like `control_dcp_save`; each rank reads the byte ranges of its own shards."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), process_group=_control_group())


def raise_if_any_rank_failed(error: BaseException | None) -> None:
    """Collective on the control plane: when any rank passes an error, every rank raises (this rank's own error,
    or an InputError with every failing rank's message), so a failure on one rank stops the job cleanly instead
    of leaving the others in the next collective until a timeout. `error` None = this rank is fine. The flag
    travels at world size 1 too (the same path and checks); then `error` is re-raised."""
    flag = control_all_reduce_sum(torch.tensor([0 if error is None else 1], dtype=torch.int64),
                                  "the any-rank-failed flag")
    if int(flag[0]) == 0:
        return
    if dist.get_world_size() == 1:
        raise error
    msgs: list = [None] * dist.get_world_size()
    control_all_gather_object(msgs, None if error is None else (type(error).__name__, str(error)))
    if error is not None:
        raise error
    from regen.errors import InputError

    raise InputError("; ".join(f"rank {r}: {m[1]}" for r, m in enumerate(msgs) if m is not None))
