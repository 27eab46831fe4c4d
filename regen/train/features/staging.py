"""Feature objects from the store's buffer into the training device: one host copy into reused pinned memory,
then an asynchronous copy to the GPU (TorchSpec `torchspec/training/data_fetcher.py`: pinned buffer, non_blocking).

The trainer's earlier path per object: `torch.frombuffer(...).clone()` into freshly allocated pageable memory
(page faults on gigabytes, single-threaded under torchrun), then a synchronous pageable `.to(device)`
(gpu-readiness finding 3). `Staging.to_device(buf, header)`:

* CUDA: copies the object's bytes once into one of `slots` reused pinned host buffers (grown to the largest
  object seen), issues `non_blocking` copies to the device on a side stream and records an event; the slot is
  reused only after its event completed, and the training stream waits for the copy's event before it uses
  the tensors. Host copies per object: 1 (beside the store's own `get_buffer`); no host synchronisation.
* CPU: the device is the host: one copy out of the store's buffer (`clone`), no second one.

`stats`: objects, host bytes copied, device bytes copied, host copies per object, pinned slot bytes.
"""
from __future__ import annotations

import torch

from regen.train.features.contract import FeatureContractError


class Staging:
    """Reused pinned slots and asynchronous host-to-device copies of feature objects (see the module docstring)."""

    def __init__(self, device, slots: int = 2):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.slots: list[torch.Tensor | None] = [None] * slots
        self.events: list = [None] * slots
        self.next = 0
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.stats = {"objects": 0, "host_bytes": 0, "device_bytes": 0, "host_copies": 0, "pinned_bytes": 0}

    def _slot(self, nbytes: int) -> torch.Tensor:
        i = self.next
        self.next = (i + 1) % len(self.slots)
        if self.events[i] is not None:
            self.events[i].synchronize()  # the slot's previous copy to the device has finished
        buf = self.slots[i]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self.stats["pinned_bytes"] += nbytes - (0 if self.slots[i] is None else self.slots[i].numel())
            self.slots[i] = buf
        self._current = i
        return buf

    def to_device(self, buf, header: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(taps, last_hidden) on the device from a feature object's bytes `buf` (a buffer the caller may release
        after this returns). Raises FeatureContractError when a tensor's extent lies outside the object."""
        dtype = getattr(torch, header["dtype"])
        src = torch.frombuffer(buf, dtype=torch.uint8)
        parts = []
        for name in ("taps", "last_hidden"):
            t = header["tensors"][name]
            n = 1
            for d in t["shape"]:
                n *= d
            start, size = int(t["offset"]), n * dtype.itemsize
            if start < 0 or start + size > src.numel():
                raise FeatureContractError(f"feature object: tensor {name} [{start}, {start + size}) lies outside "
                                           f"the object's {src.numel()} bytes")
            parts.append((start, size, tuple(t["shape"])))
        self.stats["objects"] += 1
        if not self.cuda:
            from regen.train.features.contract import decode

            out = decode(buf, header)  # one copy out of the store's buffer; the device is the host
            self.stats["host_bytes"] += sum(z for _, z, _ in parts)
            self.stats["host_copies"] += 1
            return out
        total = sum(z for _, z, _ in parts)
        pinned = self._slot(total)
        out, at = [], 0
        for s, z, shape in parts:
            pinned[at:at + z].copy_(src[s:s + z])
            out.append((at, z, shape))
            at += z
        self.stats["host_bytes"] += total
        self.stats["host_copies"] += 1
        dev = torch.empty(total, dtype=torch.uint8, device=self.device)
        with torch.cuda.stream(self.stream):
            dev.copy_(pinned[:total], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.events[self._current] = event
        torch.cuda.current_stream(self.device).wait_event(event)  # the training stream waits on the GPU only
        dev.record_stream(self.stream)  # allocated on the training stream, written on the side stream
        self.stats["device_bytes"] += total
        return tuple(dev[a:a + z].view(dtype).view(shape) for a, z, shape in out)
