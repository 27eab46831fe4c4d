"""Store reads overlapped with compute (`train.producers.read_ahead`): the reader thread of `RemoteFeatures` keeps at
most D objects read ahead, the host holds D slots (D + 1 on CPU), training through it equals the serial path bit for bit,
failures under both policies are exact or stop every rank, and the feed position stays exact with the next step
pulled early (`regen.train.lookahead`)."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import test_host_memory
import torch

from regen.train.features.contract import FeatureContractError, FeatureSpec, encode, make_header

SPEC = FeatureSpec("regen/test", (1, 3, 5), "prefix", "float32", 16, 8, "rev-a")
PRODUCER = {"id": "p0", "engine": "transformers", "engine_version": "5.x", "host": "host", "pid": 1}


class IntoStore(test_host_memory.IntoStore):
    """test_host_memory's store reading into registered buffers; each read is also recorded (key, the reader's
    thread name)."""

    def __init__(self, objects):
        super().__init__(objects)
        self.reads = []

    def get_into(self, key, buf, nbytes):
        super().get_into(key, buf, nbytes)
        self.reads.append((key, threading.current_thread().name))


def _objects(shapes, spec=SPEC, features=None):
    """{str((epoch, index)): object bytes}, [MicroBatch-like] for `shapes` [[(B, S) per micro-batch] per step];
    `features(mb)` -> (taps, last) gives the tensors (random by default)."""
    objects, mbs = {}, []
    for step, row in enumerate(shapes):
        for i, (B, S) in enumerate(row):
            g = torch.Generator().manual_seed(10 * step + i)
            ids, mask = torch.randint(3, 500, (B, S), generator=g), torch.ones(B, S, dtype=torch.bool)
            mb = SimpleNamespace(epoch=step, index=i, input_ids=ids, attention_mask=mask,
                                 sample_ids=[f"s{step}-{i}-{k}" for k in range(B)])
            taps, last = features(mb) if features else (torch.randn(B, S, 48), torch.randn(B, S, 16))
            h = make_header(spec, epoch=step, index=i, attempt=0, sample_ids=mb.sample_ids, input_ids=ids,
                            attention_mask=mask, producer=PRODUCER, stream_reading="test")
            objects[str((step, i))] = b"".join(bytes(p) for p in encode(h, taps, last)[0])
            mbs.append(mb)
    return objects, mbs


def _dispatcher(monkeypatch, objects, failed=(), other=None):
    """The dispatcher's answers: ready, `failed` keys failed on every attempt, `other` {key: the key whose object
    the store holds for it}; every /wait recorded in order."""
    from regen.train.features import client as client_mod

    waits = []

    def post(url, path, body, timeout_s=None):
        key = (body["epoch"], body["index"])
        if path != "/wait":
            return {}
        waits.append(key)
        if key in failed:
            return {"status": "failed", "reason": "longer than this producer's max_len 40"}
        held = str((other or {}).get(key, key))
        return {"status": "ready", "key": held, "nbytes": len(objects[held])}

    monkeypatch.setattr(client_mod, "post", post)
    return waits


def _remote(store, read_ahead, on_failure="error", spec=SPEC):
    from regen.train.features.client import RemoteFeatures

    return RemoteFeatures("http://test", store, spec, SimpleNamespace(device="cpu"), "cpu", read_ahead=read_ahead,
                          on_failure=on_failure, poll_s=0.2)


def _wait_until(pred, what, timeout_s=10.0):
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.mark.parametrize("device_branch", ["cpu", "cuda"])
@pytest.mark.parametrize("depth", [1, 2])
def test_the_reader_keeps_depth_objects_ahead_across_steps_in_depth_plus_one_host_slots(monkeypatch, depth,
                                                                                         device_branch):
    """Three steps of 4 micro-batches submitted as the loop does (the next step while this one computes): the
    reader thread reads every object once, in training order, never more than `depth` ahead of the micro-batch
    computing (so the store's budget is not held by objects read early), and reads the next step's first objects
    while the last ones of this step compute; the host slots are depth (CUDA branch, the recorded ops: the next
    object's copy issued once it is staged, its slot reused after it) or depth + 1 (CPU: the slot is the object's
    memory until released) of at most the largest object, within `host_staging_bytes(read_ahead=depth)`;
    the features handed over are the objects' bytes; at most 2 objects resident."""
    from test_host_memory import CountingOps

    from regen.train.features.staging import Staging
    from regen.train.memory import host_staging_bytes, largest_object_bytes

    shapes = [[(1, 5), (2, 6), (1, 8), (2, 3)], [(2, 7), (1, 8), (2, 8), (1, 2)], [(2, 8)] * 4]
    objects, mbs = _objects(shapes)
    waits = _dispatcher(monkeypatch, objects)
    store = IntoStore(objects)
    remote = _remote(store, depth)
    ops = CountingOps() if device_branch == "cuda" else None
    remote.staging = staging = Staging("cpu", ops=ops, register=store.register, unregister=store.unregister)
    order = [(mb.epoch, mb.index) for mb in mbs]
    remote.submit(mbs[:4])
    for n, key in enumerate(order):
        if n % 4 == 0 and n + 4 < len(order):
            remote.submit(mbs[n + 4:n + 8])  # the loop's pull of the next step, at this step's start
        taps, last = remote.features_of({"key": key})
        want = min(n + depth, len(order) - 1)
        _wait_until(lambda: len(store.reads) > want, f"the reader to reach {order[want]}")
        time.sleep(0.02)  # it would go further now if it were not bounded
        assert len(store.reads) == want + 1 and waits == order[:want + 1], (n, waits)
        B, S = mbs[n].input_ids.shape
        assert taps.shape == (B, S, 48) and last.shape == (B, S, 16)
        remote.release({"key": key})
    assert [k for k, _ in store.reads] == [str(k) for k in order]
    assert {t for _, t in store.reads} == {"feature-reader"}  # read in the reader thread, not in compute
    cfg = SimpleNamespace(target_layer_ids=SPEC.target_layer_ids, target_hidden_size=SPEC.target_hidden_size)
    gpu = ops is not None
    want = host_staging_bytes(cfg, tokens=16, grad_accum=4, max_batch=2, feature_bytes=4, read_ahead=depth, gpu=gpu)
    slots = depth if gpu else depth + 1  # GPU: a slot is read into again once its object's device copy is done
    largest = largest_object_bytes(cfg, tokens=16, max_batch=2, feature_bytes=4)
    assert want == slots * largest
    # the plan is the bound: never more host bytes than it states; whether every slot regrows to the largest
    # object depends on which slot is free when the large objects come (the reader's timing against compute)
    assert len(staging.host) == slots and largest <= staging.stats["host_slot_bytes_max"] <= want, staging.stats
    live = sum(h["buf"].numel() for h in staging.host)  # the slots' bytes now: registered, and pinned on CUDA
    assert sum(store.registered.values()) == live == staging.stats["host_slot_bytes"] and staging.stats["resident_max"] <= 2
    if ops is not None:
        assert staging.stats["pinned_bytes"] == sum(ops.pinned_now.values()) == live
    assert remote.stats["objects"] == 12 and remote.stats["stall_s"] >= 0
    remote.close()
    assert not store.registered and not remote._thread.is_alive()


def test_a_read_error_is_handed_over_as_a_breach_and_zeros_for_the_rest(monkeypatch):
    """The store answers another micro-batch's object for 0:1 (a broken contract): the reader stops there; 0:0 is
    handed over as read, 0:1 and 0:2 as zeros of their shapes, each lost and a breach; `take_error` gives the
    contract error itself (what `FeaturePool.raise_if_failed` raises on every rank), once."""
    objects, mbs = _objects([[(1, 5), (2, 6), (1, 4)]])
    _dispatcher(monkeypatch, objects, other={(0, 1): (0, 0)})
    remote = _remote(IntoStore(objects), 2)
    remote.submit(mbs)
    t, _ = remote.features_of({"key": (0, 0)})
    assert t.abs().sum() > 0 and remote.lost({"key": (0, 0)}) is None
    for i in (1, 2):
        t, h = remote.features_of({"key": (0, i)})
        assert t.shape == (mbs[i].input_ids.shape[0], mbs[i].input_ids.shape[1], 48) and not t.any() and not h.any()
        assert "was not read: FeatureContractError" in remote.lost({"key": (0, i)})
    assert set(remote.take_breaches()) == {(0, 1), (0, 2)}
    err = remote.take_error()
    assert isinstance(err, FeatureContractError) and "index: the object declares 0, the trainer expects 1" in str(err)
    assert remote.take_error() is None
    with pytest.raises(RuntimeError, match="were not submitted"):
        remote.features_of({"key": (0, 7)})
    remote.close()


# -- training through the reader equals the serial path ---------------------------------------------------------

@pytest.fixture(scope="module")
def dist_info():
    from regen.train.parallel import init_distributed

    info = init_distributed("cpu")
    yield info
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def target(tiny_target):
    from regen.train.target import TargetContract, TargetFeatures

    return TargetFeatures.from_pretrained(tiny_target, TargetContract((0, 1, 2)))


def _build(target, info, sgd):
    from regen.train.model import DSparkDraft, small_config_for_target
    from regen.train.parallel import shard_model
    from regen.train.step import make_objective

    torch.manual_seed(0)
    cfg = small_config_for_target(target.config, target_layer_ids=(0, 1, 2), markov_rank=16, num_anchors=6)
    draft = DSparkDraft.from_target(target.model, cfg)
    model = shard_model(make_objective(draft), info, blocks=draft.layers)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.5) if sgd else torch.optim.AdamW(trainable, lr=1e-2, betas=(0.9, 0.95))
    return model, opt


def _steps(run_dir, n_steps, grad_accum=3):
    from regen.train.feed import FeedConfig, ShardFeed

    feed = ShardFeed(run_dir / "shards", FeedConfig(max_len=64, max_tokens=256, max_batch=3, min_loss_tokens=4,
                                                    shuffle_buffer=8, bucket_window=8), grad_accum=grad_accum)
    return [s.microbatches for s in list(feed.steps())[:n_steps]]


def _train(target, info, steps, remote, *, read_ahead, zero=(), sgd=False, normalization="step"):
    """`steps` trained through `remote`: serial (`fetch` then `zero` keys zeroed, as the loop does) or read ahead
    (the next step submitted while this one trains). Returns (params, [train_step metrics])."""
    from regen.train.parallel import full_model_state
    from regen.train.step import prepare_microbatch, train_step, zero_loss

    model, opt = _build(target, info, sgd)
    out = []
    if read_ahead:
        remote.submit(steps[0])
    for n, step in enumerate(steps):
        mbs = [prepare_microbatch(mb, 0, model.config, torch.device("cpu")) for mb in step]
        if read_ahead and n + 1 < len(steps):
            remote.submit(steps[n + 1])
        elif not read_ahead:
            remote.fetch(step)
            for b, _, _ in mbs:
                if b["key"] in zero:
                    zero_loss(b)
        out.append(train_step(model, remote, opt, mbs, grad_clip=1.0, loss_normalization=normalization))
    return {k: v.clone() for k, v in full_model_state(model).items()}, out


def _tiny_objects(target, steps):
    spec = FeatureSpec("regen/test", (0, 1, 2), "prefix", "float32", target.config.hidden_size,
                       target.config.num_hidden_layers, "rev-a")
    objects = {}
    for step in steps:
        for mb in step:
            taps, last = target.features(mb.input_ids, mb.attention_mask)
            h = make_header(spec, epoch=mb.epoch, index=mb.index, attempt=0, sample_ids=mb.sample_ids,
                            input_ids=mb.input_ids, attention_mask=mb.attention_mask, producer=PRODUCER,
                            stream_reading="test")
            objects[str((mb.epoch, mb.index))] = b"".join(bytes(p) for p in encode(h, taps, last)[0])
    return spec, objects


def test_training_through_the_reader_equals_the_serial_path_bit_for_bit(tiny_run, target, dist_info, monkeypatch):
    """Two steps of 3 micro-batches, AdamW: the draft trained with read_ahead 2 (the store's reads on the reader
    thread, the next step submitted early) equals the one trained with every object read before its step, every
    weight bit for bit, the same losses; and both equal features computed in process."""
    from regen.train.parallel import full_model_state
    from regen.train.step import prepare_microbatch, train_step

    steps = _steps(tiny_run[1], 2)
    spec, objects = _tiny_objects(target, steps)
    _dispatcher(monkeypatch, objects)
    serial, m_serial = _train(target, dist_info, steps, _remote(IntoStore(objects), 0, spec=spec), read_ahead=0)
    remote = _remote(IntoStore(objects), 2, spec=spec)
    overlap, m_overlap = _train(target, dist_info, steps, remote, read_ahead=2)
    assert remote.stats["objects"] == 6 and remote.store.reads and {t for _, t in remote.store.reads} == {
        "feature-reader"}
    remote.close()
    assert serial.keys() == overlap.keys()
    for k in serial:
        assert torch.equal(serial[k], overlap[k]), k
    assert [m["sums"].tolist() for m in m_serial] == [m["sums"].tolist() for m in m_overlap]
    model, opt = _build(target, dist_info, False)  # in process: the same
    for step in steps:
        train_step(model, target, opt, [prepare_microbatch(mb, 0, model.config, torch.device("cpu")) for mb in step])
    inproc = full_model_state(model)
    assert all(torch.equal(inproc[k], serial[k]) for k in serial)


@pytest.mark.parametrize("normalization", ["step", "micro_batch"])
def test_a_failure_read_ahead_under_zero_loss_trains_as_the_serial_path(tiny_run, target, dist_info, monkeypatch,
                                                                         normalization):
    """Micro-batch 0:2 (the last of the first step, after the step's weights were agreed and two micro-batches
    trained) fails on every attempt, `on_failure: zero_loss`: read ahead, it is handed over as zeros, trained with a
    zeroed loss mask and its weight taken out of the step's (step: one factor after the backward; micro_batch: its
    own divisor agreed before its loss). SGD, two steps: the weights equal the serial path's (which zeroes it
    before the step) within rounding, the reported weight is the serial one, the failure is counted as zeroed."""
    steps = _steps(tiny_run[1], 2)
    spec, objects = _tiny_objects(target, steps)
    lost = (steps[0][2].epoch, steps[0][2].index)
    _dispatcher(monkeypatch, objects, failed={lost})
    kw = dict(sgd=True, normalization=normalization)
    serial, m_serial = _train(target, dist_info, steps, _remote(IntoStore(objects), 0, spec=spec), read_ahead=0,
                              zero={lost}, **kw)
    remote = _remote(IntoStore(objects), 2, on_failure="zero_loss", spec=spec)
    overlap, m_overlap = _train(target, dist_info, steps, remote, read_ahead=2, **kw)
    assert [z["index"] for z in remote.zeroed] == [lost[1]] and not remote.take_breaches()
    assert remote.take_error() is None
    remote.close()
    assert all(m["finite"] for m in m_overlap)
    assert m_overlap[0]["weight"] == pytest.approx(m_serial[0]["weight"], rel=1e-12)
    for a, b in zip(m_serial, m_overlap):
        torch.testing.assert_close(a["sums"], b["sums"], rtol=1e-6, atol=1e-9)
    for k in serial:
        torch.testing.assert_close(overlap[k], serial[k], rtol=1e-5, atol=1e-7, msg=k)
    # the weight taken out: without the failure the step weighs more (what the provisional denominators used)
    _dispatcher(monkeypatch, objects)
    _, m_clean = _train(target, dist_info, steps[:1], _remote(IntoStore(objects), 0, spec=spec), read_ahead=0, **kw)
    assert m_clean[0]["weight"] > m_overlap[0]["weight"] * 1.05
    assert m_clean[0]["sums"][0].item() != pytest.approx(m_overlap[0]["sums"][0].item(), rel=1e-3)


def test_a_failure_read_ahead_under_error_stops_the_step_naming_it(tiny_run, target, dist_info, monkeypatch):
    """`on_failure: error`: the failure met by the reader mid-step makes the step non-finite on this rank (the
    breach path, agreed with the other ranks), no optimizer step is applied, and `take_error` gives the serial
    path's InputError (the rows, the reason, the fix)."""
    from regen.errors import InputError
    from regen.train.parallel import full_model_state

    steps = _steps(tiny_run[1], 1)
    spec, objects = _tiny_objects(target, steps)
    lost = (steps[0][1].epoch, steps[0][1].index)
    _dispatcher(monkeypatch, objects, failed={lost})
    remote = _remote(IntoStore(objects), 2, on_failure="error", spec=spec)
    before = {k: v.clone() for k, v in full_model_state(_build(target, dist_info, False)[0]).items()}
    after, (m,) = _train(target, dist_info, steps, remote, read_ahead=2)
    assert not m["finite"] and m["bad_microbatches"] == [1]
    assert "failed on every attempt: longer than this producer's max_len 40" in m["feature_breaches"][0]
    err = remote.take_error()
    assert isinstance(err, InputError) and "train.producers.on_failure=zero_loss" in str(err)
    assert ", ".join(steps[0][1].sample_ids) in str(err) and not remote.zeroed
    remote.close()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the optimizer step was not applied


# -- the feed position with the next step pulled early ------------------------------------------------------------

def test_the_feed_position_is_the_last_step_taken_while_the_next_is_pulled(tiny_run):
    """`StepLookahead` over a feed of 2 epochs: after each `take` and an early `pull_next` of the step after it, the
    position is the one after the step taken (a feed resumed from it yields exactly the pulled step next), across
    the epoch boundary; the pulled step is handed to `on_pulled` before `take` returns it; an error of the pull is
    raised by the `take` that meets it."""
    from regen.train.feed import FeedConfig, ShardFeed
    from regen.train.lookahead import StepLookahead

    def feed():
        return ShardFeed(tiny_run[1] / "shards", FeedConfig(max_len=64, max_tokens=256, max_batch=3,
                                                            min_loss_tokens=4), grad_accum=2)

    reference = [[mb.sample_ids for mb in s.microbatches] for s in feed().steps(2)]
    per_epoch = feed().count_steps(1)
    assert per_epoch >= 2 and len(reference) == 2 * per_epoch
    look, pulled, got = StepLookahead(feed(), 2), [], []
    while True:
        step = look.take()
        if step is None:
            break
        got.append([mb.sample_ids for mb in step.microbatches])
        assert not pulled or pulled[-1] is step  # handed over (submitted) before it is trained
        look.pull_next(pulled.append)
        resumed = feed()
        resumed.load_state_dict(look.state_dict())
        nxt = next(resumed.steps(2), None)
        want = reference[len(got)] if len(got) < len(reference) else None
        assert (nxt and [mb.sample_ids for mb in nxt.microbatches]) == want, len(got)
    assert got == reference

    class Bad:
        def steps(self, num_epochs):
            yield SimpleNamespace(microbatches=[])
            raise ValueError("shard x.parquet: bad row 3")

        def state_dict(self):
            return {"epoch": 0}

    look = StepLookahead(Bad(), 1)
    assert look.take() is not None
    look.pull_next()
    with pytest.raises(ValueError, match="bad row 3"):
        look.take()
