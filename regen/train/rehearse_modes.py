"""What `regen rehearse` watches while the trainer's step runs on stand-in tensors: host syncs, collectives and
tensors on the wrong device, each with the line of `regen` it comes from.

`Watch` is a `TorchDispatchMode` entered inside `FakeTensorMode` (the memory pass) or over the `meta` device (the
placement pass), so it sees every aten op before the stand-in tensors do:

* a **host sync**: an op whose result the host must wait for on a GPU. `_local_scalar_dense` (`.item()`,
  `float()`, `int()`, `bool()`, `.tolist()`), a copy from the device to the host (`.cpu()`, `.to("cpu")`), and
  the data-dependent shapes: `nonzero`, boolean-mask indexing and assignment, `masked_select`, `unique`. Fake and
  meta tensors cannot compute these (fake tensors raise `DataDependentOutputException` /
  `DynamicOutputShapeException`), so the op is recorded and answered with a stand-in: the upper bound of the shape
  (every mask element True, every value distinct: what a memory figure must count) and a scalar of 1 (True,
  1, 1.0) unless the fake tensor carries its constant. The step then goes on, so one run lists every sync.
* a **collective**: every `c10d` / `_c10d_functional` op, with its tensors' devices and its process group.
* a **placement error** (only with `device`, the placement pass): an op taking a host tensor of one or more
  dimensions together with a device tensor (CUDA accepts a 0-d host scalar there, so that is allowed). Recorded
  with the op and the line, the host tensor moved to the device, and the step goes on.

A higher-order op (flex_attention and its backward, one fused kernel on the GPU) reaches the mode whole: its tensor
arguments' placement is checked and it runs below the mode, so what happens inside it is not listed.

`where()` is the innermost frame of the `regen` package outside this module and `regen.train.rehearse` (the line
that made torch do it), e.g. `regen/train/loss.py:179 dspark_loss`.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

aten = torch.ops.aten
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../regen
_SKIP = ("rehearse.py", "rehearse_modes.py")

DATA_DEPENDENT = {  # op -> how its stand-in is made (see Watch._stand_in)
    aten.nonzero.default: "nonzero", aten.argwhere.default: "nonzero", aten.masked_select.default: "masked_select",
    aten._unique2.default: "unique", aten.unique_dim.default: "unique", aten.unique_consecutive.default: "unique",
    aten.index.Tensor: "index", aten.index_put_.default: "index_put", aten.index_put.default: "index_put",
    aten._index_put_impl_.default: "index_put",
}
SCALAR_READS = {aten._local_scalar_dense.default: "item"}
COPIES = {aten._to_copy.default, aten.copy_.default}


def where() -> str:
    """The innermost `regen` source line on the stack outside the rehearsal itself ('?' when none)."""
    f = sys._getframe(1)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if path.startswith(_ROOT + os.sep) and os.path.basename(path) not in _SKIP:
            rel = os.path.relpath(path, os.path.dirname(_ROOT))
            return f"{rel}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return "?"


@dataclass
class Event:
    kind: str  # "sync" | "collective" | "placement"
    op: str
    where: str
    phase: str
    detail: str = ""


@dataclass
class Watch(TorchDispatchMode):
    """Records host syncs and collectives (and, with `device`, placement errors); see the module docstring.
    `device`: the device type standing in for the GPU ("meta"), None in the fake-tensor pass (there every fake
    tensor is a device tensor and a real one a host tensor). `phase`: set by the caller ("micro-batch 3", "step")."""

    device: str | None = None
    phase: str = "setup"
    events: list = field(default_factory=list)
    supports_higher_order_operators = True  # flex_attention reaches __torch_dispatch__ whole (see _higher_order)

    def __post_init__(self):
        super().__init__()

    # -- what is a device tensor ------------------------------------------------------------------------------
    def _on_device(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if self.device is not None:
            return t.device.type == self.device
        from torch._subclasses.fake_tensor import FakeTensor

        return isinstance(t, FakeTensor)

    def _record(self, kind: str, op, detail: str = "") -> None:
        self.events.append(Event(kind, str(op).removeprefix("aten.").removesuffix(".default"), where(), self.phase,
                                 detail))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return self._higher_order(func, args, kwargs)
        ns = getattr(func, "namespace", "")
        if ns in ("c10d", "_c10d_functional"):
            self._collective(func, args, kwargs)
            return func(*args, **kwargs)
        if self.device is None and _host_only(args, kwargs):  # fake pass: host work on real tensors stays real
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():
                return func(*args, **kwargs)
        if func in SCALAR_READS and self._on_device(args[0]):
            self._record("sync", func, f"{tuple(args[0].shape)} {args[0].dtype}")
            return _scalar(args[0])
        if func in COPIES:
            out = self._copy(func, args, kwargs)
            if out is not NotImplemented:
                return out
        elif self.device is not None:
            args, kwargs = self._placement(func, args, kwargs)
        how = DATA_DEPENDENT.get(func)
        if how is not None and self._data_dependent(how, args):
            self._record("sync", func, _shapes(args))
            return self._stand_in(how, func, args, kwargs)
        return func(*args, **kwargs)

    def _higher_order(self, func, args, kwargs):
        """A higher-order op (flex_attention and its backward: one fused kernel on the GPU, no host read inside):
        its tensor arguments' placement checked like an aten op's, then run with this mode popped (torch's HOP
        dispatch pops it), so the fake pass takes the HOP's registered fake implementation (outputs, logsumexp
        and gradients only, what the fused kernel allocates) and the meta pass its eager one on meta."""
        if self.device is not None:
            args, kwargs = self._placement(func, args, kwargs)
        return func(*args, **kwargs)

    # -- collectives ------------------------------------------------------------------------------------------
    def _collective(self, func, args, kwargs) -> None:
        flat, _ = tree_flatten((args, kwargs))
        devices = sorted({str(t.device) + ("(fake)" if type(t).__name__ == "FakeTensor" else "")
                          for t in flat if isinstance(t, torch.Tensor)})
        group = "?"
        for a in flat:
            name = _group_name(a)
            if name:
                group = name
                break
        nbytes = sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))
        self._record("collective", func, f"group={group} devices={','.join(devices)} bytes={nbytes}")

    # -- device -> host copies --------------------------------------------------------------------------------
    def _copy(self, func, args, kwargs):
        if func is aten._to_copy.default:
            src, to = args[0], kwargs.get("device")
            if to is not None and torch.device(to).type == "cpu" and self._on_device(src) and self.device:
                self._record("sync", "to(cpu)", f"{tuple(src.shape)} {src.dtype}")
                return torch.zeros(src.shape, dtype=kwargs.get("dtype") or src.dtype)
        else:
            dst, src = args[0], args[1]
            if self.device and dst.device.type == "cpu" and self._on_device(src):
                self._record("sync", "copy_(cpu <- device)", f"{tuple(src.shape)} {src.dtype}")
                return dst
        return NotImplemented

    # -- host tensors meeting device ones (placement pass) ----------------------------------------------------
    def _placement(self, func, args, kwargs):
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if not any(self._on_device(t) for t in tensors):
            return args, kwargs
        host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
        if not host:
            return args, kwargs
        self._record("placement", func, "host " + ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in host)
                     + f" with {self.device} tensors")
        move = {id(t) for t in host}
        return tree_map_only(torch.Tensor, lambda t: t.to(self.device) if id(t) in move else t, (args, kwargs))

    # -- data-dependent shapes --------------------------------------------------------------------------------
    def _data_dependent(self, how: str, args) -> bool:
        if how in ("index", "index_put"):
            return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) and self._on_device(i)
                       for i in args[1] if i is not None)
        return self._on_device(args[0])

    def _stand_in(self, how: str, func, args, kwargs):
        x = args[0]
        if how == "nonzero":
            return torch.zeros(x.numel(), x.dim(), dtype=torch.long, device=x.device)
        if how == "masked_select":
            n = torch.broadcast_shapes(x.shape, args[1].shape).numel()
            return torch.zeros(n, dtype=x.dtype, device=x.device)
        if how == "unique":  # every value distinct: the upper bound
            flat = x.flatten()
            inverse = kwargs.get("return_inverse", args[2] if len(args) > 2 else False)
            counts = kwargs.get("return_counts", args[3] if len(args) > 3 else False)
            out = (flat.clone(),
                   torch.zeros(x.shape if inverse else (0,), dtype=torch.long, device=x.device),
                   torch.ones(flat.shape if counts else (0,), dtype=torch.long, device=x.device))
            return out if func is not aten.unique_consecutive.default else out
        # boolean-mask indexing / assignment: every element of the mask True
        indices = []
        for i in args[1]:
            if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
                indices += [torch.zeros(i.numel(), dtype=torch.long, device=i.device)] * max(1, i.dim())
            else:
                indices.append(i)
        if how == "index":
            return func(x, indices)
        values = args[2]
        want = [len(indices[0]) if indices and indices[0] is not None else 1]
        if values.dim() and values.shape[0] != want[0]:
            values = values.expand(want + list(values.shape[1:])) if values.shape[0] == 1 else values
        return func(x, indices, values, *args[3:], **kwargs)


def _host_only(args, kwargs) -> bool:
    """Real tensors among the arguments and no fake one (the memory pass: a host computation)."""
    from torch._subclasses.fake_tensor import FakeTensor

    flat, _ = tree_flatten((args, kwargs))
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    return bool(tensors) and not any(isinstance(t, FakeTensor) for t in tensors)


def _scalar(t):
    c = getattr(t, "constant", None)
    if c is not None:
        return c.item()
    if t.dtype == torch.bool:
        return True
    return 1 if not t.dtype.is_floating_point and not t.dtype.is_complex else 1.0


def _shapes(args) -> str:
    flat, _ = tree_flatten(args)
    return " ".join(f"{tuple(t.shape)}{'b' if t.dtype == torch.bool else ''}" for t in flat
                    if isinstance(t, torch.Tensor))


def _group_name(a) -> str | None:
    if isinstance(a, str):  # functional collectives name their group
        return a
    if isinstance(a, (torch.Tensor, int, float, bool, list, tuple)) or a is None:
        return None
    try:
        from torch.distributed.distributed_c10d import _world

        for pg, name in _world.pg_names.items():  # a c10d op's ProcessGroup (possibly as a ScriptObject)
            if pg is a or getattr(a, "_type", None) is None and pg == a:
                return _world.pg_group_names.get(pg, name)
    except Exception:  # noqa: BLE001 - torch internals moved: fall back to the attributes
        pass
    for attr in ("group_name", "name"):
        try:
            v = getattr(a, attr)
            v = v() if callable(v) else v
        except Exception:  # noqa: BLE001 - not a process group
            continue
        if isinstance(v, str) and v:
            return v
    return None
