"""Host memory of the producers' client: exact page-locked slots, and `regen plan`'s host figure equal to what the
staging allocates (`regen.train.features.staging`, `regen.train.memory.host_memory_bytes`)."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from regen.train.features.contract import FeatureSpec, encode, make_header

SPEC = FeatureSpec("regen/test", (1, 3, 5), "prefix", "float32", 16, 8, "rev-a")
PRODUCER = {"id": "p0-host-1", "engine": "transformers", "engine_version": "5.x", "host": "host", "pid": 1}


class FakeCudart:
    """`torch.cuda.cudart()`'s two calls, recorded; `fail` makes the registration return cudaErrorMemoryAllocation."""

    def __init__(self, fail: bool = False):
        self.registered, self.calls, self.fail = {}, [], fail

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, size, flags))
        if self.fail:
            return 2
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0 if self.registered.pop(ptr, None) is not None else 1


def test_a_slot_is_one_exact_allocation_page_locked_by_hand():
    """`pin_host` allocates exactly the bytes asked (5.25 GiB would be 8 GiB through `pin_memory=True`'s
    power-of-two blocks), registers that very range, portable; `unpin_host` unregisters it; a refusal names the
    size and what to lower."""
    from regen.train.features.staging import CUDA_HOST_REGISTER_PORTABLE, pin_host, unpin_host

    rt = FakeCudart()
    n = 3 * 4096 + 17  # not a power of two
    buf = pin_host(n, cudart=rt)
    assert buf.dtype == torch.uint8 and buf.numel() == n and not buf.is_pinned()
    assert rt.calls == [("register", buf.data_ptr(), n, CUDA_HOST_REGISTER_PORTABLE)] and CUDA_HOST_REGISTER_PORTABLE == 1
    unpin_host(buf, cudart=rt)
    assert rt.calls[-1] == ("unregister", buf.data_ptr()) and not rt.registered
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of a 12,305-byte .*train.grad_accum"):
        pin_host(n, cudart=FakeCudart(fail=True))
    with pytest.raises(RuntimeError, match="cudaHostUnregister"):
        unpin_host(buf, cudart=rt)  # not registered (any more)


class CountingOps:
    """`staging._CudaOps` on CPU with exact slots as `pin_host` makes them: every buffer pinned / unpinned counted."""

    def __init__(self):
        self.pinned_now, self.pins, self.unpins = {}, [], []

    def pinned(self, nbytes):
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned_now[buf.data_ptr()] = nbytes
        self.pins.append(nbytes)
        return buf

    def unpin(self, buf):
        self.unpins.append(self.pinned_now.pop(buf.data_ptr()))

    def device_buffer(self, nbytes):
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy_async(self, dst, src):
        dst.copy_(src)
        return object()

    def side_wait(self, event):
        pass

    def train_wait(self, event, dev):
        pass

    def train_event(self):
        return object()

    def host_wait(self, event):
        pass

    def on_copy_stream(self):
        return contextlib.nullcontext()


class IntoStore:
    """A store that reads into registered buffers (`StoreClient.get_into`'s contract) from a dict of objects."""

    def __init__(self, objects):
        self.objects, self.registered = objects, {}

    def register(self, buf):
        self.registered[buf.data_ptr()] = buf.numel()

    def unregister(self, buf):
        del self.registered[buf.data_ptr()]

    def size(self, key):
        return len(self.objects[key])

    def get_into(self, key, buf, nbytes):
        assert self.registered.get(buf.data_ptr()) == buf.numel() >= nbytes == len(self.objects[key])
        buf[:nbytes].copy_(torch.frombuffer(bytearray(self.objects[key]), dtype=torch.uint8))


@pytest.mark.parametrize("device_branch", ["cuda", "cpu"])
def test_the_plans_host_figure_is_what_the_slots_allocate(monkeypatch, device_branch):
    """Three steps of grad_accum = 4 micro-batches through the real `RemoteFeatures` and `Staging` (a store reading
    into registered slots, as Mooncake's `get_into`): micro-batches of 1 or 2 rows of varying length, the third step
    all of the largest size (max_batch = 2 rows x 8 tokens = train.max_tokens 16). Slots grow to the largest object
    and never beyond it: what is page-locked (CUDA branch: `pinned_bytes`, the ops' live buffers) and what the slots
    hold (`host_slot_bytes_max`, either branch) equal `host_staging_bytes`, byte for byte; every pinned buffer is
    one object's exact size (no power-of-two rounding), and every regrown slot was unpinned and unregistered first."""
    from regen.train.features import client as client_mod
    from regen.train.features.client import RemoteFeatures
    from regen.train.features.staging import Staging
    from regen.train.memory import host_staging_bytes, largest_object_bytes

    grad_accum, max_batch, max_tokens = 4, 2, 16
    shapes = [[(1, 5), (2, 6), (1, 8), (2, 3)], [(2, 7), (1, 8), (2, 8), (1, 2)], [(2, 8)] * 4]
    objects, mbs = {}, []
    for step, row in enumerate(shapes):
        for i, (B, S) in enumerate(row):
            g = torch.Generator().manual_seed(10 * step + i)
            ids, mask = torch.randint(3, 500, (B, S), generator=g), torch.ones(B, S, dtype=torch.bool)
            names = [f"s{k}" for k in range(B)]
            h = make_header(SPEC, epoch=step, index=i, attempt=0, sample_ids=names, input_ids=ids,
                            attention_mask=mask, producer=PRODUCER, stream_reading="test")
            objects[str((step, i))] = b"".join(bytes(p) for p in encode(h, torch.randn(B, S, 48),
                                                                       torch.randn(B, S, 16))[0])
            mbs.append(SimpleNamespace(epoch=step, index=i, input_ids=ids, attention_mask=mask, sample_ids=names))

    def post(url, path, body, timeout_s=None):
        key = str((body["epoch"], body["index"]))
        return {"status": "ready", "key": key, "nbytes": len(objects[key])} if path == "/wait" else {}

    monkeypatch.setattr(client_mod, "post", post)
    store = IntoStore(objects)
    remote = RemoteFeatures("http://test", store, SPEC, SimpleNamespace(device="cpu"), "cpu")
    ops = CountingOps() if device_branch == "cuda" else None
    remote.staging = staging = Staging("cpu", ops=ops, register=store.register, unregister=store.unregister)
    for step in range(3):
        remote.fetch(mbs[4 * step:4 * step + 4])
        for i in range(4):
            remote.features_of({"key": (step, i)})
            remote.release({"key": (step, i)})

    cfg = SimpleNamespace(target_layer_ids=SPEC.target_layer_ids, target_hidden_size=SPEC.target_hidden_size)
    want = host_staging_bytes(cfg, tokens=max_tokens, grad_accum=grad_accum, max_batch=max_batch, feature_bytes=4)
    largest = largest_object_bytes(cfg, tokens=max_tokens, max_batch=max_batch, feature_bytes=4)
    assert largest == max(len(o) for o in objects.values()) and want == grad_accum * largest
    st = staging.stats
    assert len(staging.host) == grad_accum and sum(h["buf"].numel() for h in staging.host) == want
    assert st["host_slot_bytes"] == st["host_slot_bytes_max"] == want
    assert sum(store.registered.values()) == want  # the store has exactly the live slots registered
    if ops is not None:
        assert st["pinned_bytes"] == sum(ops.pinned_now.values()) == want
        sizes = {len(o) for o in objects.values()}
        assert set(ops.pins) <= sizes and len(ops.unpins) == len(ops.pins) - grad_accum > 0
        assert all(n & (n - 1) for n in ops.pins)  # none of them a power of two
    else:
        assert st["pinned_bytes"] == 0  # CPU: nothing to page-lock, the slots are the objects' memory
    staging.close()
    assert not store.registered and st["host_slot_bytes"] == st["pinned_bytes"] == 0
    if ops is not None:
        assert not ops.pinned_now


def test_the_kimi_k3_plan_states_its_host_memory_and_the_gb200_tray():
    """`regen plan` for kimi-k3 at W = 8: per GPU the exact slots (train.producers.read_ahead 2: 2 slots, 10.5 GiB;
    read_ahead 0: a step's 16, 84.0 GiB, not the 128 GiB of power-of-two pinned blocks), the store segment
    (256 GiB / 8 + one object) and the transfer buffer (2 objects); 4 ranks of a GB200 tray take 250 GB (read-ahead)
    or 566 GB (serial) of its 960 GB (NVIDIA: up to 480 GB LPDDR5X per Grace, 2 per tray): both hold."""
    from regen.config import load_profile
    from regen.report.plan import assumptions, draft_plan

    obj = 16 + 4096 + 256 + 65536 * 6 * 7168 * 2
    rest = 256 * 2**30 // 8 + obj + 2 * obj
    for sets, slots, gib, total_gib, share in (([], 2, 10.5, 58.25, (0.25, 0.27)),
                                               (["train.producers.read_ahead=0"], 16, 84.0, 131.75, (0.58, 0.6))):
        profile = load_profile("kimi-k3", sets)
        d = draft_plan(profile, assumptions(profile, {}) | {"world_size": 8}, 1e9)
        host = d["host_memory_per_gpu_bytes"]
        assert host == {"feature_staging": slots * obj, "store_segment": 256 * 2**30 // 8 + obj,
                        "transfer_buffer": 2 * obj, "total": slots * obj + rest}, sets
        assert d["host_memory_per_gpu_gib"]["feature_staging"] == gib
        assert d["host_memory_per_gpu_gib"]["total"] == total_gib
        assert d["host_memory_formulas"]["feature_staging"].startswith(f"{slots} slot(s) x the largest object")
        tray = d["host_tray"]
        assert tray["ranks"] == 4 and tray["bytes"] == 4 * host["total"] and tray["tray_bytes"] == 960 * 10**9
        assert tray["holds"] and share[0] < tray["share"] < share[1] and "holds" in tray["holds_text"]
    # the serial path with pinned_memory's power-of-two blocks (8 GiB a slot) would have taken 128 GiB of slots
    assert 16 * (1 << (obj - 1).bit_length()) == 128 * 2**30
