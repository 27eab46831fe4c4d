"""The feature object: layout round trip, and every contract field checked by the consumer."""
from __future__ import annotations

import json
import struct

import pytest
import torch

from regen.train.features.contract import (
    FeatureContractError,
    FeatureSpec,
    check_header,
    check_values,
    decode,
    encode,
    layer_ids_in,
    make_header,
    object_nbytes,
    read_header,
)

SPEC = FeatureSpec("regen/test", (1, 3, 5), "prefix", "float32", 16, 8, "rev-a")
PRODUCER = {"id": "p0-host-1", "engine": "transformers", "engine_version": "5.x", "host": "host", "pid": 1}


def _batch(B=2, S=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, 5:] = False
    return ids, mask


def _object(spec=SPEC, **over):
    """(object bytes, size, ids, mask, taps, last); `over` rewrites header fields after encoding, as a producer of
    another engine or settings would have written them."""
    ids, mask = _batch()
    header = make_header(spec, epoch=1, index=4, attempt=0, sample_ids=["a", "b"], input_ids=ids,
                         attention_mask=mask, producer=PRODUCER, stream_reading="test")
    dt = getattr(torch, spec.dtype)
    taps = torch.randn(2, 7, spec.num_taps * spec.target_hidden_size).to(dt)
    last = torch.randn(2, 7, spec.target_hidden_size).to(dt)
    parts, n = encode(header, taps, last)
    blob = b"".join(bytes(p) for p in parts)
    if over:
        h = {**read_header(blob), **over}
        text = json.dumps(h).encode()
        reserve = h["tensors"]["taps"]["offset"] - 16
        blob = struct.pack("<8sQ", b"RGNFEAT1", len(text)) + text + bytes(reserve - len(text)) + blob[16 + reserve:]
    return blob, n, ids, mask, taps, last


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_exact_and_sized_in_advance(dtype):
    spec = FeatureSpec("regen/test", (1, 3, 5), "prefix", dtype, 16, 8, "rev-a")
    blob, n, ids, mask, taps, last = _object(spec)
    assert len(blob) == n == object_nbytes(2, 7, spec)  # the budget counts exactly what is stored
    header = read_header(blob)
    check_header(header, spec, epoch=1, index=4, input_ids=ids, attention_mask=mask)
    t, h = decode(bytearray(blob), header)
    assert torch.equal(t, taps) and torch.equal(h, last) and t.dtype == getattr(torch, dtype)


@pytest.mark.parametrize("field,value,expect", [
    ("namespace", "regen/other", "namespace"),
    ("epoch", 2, "epoch"),
    ("index", 5, "index"),
    ("layer_ids", [1, 3, 6], "layer_ids"),  # a tap off by one (TorchSpec #87)
    ("layer_id_convention", "vllm_capture", "layer_ids"),  # vLLM ids without the shift
    ("layer_id_convention", "sglang", "layer_id_convention"),
    ("aux_hidden_stream", "attn_res", "aux_hidden_stream"),  # right shape, wrong stream
    ("last_hidden_norm", "unknown", "last_hidden_norm"),
    ("dtype", "bfloat16", "dtype"),
    ("target_hidden_size", 32, "target_hidden_size"),
    ("target_num_hidden_layers", 9, "target_num_hidden_layers"),
    ("target_revision", "rev-b", "target_revision"),
    ("producer", {}, "producer"),
])
def test_every_contract_field_is_checked(field, value, expect):
    blob, _, ids, mask, _, _ = _object(**{field: value})
    with pytest.raises(FeatureContractError, match=rf"{expect}.*restart the producer") as err:
        check_header(read_header(blob), SPEC, epoch=1, index=4, input_ids=ids, attention_mask=mask)
    assert "micro-batch 1:4" in str(err.value) and ("p0-host-1" in str(err.value) or field == "producer")


def test_other_tokens_or_padding_are_caught():
    blob, _, ids, mask, _, _ = _object()
    header = read_header(blob)
    other = ids.clone()
    other[0, 3] += 1
    with pytest.raises(FeatureContractError, match="tokens_sha256"):
        check_header(header, SPEC, epoch=1, index=4, input_ids=other, attention_mask=mask)
    with pytest.raises(FeatureContractError, match="tokens_sha256"):
        check_header(header, SPEC, epoch=1, index=4, input_ids=ids, attention_mask=torch.ones_like(mask))


def test_vllm_capture_ids_are_shifted_and_end_with_the_last_layer():
    assert layer_ids_in("vllm_capture", (1, 3, 5), 8) == [2, 4, 6, 8]
    ids, mask = _batch()
    header = make_header(SPEC, epoch=1, index=4, attempt=0, sample_ids=["a", "b"], input_ids=ids, attention_mask=mask,
                         producer=PRODUCER, stream_reading="vllm", last_hidden_norm="pre_final_norm",
                         layer_id_convention="vllm_capture")
    taps, last = torch.zeros(2, 7, 48), torch.zeros(2, 7, 16)
    parts, _ = encode(header, taps, last)
    check_header(read_header(b"".join(bytes(p) for p in parts)), SPEC, epoch=1, index=4, input_ids=ids,
                 attention_mask=mask)


def test_foreign_and_cut_objects_are_refused():
    blob, *_ = _object()
    with pytest.raises(FeatureContractError, match="magic"):
        read_header(b"X" * 64)
    with pytest.raises(FeatureContractError, match="bytes, its header says"):
        read_header(blob[:-1])
    h = read_header(blob)
    with pytest.raises(FeatureContractError, match="lies outside the object's"):  # one bounds check for all readers
        decode(blob[:-1], h)


@pytest.mark.parametrize("tensor,value,row,pos", [("taps", float("nan"), 1, 3), ("last_hidden", float("inf"), 0, 6),
                                                  ("taps", float("-inf"), 1, 6)])  # (1, 6) is padding: refused too
def test_non_finite_feature_values_are_a_contract_breach(tensor, value, row, pos):
    blob, _, ids, mask, taps, last = _object()
    header = read_header(blob)
    t, last = decode(blob, header)
    check_values(header, t, last, epoch=1, index=4)  # finite: passes
    (t if tensor == "taps" else last)[row, pos, 2] = value
    with pytest.raises(FeatureContractError) as e:
        check_values(header, t, last, epoch=1, index=4)
    msg = str(e.value)
    assert f"{tensor} holds 1 non-finite values, the first at row {row} ({'ab'[row]}), position {pos}" in msg
    assert "micro-batch 1:4" in msg and PRODUCER["id"] in msg


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_staging_hands_the_decoded_tensors_with_one_host_copy(dtype):
    """The trainer's path into the device (`regen.train.features.staging`): on CPU one copy out of the store's
    buffer into a host slot, equal to `decode`; the buffer may be released right after; the slot is not reused
    while the loss holds its tensors; a cut object is refused."""
    from regen.train.features.staging import Staging

    spec = FeatureSpec("regen/test", (1, 3, 5), "prefix", dtype, 16, 8, "rev-a")
    blob, n, ids, mask, taps, last = _object(spec)
    buf = bytearray(blob)
    staging = Staging("cpu")
    first = staging.stage(buf, read_header(blob), (1, 4))
    buf[:] = bytes(len(buf))  # the store's buffer reused for the next object
    second = staging.stage(bytearray(blob), read_header(blob), (1, 5))
    t, h = staging.ready(first)
    assert torch.equal(t, taps) and torch.equal(h, last) and first.slot != second.slot
    staging.release(first)
    third = staging.stage(bytearray(blob), read_header(blob), (1, 6))  # the released slot, not a new one
    assert third.slot == first.slot and len(staging.host) == 2
    assert staging.stats == {"objects": 3, "host_bytes": 3 * (taps.nbytes + last.nbytes), "host_copies": 3,
                             "store_reads_into_slots": 0, "device_bytes": 0, "device_copies": 0, "pinned_bytes": 0, "resident": 0,
                             "resident_max": 1, "extra_device_buffers": 0,
                             "host_slot_bytes": 2 * (taps.nbytes + last.nbytes),
                             "host_slot_bytes_max": 2 * (taps.nbytes + last.nbytes)}
    with pytest.raises(FeatureContractError, match="lies outside"):
        staging.stage(bytearray(blob[:-8]), read_header(blob))


class RecordingOps:
    """`staging._CudaOps` on CPU: the same buffers and copies, each call recorded in order (the events are names)."""

    def __init__(self):
        self.calls, self.device_buffers = [], 0

    def pinned(self, nbytes):
        self.calls.append(("pinned", nbytes))
        return torch.empty(nbytes, dtype=torch.uint8)

    def unpin(self, buf):
        self.calls.append(("unpin", buf.numel()))

    def device_buffer(self, nbytes):
        self.device_buffers += 1
        self.calls.append(("device_buffer", nbytes))
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy_async(self, dst, src):
        dst.copy_(src)
        self.calls.append(("copy", f"copied{len(self.calls)}"))
        return self.calls[-1][1]

    def side_wait(self, event):
        self.calls.append(("side_wait", event))

    def train_wait(self, event, dev):
        self.calls.append(("train_wait", event))

    def train_event(self):
        self.calls.append(("train_event", f"released{len(self.calls)}"))
        return self.calls[-1][1]

    def host_wait(self, event):
        self.calls.append(("host_wait", event))

    def on_copy_stream(self):
        import contextlib

        self.calls.append(("check_on_copy_stream", None))
        return contextlib.nullcontext()


def test_the_cuda_branch_copies_one_ahead_into_two_device_slots_in_stream_order(monkeypatch):
    """The CUDA branch of `Staging` driven by the real `RemoteFeatures` (a dispatcher answering ready, a dict
    store) over two steps of 4 micro-batches, released as `train_step` releases them, its CUDA calls recorded:
    every object's values arrive; two device buffers serve all 8; the copy into a slot waits (side stream) for the
    training stream's release of its last object; the training stream waits for each copy before it is handed
    over; the value check runs on the copy stream; the next copy is issued before the current object is returned
    for compute; a host slot is reused only after its copy finished. A caller that never releases gets a fresh
    buffer, never an overwrite."""
    from types import SimpleNamespace

    from regen.train.features import client as client_mod
    from regen.train.features.client import RemoteFeatures
    from regen.train.features.staging import DEVICE_RESIDENT_OBJECTS, Staging

    ops = RecordingOps()
    objects, tensors, mbs = {}, {}, []
    for step in range(3):
        for i in range(4):
            ids, mask = _batch(seed=4 * step + i)
            h = make_header(SPEC, epoch=step, index=i, attempt=0, sample_ids=["a", "b"], input_ids=ids,
                            attention_mask=mask, producer=PRODUCER, stream_reading="test")
            tensors[(step, i)] = (torch.randn(2, 7, 3 * 16), torch.randn(2, 7, 16))
            parts, _ = encode(h, *tensors[(step, i)])
            objects[str((step, i))] = b"".join(bytes(p) for p in parts)
            mbs.append(SimpleNamespace(epoch=step, index=i, input_ids=ids, attention_mask=mask, sample_ids=["a", "b"]))

    def post(url, path, body, timeout_s=None):
        key = str((body["epoch"], body["index"]))
        return {"status": "ready", "key": key, "nbytes": len(objects[key])} if path == "/wait" else {}

    monkeypatch.setattr(client_mod, "post", post)
    store = SimpleNamespace(get=lambda key: (memoryview(objects[key]), None))
    remote = RemoteFeatures("http://test", store, SPEC, SimpleNamespace(device="cpu"), "cpu")
    remote.staging = staging = Staging("cpu", ops=ops)
    handed = []  # index into ops.calls when each object was returned for compute
    for step in range(2):
        remote.fetch(mbs[4 * step:4 * step + 4])
        for i in range(4):
            t, h = remote.features_of({"key": (step, i)})
            handed.append(len(ops.calls))
            assert torch.equal(t, tensors[(step, i)][0]) and torch.equal(h, tensors[(step, i)][1])
            assert staging.stats["resident"] <= DEVICE_RESIDENT_OBJECTS
            remote.release({"key": (step, i)})
    assert ops.device_buffers == DEVICE_RESIDENT_OBJECTS == staging.stats["resident_max"]
    assert staging.stats["device_copies"] == 8 and staging.stats["host_copies"] == 8
    copies = [c for c in ops.calls if c[0] == "copy"]
    for k in range(2, 8):  # object k goes into object k-2's slot, after the training stream released k-2
        at = ops.calls.index(copies[k])
        waits = [c for c in ops.calls[:at] if c[0] == "side_wait"]
        released = [c[1] for c in ops.calls[:at] if c[0] == "train_event"]
        assert waits and waits[-1][1] == released[k - 2]
        assert ops.calls[at - 1][0] == "side_wait"  # nothing between the wait and the copy it orders
    for k in range(8):
        hand = ops.calls[:handed[k]]
        waited = [i for i, c in enumerate(hand) if c == ("train_wait", copies[k][1])]
        checked = [i for i, c in enumerate(hand) if c[0] == "check_on_copy_stream"]
        assert waited and checked and ops.calls.index(copies[k]) < waited[0] < checked[-1]
        if k % 4 != 3:  # within a step, the next copy is issued before this object goes to compute
            assert ops.calls.index(copies[k + 1]) < handed[k]
    # the second step's stage reused the host slots only after their copies finished
    host_waits = [c[1] for c in ops.calls if c[0] == "host_wait"]
    assert sorted(host_waits) == sorted(c[1] for c in copies[:4])
    assert len(staging.host) == 4 and sum(1 for c in ops.calls if c[0] == "pinned") == 4

    remote.fetch(mbs[8:11])
    views = [remote.features_of({"key": (2, i)}) for i in range(3)]  # never released: no slot is overwritten
    assert staging.stats["extra_device_buffers"] == 1 and staging.stats["resident_max"] == 3
    assert all(torch.equal(v[0], tensors[(2, i)][0]) for i, v in enumerate(views))


class IntoStore:
    """A store that reads into registered buffers (`StoreClient.get_into`'s contract) from a dict of objects."""

    def __init__(self, objects):
        self.objects, self.registered = objects, set()

    def register(self, buf):
        self.registered.add(buf.data_ptr())

    def unregister(self, buf):
        self.registered.discard(buf.data_ptr())

    def size(self, key):
        return len(self.objects[key])

    def get_into(self, key, buf, nbytes):
        assert buf.data_ptr() in self.registered and len(self.objects[key]) == nbytes <= buf.numel()
        buf[:nbytes].copy_(torch.frombuffer(bytearray(self.objects[key]), dtype=torch.uint8))


@pytest.mark.parametrize("defer", [False, True])  # True: the GPU's way, counted on the device, read in take_breaches
@pytest.mark.parametrize("store_kind", ["get", "get_into"])
def test_remote_features_zero_a_failed_micro_batch_and_refuse_non_finite_values_when_handed_over(monkeypatch,
                                                                                                 store_kind, defer):
    """Through `RemoteFeatures` on CPU, with a store read through its buffer (`get`: one copy after it) or straight
    into registered host slots (`get_into`: none): a micro-batch failed on every attempt is a failure of `fetch`
    (known before the step) and is handed over as zeros of its shapes, counted resident like any object; an object
    holding a NaN is recorded with the contract error when it is handed over (its values are checked on the
    device; `train_step` makes the step non-finite on every rank with it); an object of another micro-batch is refused
    in `fetch` and its slot is free again."""
    from types import SimpleNamespace

    from regen.train.features import client as client_mod
    from regen.train.features.client import RemoteFeatures

    mbs, objects = [], {}
    for i in range(3):
        ids, mask = _batch(seed=i)
        h = make_header(SPEC, epoch=0, index=i, attempt=0, sample_ids=["a", "b"], input_ids=ids, attention_mask=mask,
                        producer=PRODUCER, stream_reading="test")
        taps, last = torch.randn(2, 7, 3 * 16), torch.randn(2, 7, 16)
        if i == 2:
            last[1, 3, 5] = float("nan")
        objects[str((0, i))] = b"".join(bytes(p) for p in encode(h, taps, last)[0])
        mbs.append(SimpleNamespace(epoch=0, index=i, input_ids=ids, attention_mask=mask, sample_ids=["a", "b"]))

    def post(url, path, body, timeout_s=None):
        key = str((body["epoch"], body["index"]))
        if path != "/wait":
            return {}
        if body["index"] == 1:
            return {"status": "failed", "reason": "producer crashed 3 times"}
        key = str((0, 0)) if body["index"] == 5 else key
        return {"status": "ready", "key": key, "nbytes": len(objects[key])}

    monkeypatch.setattr(client_mod, "post", post)
    if store_kind == "get":
        store = SimpleNamespace(get=lambda key: (memoryview(objects[key]), None))
    else:
        store = IntoStore(objects)
    remote = RemoteFeatures("http://test", store, SPEC, SimpleNamespace(device="cpu"), "cpu", defer_value_checks=defer)
    failures = remote.fetch(mbs)
    assert [(f.index, f.reason) for f in failures] == [(1, "producer crashed 3 times")]
    st = remote.staging.stats
    assert (st["host_copies"], st["store_reads_into_slots"]) == ((2, 0) if store_kind == "get" else (0, 2))
    t, _ = remote.features_of({"key": (0, 0)})
    assert t.shape == (2, 7, 48) and torch.isfinite(t).all() and t.abs().sum() > 0
    remote.release({"key": (0, 0)})
    t, h = remote.features_of({"key": (0, 1)})
    assert t.shape == (2, 7, 48) and h.shape == (2, 7, 16) and not t.any() and not h.any()
    assert t.dtype == torch.float32 and remote.staging.stats["resident"] == 2  # the zeros and the next object
    remote.release({"key": (0, 1)})
    remote.features_of({"key": (0, 2)})  # recorded, not raised mid-step: the step's flags stop every rank
    (breach,) = remote.take_breaches().items()
    assert breach[0] == (0, 2) and "last_hidden holds 1 non-finite values, the first at row 1" in breach[1]
    remote.release({"key": (0, 2)})
    assert remote.staging.stats["resident_max"] == 2
    remote.close()
    if store_kind == "get_into":  # every slot unregistered before it is freed (Mooncake: "overlapped memory region")
        assert not store.registered and not remote.staging.host
    busy = sum(h["busy"] for h in remote.staging.host)
    with pytest.raises(FeatureContractError, match="index: the object declares 0, the trainer expects 5"):
        remote.fetch([SimpleNamespace(**{**vars(mbs[0]), "index": 5})])  # the store answers 0:0's object for 0:5
    assert sum(h["busy"] for h in remote.staging.host) == busy  # its slot was not kept
