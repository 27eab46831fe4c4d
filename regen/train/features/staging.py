"""Feature objects from the store into the training device: the store reads each into a reused host slot (pinned on
CUDA, registered with the store), then an asynchronous copy to the device issued one micro-batch ahead, so at most
`DEVICE_RESIDENT_OBJECTS` objects are on the device at any time (TorchSpec `torchspec/transfer/mooncake/
eagle_store.py`: `batch_get_into` a registered buffer; `torchspec/training/data_fetcher.py`: pinned buffer,
`non_blocking` copies on a copy stream with events; gpu-readiness finding 3).

The path of one object (`regen.train.features.client.RemoteFeatures` drives it):

1. `stage_into(fill, nbytes)` + `locate(staged, header)` (in `fetch`, before the step's compute): the store writes
   the whole object into a free host slot (`StoreClient.get_into`; slots are registered through `register` when
   allocated or grown): no copy of regen's. `stage(buf, header)` is the path for a store with only a buffer to
   read from: one copy of the tensors' bytes out of it. Either way the slot is reused (grown to the largest
   object) and the store's object can be removed right after. With `train.producers.read_ahead` D > 0 the client's
   reader thread stages at most D objects ahead of the micro-batch computing, so the host holds D + 1 slots (the
   one computing, on CPU, or whose device copy may still run, on CUDA); with D = 0 a step's objects are all staged
   before its first forward: grad_accum slots. Host memory, counted apart from the GPU's (`regen.report.plan`).
   The slots' state changes under a lock (the reader thread stages while the training thread issues, releases).
2. `issue(staged)` (when the previous micro-batch is handed to compute, or when the reader staged the next one
   after that): CUDA: the side stream waits until the
   training stream released the device slot's previous object, then copies the slot's bytes `non_blocking` into
   it and records an event; the host slot is reused only after that event completed. CPU: the device is the
   host, nothing is copied: the host slot is the object's memory.
3. `ready(staged)` -> (taps, last_hidden): the training stream waits for the copy's event (on the GPU only).
   A check of the values (`contract.check_values`) runs `on_copy_stream()`: its one host read waits for this
   copy, not for the compute queued on the training stream.
4. `release(staged)` (the loss is done: after its backward): CUDA: an event on the training stream marks the
   device slot free for the object after next; CPU: the host slot is free.

Device residency: `DEVICE_RESIDENT_OBJECTS` = 2 device slots (the micro-batch computing and the next one being
copied). An object is resident from `issue` to `release`; `stats["resident_max"]` is the most at once, counted the
same way on CPU. A caller that asks for a third before releasing one gets a fresh device buffer, never a slot still
in use: counted (`extra_device_buffers`) and visible in `resident_max`, not a silent overwrite.

The CUDA calls go through a small seam (`_CudaOps`: pinned and device buffers, the side-stream copy, events), so
the order of the calls is tested on CPU with a recording double (tests/train/test_feature_contract.py).

Host slots are exact: on CUDA each is one plain host allocation of the object's size, page-locked with
`cudaHostRegister` (`pin_host`; `pin_memory=True` would round it up to a power of two, 8 GiB for a 5.25 GiB
object) and registered with the store; a slot is regrown (unpinned, unregistered, reallocated) only for a larger
object. So the slots hold (read_ahead + 1, or grad_accum with read_ahead 0) x the largest object, which is
`regen.train.memory.host_staging_bytes`.

`stats`: objects, host bytes copied, host copies, store reads into slots, device bytes copied, device copies,
pinned bytes (page-locked now), resident now and at most, extra device buffers, host slot bytes (now and at most,
pinned or not: what the slots hold allocated).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from regen.train.features.contract import tensor_extents

DEVICE_RESIDENT_OBJECTS = 2  # feature objects on the device at once: the micro-batch computing and the next one


@dataclass
class Staged:
    """One object between the store and the loss: its host slot, its tensors' (offset, bytes, shape) there, and once
    issued its device buffer and copy event. `zeros`: a failed micro-batch's zero features (no bytes staged)."""
    key: tuple
    dtype: torch.dtype
    parts: list = field(default_factory=list)  # [(offset from base, nbytes, shape)] of taps, last_hidden
    nbytes: int = 0  # bytes copied to the device: the slot's [base, base + nbytes)
    base: int = 0
    slot: int | None = None  # host slot index
    zeros: bool = False
    issued: bool = False
    released: bool = False
    dev: torch.Tensor | None = None  # the bytes on the device (CUDA) / the host slot (CPU)
    dev_slot: int | None = None  # device slot index; None: an extra buffer (or CPU)
    event: object = None  # the copy's event (CUDA)


CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process


def pin_host(nbytes: int, cudart=None) -> torch.Tensor:
    """A host buffer of exactly `nbytes` (uint8[nbytes]), page-locked for the device by `cudaHostRegister`.

    Not `pin_memory=True`: PyTorch's caching host allocator rounds every pinned allocation up to a power of two
    (`PowerOf2Ceil` in aten/src/ATen/core/CachingHostAllocator.h, for any size under `pinned_max_round_threshold`,
    unbounded by default) and keeps freed blocks cached, so a 5.25 GiB slot would take 8 GiB. A plain host tensor
    registered by hand takes what it holds, and `unpin_host` gives the pages back when a slot is regrown or dropped
    (the same calls as `torch.cuda._pin_memory_utils`). `cudart`: `torch.cuda.cudart()` unless given (tests).
    Raises RuntimeError naming the size when the registration fails (host memory exhausted or locked-memory limit).
    """
    buf = torch.empty(nbytes, dtype=torch.uint8)
    cudart = cudart or torch.cuda.cudart()
    rc = int(cudart.cudaHostRegister(buf.data_ptr(), nbytes, CUDA_HOST_REGISTER_PORTABLE))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister of a {nbytes:,}-byte feature staging slot failed (cudaError {rc}): the "
                           "host is out of memory it can page-lock; lower train.grad_accum or train.max_tokens "
                           "(`regen plan` prints the host memory per GPU), or raise the locked-memory limit")
    return buf


def unpin_host(buf: torch.Tensor, cudart=None) -> None:
    """Undo `pin_host(...)` for `buf` before it is dropped. Raises RuntimeError when CUDA refuses."""
    cudart = cudart or torch.cuda.cudart()
    rc = int(cudart.cudaHostUnregister(buf.data_ptr()))
    if rc != 0:
        raise RuntimeError(f"cudaHostUnregister of a {buf.numel():,}-byte feature staging slot failed (cudaError {rc})")


class _CudaOps:
    """The CUDA calls of `Staging`, one method each (a seam: tests replace it with a recording double)."""

    def __init__(self, device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def pinned(self, nbytes):
        return pin_host(nbytes)

    def unpin(self, buf):
        unpin_host(buf)

    def device_buffer(self, nbytes):
        with torch.cuda.stream(self.stream):  # allocated on the side stream that writes it
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def side_wait(self, event):
        self.stream.wait_event(event)

    def copy_async(self, dst, src):
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def train_wait(self, event, dev):
        torch.cuda.current_stream(self.device).wait_event(event)  # the GPU waits; the host does not
        dev.record_stream(torch.cuda.current_stream(self.device))  # freed only after the training stream's uses

    def train_event(self):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def host_wait(self, event):
        event.synchronize()

    def on_copy_stream(self):
        return torch.cuda.stream(self.stream)


class Staging:
    """Reused host slots, at most `device_slots` objects on the device, copies one micro-batch ahead (see the module
    docstring). `ops`: the CUDA calls (default on a CUDA device; None on CPU: the device is the host).
    `register` / `unregister`: the store's, called with each host slot allocated / dropped (for `stage_into`)."""

    def __init__(self, device, *, device_slots: int = DEVICE_RESIDENT_OBJECTS, ops=None, register=None,
                 unregister=None):
        self.device = torch.device(device)
        self.register, self.unregister = register, unregister  # the store's, for `stage_into` (get_into)
        self.ops = ops if ops is not None else (_CudaOps(self.device) if self.device.type == "cuda" else None)
        # the client's reader thread stages while the training thread issues and releases: the slots' state changes
        # under this lock; the long parts (the store's read into a slot, a slot's regrowth, waiting for a copy) not
        self._lock = threading.RLock()
        self.host: list[dict] = []  # {"buf", "busy", "event"}
        self.dev_slots: list[dict] = [{"buf": None, "owner": None, "free": None} for _ in range(device_slots)]
        self.stats = {"objects": 0, "host_bytes": 0, "host_copies": 0, "store_reads_into_slots": 0,
                      "device_bytes": 0, "device_copies": 0, "pinned_bytes": 0, "resident": 0, "resident_max": 0,
                      "extra_device_buffers": 0, "host_slot_bytes": 0, "host_slot_bytes_max": 0}

    # -- 1. the store's buffer -> a host slot ----------------------------------------------------------------
    def stage(self, buf, header: dict, key=None) -> Staged:
        """Copy the object's taps and last_hidden bytes out of `buf` (which the caller may release after this
        returns) into a free host slot. Raises FeatureContractError when a tensor's extent lies outside it."""
        dtype = getattr(torch, header["dtype"])
        src = torch.frombuffer(buf, dtype=torch.uint8)
        extents = tensor_extents(header, src.numel())
        total = sum(z for _, z, _ in extents)
        i = self._host_slot(total)
        host, parts, at = self.host[i]["buf"], [], 0
        for s, z, shape in extents:
            host[at:at + z].copy_(src[s:s + z])
            parts.append((at, z, shape))
            at += z
        with self._lock:
            self.stats["objects"] += 1
            self.stats["host_bytes"] += total
            self.stats["host_copies"] += 1
        return Staged(key, dtype, parts, total, slot=i)

    def stage_into(self, fill, nbytes: int, key=None) -> tuple[Staged, memoryview]:
        """The store reads the whole object (`nbytes`, header included) straight into a free host slot: `fill(buf)`
        writes `buf[:nbytes]` (`StoreClient.get_into`; the slots are registered with the store through
        `register`). No copy of regen's own. Returns (staged, a view of the object's bytes for its header); then
        `locate(staged, header)` once the header is checked, or `discard(staged)`."""
        i = self._host_slot(nbytes)
        h = self.host[i]
        try:
            fill(h["buf"])
        except BaseException:
            with self._lock:
                h["busy"] = False
            raise
        with self._lock:
            self.stats["objects"] += 1
            self.stats["store_reads_into_slots"] += 1
        return Staged(key, None, nbytes=nbytes, slot=i), memoryview(h["buf"][:nbytes].numpy())

    def locate(self, staged: Staged, header: dict) -> Staged:
        """Point `staged` (from `stage_into`) at its tensors by the checked `header`: the span from taps to the end
        of last_hidden is what goes to the device. Raises FeatureContractError (an extent outside the object)."""
        staged.dtype = getattr(torch, header["dtype"])
        extents = tensor_extents(header, staged.nbytes)  # staged.nbytes: the whole object's, until here
        staged.base = min(s for s, _, _ in extents)
        staged.nbytes = max(s + z for s, z, _ in extents) - staged.base
        staged.parts = [(s - staged.base, z, shape) for s, z, shape in extents]
        return staged

    def discard(self, staged: Staged) -> None:
        """A staged object that will not be used (its header refused): its host slot is free again."""
        with self._lock:
            if staged.slot is not None and not staged.issued:
                self.host[staged.slot]["busy"] = False

    def _host_slot(self, nbytes: int) -> int:
        """A host slot no object still needs: not holding one waiting for its device copy (or, on CPU, in use by
        the loss), its last copy to the device finished. A new slot when none is free. The slot is taken under the
        lock; the wait for its last copy and its regrowth happen outside it (nothing else touches a busy slot)."""
        with self._lock:
            free = [i for i, h in enumerate(self.host) if not h["busy"]]
            if free:
                i = max(free, key=lambda j: self.host[j]["buf"].numel())  # the largest: the fewest regrowths
            else:
                self.host.append({"buf": None, "busy": False, "event": None})
                i = len(self.host) - 1
            h = self.host[i]
            h["busy"] = True
            event, h["event"] = h["event"], None
        if event is not None:
            self.ops.host_wait(event)  # its previous object's copy to the device has finished
        if h["buf"] is None or h["buf"].numel() < nbytes:
            old = 0 if h["buf"] is None else h["buf"].numel()
            if h["buf"] is not None and self.unregister is not None:
                self.unregister(h["buf"])
            if h["buf"] is not None and self.ops is not None:
                self.ops.unpin(h["buf"])  # its pages go back now, not to a cache of pinned blocks
            h["buf"] = None
            h["buf"] = self.ops.pinned(nbytes) if self.ops is not None else torch.empty(nbytes, dtype=torch.uint8)
            if self.register is not None:
                self.register(h["buf"])
            with self._lock:
                if self.ops is not None:
                    self.stats["pinned_bytes"] += nbytes - old
                self.stats["host_slot_bytes"] += nbytes - old
                self.stats["host_slot_bytes_max"] = max(self.stats["host_slot_bytes_max"],
                                                        self.stats["host_slot_bytes"])
        return i

    def zeros(self, key, dtype: torch.dtype, shapes) -> Staged:
        """A failed micro-batch's features: zeros of `shapes` [(B, S, T·H), (B, S, H)], made on the device at issue."""
        parts, at = [], 0
        for shape in shapes:
            n = dtype.itemsize
            for d in shape:
                n *= d
            parts.append((at, n, tuple(shape)))
            at += n
        return Staged(key, dtype, parts, at, zeros=True)

    # -- 2. the host slot -> the device, one micro-batch ahead -----------------------------------------------
    def issue(self, staged: Staged) -> None:
        """Start the object's copy to the device (asynchronous; CPU: nothing to copy). It is resident from here."""
        with self._lock:
            self._issue(staged)

    def _issue(self, staged: Staged) -> None:
        if staged.issued:
            return
        staged.issued = True
        self._resident(+1)
        if staged.zeros:
            staged.dev = torch.zeros(staged.nbytes, dtype=torch.uint8, device=self.device)
            return
        host = self.host[staged.slot]
        span = host["buf"][staged.base:staged.base + staged.nbytes]
        if self.ops is None:  # CPU: the host slot is the object's memory until release
            staged.dev = span
            return
        staged.dev, staged.dev_slot = self._device_buffer(staged)
        staged.event = self.ops.copy_async(staged.dev[:staged.nbytes], span)
        host["event"], host["busy"] = staged.event, False  # reusable once that copy finished
        self.stats["device_bytes"] += staged.nbytes
        self.stats["device_copies"] += 1

    def _device_buffer(self, staged: Staged):
        for j, d in enumerate(self.dev_slots):
            if d["owner"] is None or d["owner"].released:
                if d["free"] is not None:
                    self.ops.side_wait(d["free"])  # the training stream is done with the slot's last object
                    d["free"] = None
                if d["buf"] is None or d["buf"].numel() < staged.nbytes:
                    d["buf"] = None
                    d["buf"] = self.ops.device_buffer(staged.nbytes)
                d["owner"] = staged
                return d["buf"], j
        self.stats["extra_device_buffers"] += 1  # every slot holds an unreleased object: never overwrite one
        return self.ops.device_buffer(staged.nbytes), None

    # -- 3. handed to compute ---------------------------------------------------------------------------------
    def ready(self, staged: Staged) -> tuple[torch.Tensor, torch.Tensor]:
        """(taps, last_hidden) on the device, views of the object's bytes; the training stream waits for the copy.
        Valid until `release(staged)`."""
        self.issue(staged)  # a no-op when it was issued one micro-batch ago
        if staged.event is not None:
            self.ops.train_wait(staged.event, staged.dev)
        return tuple(staged.dev[a:a + z].view(staged.dtype).view(shape) for a, z, shape in staged.parts)

    def on_copy_stream(self):
        """A context in which work is queued on the copy stream, after the copies issued so far (CPU: a no-op): a
        check of an object's values read there waits for its copy only, not for the training stream's compute."""
        import contextlib

        return self.ops.on_copy_stream() if self.ops is not None else contextlib.nullcontext()

    # -- 4. the loss is done ------------------------------------------------------------------------------------
    def release(self, staged: Staged) -> None:
        """The loss no longer needs the object's tensors: its device slot (CPU: its host slot) may be reused."""
        with self._lock:
            if staged.released or not staged.issued:
                return
            staged.released = True
            self._resident(-1)
            if staged.dev_slot is not None:
                self.dev_slots[staged.dev_slot]["free"] = self.ops.train_event()
            elif self.ops is None and staged.slot is not None:
                self.host[staged.slot]["busy"] = False
            staged.dev = None

    def close(self) -> None:
        """Drop every slot, unregistering the host slots from the store first (a freed buffer left registered would
        make the store refuse a later one at the same addresses: "overlapped memory region")."""
        for h in self.host:
            if h["buf"] is None:
                continue
            if h["event"] is not None:
                self.ops.host_wait(h["event"])
            if self.unregister is not None:
                self.unregister(h["buf"])
            if self.ops is not None:
                self.ops.unpin(h["buf"])
        self.host.clear()
        self.stats["host_slot_bytes"] = self.stats["pinned_bytes"] = 0
        for d in self.dev_slots:
            d.update(buf=None, owner=None, free=None)

    def _resident(self, n: int) -> None:
        self.stats["resident"] += n
        self.stats["resident_max"] = max(self.stats["resident_max"], self.stats["resident"])
