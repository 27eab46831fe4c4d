"""The CUDA path checked on CPU: collectives on their planes with NCCL declared, the step's host
reads counted, bf16 through FSDP2's mixed precision, device resolution, timeouts that let the clear error win."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from regen.errors import InputError
from regen.train import collectives
from regen.train.collectives import CollectiveDeviceError, declare_backend
from regen.train.feed import FeedConfig, ShardFeed
from regen.train.model import DSparkDraft, small_config_for_target
from regen.train.parallel import init_distributed, shard_model
from regen.train.step import make_objective, prepare_microbatch, reduce_metrics, train_step
from regen.train.target import TargetContract, TargetFeatures

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dist_info():
    info = init_distributed("cpu")
    yield info
    from regen.train.parallel import destroy_distributed

    destroy_distributed()


@pytest.fixture(scope="module")
def target(tiny_target):
    return TargetFeatures.from_pretrained(tiny_target, TargetContract((0, 1, 2)))


class CachedFeatures:
    """The target's features computed once per micro-batch: the step under test does only the draft's work."""

    def __init__(self, target):
        self.target, self.cache = target, {}

    def features_of(self, batch):
        key = batch["key"]
        if key not in self.cache:
            self.cache[key] = tuple(t.detach() for t in self.target.features_of(batch))
        return self.cache[key]


def build(target, info, param_dtype=None):
    torch.manual_seed(0)
    cfg = small_config_for_target(target.config, target_layer_ids=(0, 1, 2), markov_rank=16, num_anchors=6)
    draft = DSparkDraft.from_target(target.model, cfg)
    model = shard_model(make_objective(draft), info, blocks=draft.layers, param_dtype=param_dtype)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def steps(run_dir, grad_accum, n, cfg):
    feed = ShardFeed(run_dir / "shards", FeedConfig(max_len=64, max_tokens=256, max_batch=3, min_loss_tokens=4,
                                                    shuffle_buffer=8, bucket_window=8), grad_accum=grad_accum)
    out = []
    for s in feed.steps():
        out.append([prepare_microbatch(mb, 0, cfg, "cpu") for mb in s.microbatches])
        if len(out) == n:
            return out
    return out


# -- point 1: every collective through regen.train.collectives, tensors checked against the plane's backend --

COLLECTIVE = re.compile(r"\bdist\.(all_reduce|broadcast|all_gather|barrier|reduce_scatter|reduce|gather|scatter|"
                        r"send|recv|broadcast_object_list|all_gather_object|all_to_all)\w*\(")


def test_no_collective_outside_the_collectives_module():
    found = [f"{p.relative_to(REPO)}:{i}" for p in (REPO / "regen").rglob("*.py") if p.name != "collectives.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if COLLECTIVE.search(line)]
    assert not found, f"collectives outside regen/train/collectives.py (route them through it): {found}"


def test_a_cpu_tensor_on_the_hot_plane_is_refused_when_nccl_is_declared(dist_info):
    x = torch.ones(3)
    assert collectives.hot_all_reduce_sum(x, "x").tolist() == [1.0, 1.0, 1.0]  # gloo: fine
    with declare_backend("nccl"):
        with pytest.raises(CollectiveDeviceError, match="NCCL carries CUDA tensors only"):
            collectives.hot_all_reduce_sum(x, "x")
        assert collectives.control_all_reduce_sum(x, "x").tolist() == [1.0, 1.0, 1.0]  # CPU on gloo control
    with pytest.raises(CollectiveDeviceError, match="control plane"):
        collectives.check([torch.empty(1, device="meta")], "control", "a device tensor")


def test_a_training_step_and_a_feature_fetch_pass_with_nccl_declared(tiny_run, target, dist_info):
    """On today's GPU path both would raise: the step's loss weights and the failure flag were CPU tensors
    all-reduced on the default (NCCL) group."""
    from regen.train.features.pool import FeaturePool

    model, opt = build(target, dist_info)
    src = CachedFeatures(target)
    (mbs,) = steps(tiny_run[1], 2, 1, model.config)
    pool = FeaturePool()
    pool.info = dist_info

    class Ok:
        def fetch(self, microbatches):
            return []

    class Fails:
        def fetch(self, microbatches):
            raise InputError("no producer for 120 s")

    with declare_backend("nccl"):
        pool.features = Ok()
        assert pool.fetch_step([]) == set()
        m = train_step(model, src, opt, mbs)
        r = reduce_metrics(m)
        pool.features = Fails()
        with pytest.raises(InputError, match="no producer"):
            pool.fetch_step([])
    assert r["tokens"] == sum(b["num_tokens"] for b, _, _ in mbs) and r["loss"] > 0 and r["grad_norm"] > 0


def _loopback_only(cmd: list[str]) -> list[str]:
    import shutil

    if os.geteuid() == 0 and shutil.which("unshare") and shutil.which("ip"):
        return ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *cmd]
    return cmd


@pytest.mark.integration
def test_a_failure_on_one_rank_reaches_the_other_over_the_control_plane(tmp_path):
    """Point 8: rank 1 fails after 8 s (a producer timeout); rank 0 waits in the agreement. The hot plane's
    timeout is 3 s here: had the agreement gone over it, rank 0 would end with a gloo timeout, not rank 1's
    message (checked by hand: 'Timed out waiting 3000ms')."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", collectives.DECLARE_ENV: "nccl",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "train"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "tests" / "train" / "collective_driver.py"), str(tmp_path), "3", "60", "8"]
    proc = subprocess.run(_loopback_only(cmd), env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["declared"] == r1["declared"] == "nccl" and r0["first"] == r1["first"] == []
    assert r0["second"] == "InputError: rank 1: no producer for 120 s (train.producers.no_producer_timeout_s)"
    assert r1["second"].startswith("InputError: no producer")


def test_the_control_plane_outwaits_the_designed_waits_and_nccl_outwaits_it():
    from regen.config import load_profile

    cfg = load_profile("kimi-k3").train
    control, hot = collectives.collective_timeouts(cfg)
    waits = [cfg.producers.startup_timeout_s, cfg.producers.no_producer_timeout_s, cfg.follow_timeout_s]
    assert control > max(waits) and hot > control
    assert collectives.collective_timeouts() == (1800.0, 2100.0)


# -- point 7: the step's metrics stay on the device; host reads counted ---------------------------------------

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


class HostReads:
    """Counts calls, from regen's own code, of the tensor methods that read a value to the host (`float(t)`,
    `t.item()`, `t.cpu()`, ...). torch's own reads are left out: AdamW's step counters are host tensors by design
    (`state["step"]` lives on the CPU unless capturable), so on a GPU they cost no synchronisation."""

    def __init__(self, monkeypatch):
        import inspect

        self.count, self.where = 0, []
        regen_dir = str(REPO / "regen")
        for name in READS:
            orig = getattr(torch.Tensor, name)

            def counted(self_, *a, __orig=orig, __name=name, **k):
                caller = inspect.currentframe().f_back
                if caller.f_code.co_filename.startswith(regen_dir):
                    self.count += 1
                    self.where.append(f"{__name} {caller.f_code.co_filename}:{caller.f_lineno}")
                return __orig(self_, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_host_reads_per_step_do_not_grow_with_micro_batches(tiny_run, target, dist_info, monkeypatch, grad_accum):
    """One host read per step (the loss weights, agreed on the control plane), whatever the number of micro-batches;
    the metrics are read once at a log step. Before this was counted: about 13 per micro-batch + 3 per step."""
    model, opt = build(target, dist_info)
    src = CachedFeatures(target)
    batches = steps(tiny_run[1], grad_accum, 2, model.config)
    for mbs in batches:  # features cached outside the count: the producers' side is not the step's
        for b, _, _ in mbs:
            src.features_of(b)
    reads = HostReads(monkeypatch)
    per_step = []
    for mbs in batches:
        before = reads.count
        m = train_step(model, src, opt, mbs)
        per_step.append(reads.count - before)
    before = reads.count
    r = reduce_metrics(m)
    at_log = reads.count - before
    monkeypatch.undo()
    # two device reads a step whatever the micro-batches: .cpu() of the loss weights (.tolist() of their host sum)
    # and .cpu() of the finiteness flags before the optimizer step (.tolist() of them and of their host agreement)
    assert per_step == [5, 5], reads.where
    assert at_log <= 3, reads.where  # .cpu() of the sums and grad norm, .tolist() of the reduced sums, the norm
    assert r["loss"] > 0 and r["tokens"] > 0


# -- point 3: features into the device, at most two objects resident -----------------------------------------

class DictStore:
    """The store's `get` for `RemoteFeatures`: a key's object bytes (no Mooncake in this test)."""

    def __init__(self):
        self.objects = {}

    def get(self, key):
        return memoryview(self.objects[key]), None


def test_remote_features_keep_two_objects_on_the_device_and_train_the_same(tiny_run, target, dist_info, monkeypatch):
    """Two steps of 4 micro-batches through `RemoteFeatures` (objects encoded from the in-process target's features,
    a dispatcher answering ready): every object leaves the store in `fetch`, before the step's compute; at most
    `DEVICE_RESIDENT_OBJECTS` (2) objects are resident at once (issued and not yet released by the loss, counted
    the same way as on CUDA); and the draft trained equals the one trained on the in-process features, bit for bit."""
    from types import SimpleNamespace

    from regen.train.features import client as client_mod
    from regen.train.features.client import RemoteFeatures
    from regen.train.features.contract import FeatureSpec, encode, make_header
    from regen.train.features.staging import DEVICE_RESIDENT_OBJECTS

    model_a, opt_a = build(target, dist_info)
    model_b, opt_b = build(target, dist_info)
    batches = steps(tiny_run[1], 4, 2, model_a.config)
    assert [len(mbs) for mbs in batches] == [4, 4]
    cached = CachedFeatures(target)
    tcfg = target.config
    spec = FeatureSpec("regen/test", (0, 1, 2), "prefix", "float32", tcfg.hidden_size, tcfg.num_hidden_layers, "r")
    store, consumed = DictStore(), []
    for mbs in batches:
        for b, _, _ in mbs:
            taps, last = cached.features_of(b)
            h = make_header(spec, epoch=b["key"][0], index=b["key"][1], attempt=0, sample_ids=["x"] * len(taps),
                            input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                            producer={"id": "p0", "engine": "test"}, stream_reading="test")
            parts, n = encode(h, taps, last)
            store.objects[str(b["key"])] = b"".join(bytes(p) for p in parts)

    def post(url, path, body, timeout_s=None):
        if path == "/wait":
            key = str((body["epoch"], body["index"]))
            return {"status": "ready", "key": key, "nbytes": len(store.objects[key])}
        consumed.append((body["epoch"], body["index"]))
        return {}

    monkeypatch.setattr(client_mod, "post", post)
    remote = RemoteFeatures("http://test", store, spec, SimpleNamespace(device="cpu"), "cpu")
    for mbs in batches:
        m_a = train_step(model_a, cached, opt_a, mbs)
        keys = [b["key"] for b, _, _ in mbs]
        remote.fetch([SimpleNamespace(epoch=k[0], index=k[1], input_ids=b["input_ids"], sample_ids=["x"],
                                      attention_mask=b["attention_mask"]) for k, (b, _, _) in zip(keys, mbs)])
        assert consumed[-4:] == keys  # every object out of the store before the first forward
        m_b = train_step(model_b, remote, opt_b, mbs)
        assert float(m_a["sums"][0]) == float(m_b["sums"][0])
    st = remote.staging.stats
    assert st["resident_max"] == DEVICE_RESIDENT_OBJECTS == 2 and st["resident"] == 0
    assert st["objects"] == st["host_copies"] == 8 and len(remote.staging.host) == 4  # slots reused by step 2
    for (n, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach(),
                           q.detach().full_tensor() if hasattr(q, "full_tensor") else q.detach()), n


def test_non_finite_features_stop_the_step_on_every_rank_naming_the_object(tiny_run, target, dist_info,
                                                                            monkeypatch):
    """Feature values are checked on the device as each object is handed over (in the middle of the step), so a
    breach is not raised there, where the other ranks would wait in FSDP's collectives until the NCCL watchdog:
    the step's finiteness flags carry it, no rank applies the optimizer step, and the stop names the object."""
    from types import SimpleNamespace

    from regen.train.features import client as client_mod
    from regen.train.features.client import RemoteFeatures
    from regen.train.features.contract import FeatureSpec, encode, make_header
    from regen.train.guard import nonfinite_step_error

    model, opt = build(target, dist_info)
    (mbs,) = steps(tiny_run[1], 3, 1, model.config)
    cached = CachedFeatures(target)
    tcfg = target.config
    spec = FeatureSpec("regen/test", (0, 1, 2), "prefix", "float32", tcfg.hidden_size, tcfg.num_hidden_layers, "r")
    store = DictStore()
    for i, (b, _, _) in enumerate(mbs):
        taps, last = (x.clone() for x in cached.features_of(b))
        if i == 1:
            last[0, -1, 0] = float("nan")
        h = make_header(spec, epoch=b["key"][0], index=b["key"][1], attempt=0, sample_ids=["x"] * len(taps),
                        input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                        producer={"id": "p0", "engine": "test"}, stream_reading="test")
        store.objects[str(b["key"])] = b"".join(bytes(p) for p in encode(h, taps, last)[0])
    monkeypatch.setattr(client_mod, "post", lambda url, path, body, timeout_s=None: (
        {"status": "ready", "key": str((body["epoch"], body["index"])),
         "nbytes": len(store.objects[str((body["epoch"], body["index"]))])} if path == "/wait" else {}))
    remote = RemoteFeatures("http://test", store, spec, SimpleNamespace(device="cpu"), "cpu")
    remote.fetch([SimpleNamespace(epoch=b["key"][0], index=b["key"][1], input_ids=b["input_ids"], sample_ids=["x"],
                                  attention_mask=b["attention_mask"]) for b, _, _ in mbs])
    before = [p.detach().clone() for p in model.parameters()]
    m = train_step(model, remote, opt, mbs)  # runs to its end: no rank leaves the step's collectives early
    assert m["finite"] is False and m["bad_microbatches"] == [1] and len(m["feature_breaches"]) == 1
    assert "last_hidden holds 1 non-finite values" in m["feature_breaches"][0]
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))  # no optimizer step
    assert remote.take_breaches() == {} and remote.staging.stats["resident"] == 0
    mine = {"loss_finite": m["loss_finite"], "grad_norm": float(m["grad_norm"]), "sample_ids": [["a"], ["b"], ["c"]],
            "bad_microbatches": m["bad_microbatches"], "feature_breaches": m["feature_breaches"]}
    msg = str(nonfinite_step_error(7, mine, [mine], None))
    assert "rank 0: " in msg and "micro-batch(es) [1], rows b" in msg and "last_hidden holds 1 non-finite" in msg
    remote.close()


# -- point 9: bf16 through FSDP2's mixed precision, in CI -----------------------------------------------------

def test_a_tiny_draft_trains_in_bf16_through_fsdp_mixed_precision(tiny_run, target, dist_info):
    model, opt = build(target, dist_info, param_dtype=torch.bfloat16)
    src = CachedFeatures(target)
    (mbs,) = steps(tiny_run[1], 2, 1, model.config)
    seen = {}
    layer = model.draft.layers[0]
    hook = layer.register_forward_pre_hook(
        lambda mod, args: seen.update(h=args[0].dtype, w=mod.mlp.up_proj.weight.dtype))
    losses = []
    for _ in range(4):  # the same step four times: the loss must fall
        losses.append(reduce_metrics(train_step(model, src, opt, mbs))["loss"])
    hook.remove()
    assert seen == {"h": torch.bfloat16, "w": torch.bfloat16}  # computed in bf16 ...
    master = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in master} == {torch.float32}  # ... master weights and optimizer state in fp32
    assert all(torch.isfinite(p.full_tensor() if hasattr(p, "full_tensor") else p).all() for p in master)
    assert all(torch.isfinite(torch.tensor(x)) for x in losses) and losses[-1] < losses[0], losses


def test_an_unwrapped_bf16_draft_runs_forward(target):
    """Outside fully_shard nothing casts the rotary cos/sin to bf16: the layers must (gpu-readiness 1.3)."""
    torch.manual_seed(0)
    cfg = small_config_for_target(target.config, target_layer_ids=(0, 1, 2), markov_rank=16, num_anchors=4)
    for attention_type in ("mla", "gqa"):
        import dataclasses

        draft = DSparkDraft.from_target(target.model, dataclasses.replace(cfg, attention_type=attention_type))
        draft = draft.to(torch.bfloat16)
        B, S = 1, 24
        taps = torch.randn(B, S, 3 * target.config.hidden_size, dtype=torch.bfloat16)
        ids = torch.randint(3, 500, (B, S))
        anchors, keep = torch.tensor([[4, 9, 15, 20]]), torch.ones(1, 4, dtype=torch.bool)
        h = draft(taps, ids, anchors, keep)
        assert h.dtype == torch.bfloat16 and torch.isfinite(h.float()).all()


# -- point 2: launch and placement ----------------------------------------------------------------------------

def test_a_run_that_expects_gpus_stops_where_there_are_none(monkeypatch):
    from regen.config import load_profile
    from regen.train.parallel import resolve_device

    assert load_profile("kimi-k3").train.device == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InputError, match="train.device=cuda but torch .* sees no CUDA device"):
        resolve_device("cuda", 0)
    assert resolve_device("auto", 0) == torch.device("cpu")  # auto: CPU, with a warning


def test_a_local_rank_beyond_the_visible_gpus_is_an_error(monkeypatch):
    from regen.train.parallel import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_device("cuda", 3) == torch.device("cuda", 3)
    with pytest.raises(InputError, match=r"LOCAL_RANK=4 but this node has 4 visible CUDA device.*--nproc_per_node 4"):
        resolve_device("cuda", 4)


class _NoRoute:
    def __init__(self, *a):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def connect(self, addr):
        raise OSError("no route")


def test_an_auto_address_on_loopback_is_refused_for_other_nodes(monkeypatch):
    import socket
    import types

    from regen.train.features.pool import host_address, resolve_addresses

    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")  # Debian's /etc/hosts
    monkeypatch.setattr(socket, "socket", _NoRoute)
    pcfg = types.SimpleNamespace(store=types.SimpleNamespace(hostname="auto"), dispatcher_host="auto")
    with pytest.raises(InputError, match="train.producers.store.hostname=auto resolves to the loopback address "
                                         "127.0.1.1"):
        resolve_addresses(pcfg, "10.0.0.5:50051", None)
    pcfg.store.hostname = "10.0.0.7"
    with pytest.raises(InputError, match="train.producers.dispatcher_host=auto resolves to the loopback"):
        resolve_addresses(pcfg, "10.0.0.5:50051", None)
    # a master on loopback is a local run: loopback is right there
    assert resolve_addresses(pcfg, "127.0.0.1:50051", "auto") == ("http://127.0.0.1:9003/metrics", "10.0.0.7",
                                                                 "127.0.0.1")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "10.0.0.9")
    assert host_address("10.0.0.5") == "10.0.0.9"


# -- point 4: attention through flex_attention with a block mask ----------------------------------------------

@pytest.mark.parametrize("attention_type", ["mla", "gqa"])
def test_flex_attention_with_the_block_mask_equals_the_dense_path(target, attention_type):
    """fp32 on CPU, forward (torch 2.13 has no flex backward on CPU): rows of two lengths (padding), anchors near
    the start (little context) and at the end, a dummy block (keep False: attends everywhere on both paths)."""
    import dataclasses

    torch.manual_seed(0)
    cfg = small_config_for_target(target.config, target_layer_ids=(0, 1, 2), markov_rank=16, num_anchors=4)
    draft = DSparkDraft.from_target(target.model, dataclasses.replace(cfg, attention_type=attention_type)).eval()
    B, S = 2, 40
    taps = torch.randn(B, S, 3 * target.config.hidden_size)
    ids = torch.randint(3, 500, (B, S))
    attention_mask = torch.ones(B, S, dtype=torch.long)
    attention_mask[1, 30:] = 0
    anchors = torch.tensor([[1, 9, 22, 33], [3, 12, 25, 0]])
    keep = torch.tensor([[True, True, True, True], [True, True, True, False]])
    with torch.no_grad():
        dense = draft(taps, ids, anchors, keep, attention_mask_BS=attention_mask)
        draft.attention_impl = "flex"
        flex = draft(taps, ids, anchors, keep, attention_mask_BS=attention_mask)
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


def test_the_block_mask_skips_the_tiles_no_query_sees():
    from regen.train.attention import dspark_block_mask
    from regen.train.loss import create_block_attention_mask

    N, K, S = 64, 4, 1024  # 256 queries, 1,280 keys: 2 x 10 tiles of 128
    anchors = torch.arange(N)[None] * 8 + 300  # anchors from 300 to 804: the context after them is never seen
    keep = torch.ones(1, N, dtype=torch.bool)
    bm = dspark_block_mask(anchors, keep, S, K)
    dense = create_block_attention_mask(anchors, keep, S, K)
    assert dense.float().mean() < 0.5
    # the BlockMask's own count of the tiles it computes: fewer than all
    sparsity = bm.sparsity()  # percent of tiles skipped
    assert sparsity > 20, bm


def test_flex_for_training_off_cuda_is_refused():
    from regen.train.attention import training_impl

    assert training_impl("sdpa", "cpu") == "sdpa"
    with pytest.raises(InputError, match="train.attention=flex on cpu: .* CUDA only"):
        training_impl("flex", "cpu")


# -- point 6: the draft built on the meta device, materialised where it trains ---------------------------------

@pytest.mark.parametrize("draft_vocab_size", [0, 100])
def test_a_draft_built_on_meta_matches_one_built_on_the_host(target, draft_vocab_size):
    """Same modules, dtypes, frozen head (shared with the target when the dtype matches), buffers and init
    statistics as `DSparkDraft.from_target`; nothing but the frozen head allocated on the host first."""
    import dataclasses

    from regen.train.build import build_draft

    cfg = small_config_for_target(target.config, target_layer_ids=(0, 1, 2), markov_rank=16, num_anchors=4)
    cfg = dataclasses.replace(cfg, draft_vocab_size=draft_vocab_size)
    vocab = torch.arange(0, 2 * draft_vocab_size, 2) if draft_vocab_size else None
    torch.manual_seed(0)
    host = DSparkDraft.from_target(target.model, cfg, draft_vocab=vocab)
    torch.manual_seed(0)
    meta = build_draft(target.model, cfg, "cpu", draft_vocab=vocab, frozen_dtype=torch.float32)
    a, b = host.state_dict(), meta.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype and b[k].device.type == "cpu", k
        if k.startswith(("embed_tokens", "lm_head")) or k in ("d2t", "t2d") or k.endswith("norm.weight") \
                or ".fc_norm." in k or k.startswith("fc_norm") or k.endswith(".bias"):
            torch.testing.assert_close(a[k], b[k], msg=k)  # copied, ones, zeros, buffers: equal
        else:
            assert abs(b[k].float().std().item() - 0.02) < 0.01, k  # normal(0, 0.02) drawn on the device
    assert meta.embed_tokens.weight.data_ptr() == target.model.get_input_embeddings().weight.data_ptr()
    torch.testing.assert_close(host.rotary.inv_freq, meta.rotary.inv_freq)
    assert not meta.embed_tokens.weight.requires_grad and not meta.lm_head.weight.requires_grad


# -- point 5: the plan's memory terms against what autograd keeps, measured on CPU ------------------------------

def _saved_bytes(draft, *inputs) -> int:
    """Bytes of the distinct storages autograd saves for backward in `draft(*inputs)`, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in draft.parameters()}
    out = draft(*inputs)
    seen, stack, visited = {}, [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            try:
                value = getattr(node, name)
            except Exception:  # noqa: BLE001 - some saved values are not readable (released, None)
                continue
            for t in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(t, torch.Tensor):
                    ptr = t.untyped_storage().data_ptr()
                    if ptr not in params:
                        seen[ptr] = t.untyped_storage().nbytes()
        stack.extend(n for n, _ in node.next_functions)
    return sum(seen.values())


@pytest.mark.parametrize("S,N,layers", [(200, 8, 1), (400, 8, 1), (200, 16, 2), (300, 8, 3)])
def test_the_activation_formula_equals_what_autograd_saves(S, N, layers):
    """bf16 compute (as under FSDP2's mixed precision), the K3 draft's structure at toy sizes; on CPU the attention
    runs the math path, so the formula's `math` attention term is the one compared."""
    from regen.train.draft_config import DSparkConfig
    from regen.train.memory import activation_bytes

    torch.manual_seed(0)
    cfg = DSparkConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, q_lora_rank=32,
                       kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=512,
                       target_hidden_size=64, target_num_hidden_layers=12, target_layer_ids=(1, 3, 5, 7, 9),
                       fc_norm=True, mask_token_id=500, markov_rank=8, eos_token_id=(2,), pad_token_id=None,
                       num_anchors=N, num_hidden_layers=layers)
    draft = DSparkDraft(cfg).to(torch.bfloat16)
    taps = torch.randn(1, S, 5 * 64, dtype=torch.bfloat16)
    anchors = torch.sort(torch.randperm(S - 8)[:N] + 1).values[None]
    measured = _saved_bytes(draft, taps, torch.randint(3, 500, (1, S)), anchors, torch.ones(1, N, dtype=torch.bool))
    assert activation_bytes(cfg, S, c=2, attention="math")["total"] == measured


def test_the_kimi_k3_plan_counts_every_term():
    from regen.config import load_profile
    from regen.report.plan import assumptions, draft_plan

    profile = load_profile("kimi-k3")
    d = draft_plan(profile, assumptions(profile, {}) | {"world_size": 8}, 1e9)
    mem = d["memory_per_gpu_gib"]
    assert set(mem) == {"weights", "unsharded_params", "gradients", "optimizer", "features", "activations", "loss",
                        "total"}
    T, g = profile.train.max_tokens, profile.train.grad_accum
    # two objects on the device (the micro-batch computing, the next one's copy); in pinned host memory the
    # train.producers.read_ahead objects read ahead (2; a step's g with read_ahead 0)
    ra = profile.train.producers.read_ahead
    assert mem["features"] == pytest.approx(2 * T * 6 * 7168 * 2 / 2**30, abs=0.01)
    assert ra == 2 and d["host_memory_per_gpu_gib"]["feature_staging"] == pytest.approx(
        ra * T * 6 * 7168 * 2 / 2**30, abs=0.01)
    assert g == 16 and mem["features"] == 10.5 and mem["total"] == pytest.approx(
        148.04 - 84.0 + 10.5 - 2**25 * 4 / 2**30, abs=0.02)  # the fused loss: 5 chunk buffers of 2^25 fp32, not 6
    assert mem["gradients"] > 4 * d["params_trainable"] / 2**30  # unsharded fp32 through accumulation
    assert mem["activations"] > 30 and mem["total"] > 70  # the context side of 5 layers at 64K; was 19.45


def test_a_resume_does_not_depend_on_the_number_of_visible_gpus(monkeypatch):
    """An older checkpoint saved every visible device's CUDA RNG state; restoring it with set_rng_state_all raised
    on a host with fewer GPUs. Now: this rank's device's state only."""
    import random

    from regen.train import checkpoint

    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: restored.append(s))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: pytest.fail("every device's state restored"))
    base = {"torch": torch.get_rng_state(), "python": random.getstate()}
    eight = [torch.tensor([i], dtype=torch.uint8) for i in range(8)]
    checkpoint._set_rng_state(base | {"cuda": eight})  # saved on an 8-GPU node, resumed on device 1 of 4
    checkpoint._set_rng_state(base | {"cuda": eight[:1]})  # saved on a 1-GPU node: nothing for device 1
    checkpoint._set_rng_state(base | {"cuda_current": eight[5]})
    assert [int(t[0]) for t in restored] == [1, 5]


@pytest.mark.integration
def test_run_train_takes_its_timeouts_from_the_profile(tiny_run, monkeypatch):
    from regen.config import load_profile
    from regen.rundir import RunDir
    from regen.train import parallel
    from regen.train.loop import run_train

    seen = {}

    def fake_init(device, timeout_s=None, control_timeout_s=None):
        seen.update(device=device, hot=timeout_s, control=control_timeout_s)
        raise RuntimeError("stop here")

    monkeypatch.setattr(parallel, "init_distributed", fake_init)
    cfg = load_profile(str(tiny_run[0]), ["train.features=producers", "train.producers.startup_timeout_s=5000"]).train
    with pytest.raises(RuntimeError, match="stop here"):
        run_train(cfg, RunDir.at(tiny_run[1]))
    assert seen["control"] == 5300 and seen["hot"] == 5600


# -- point 6: sharded checkpoints (DCP) resume at another world size ------------------------------------------

def _torchrun(args, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "train"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "tests" / "train" / "sharded_driver.py"), *args]
    proc = subprocess.run(_loopback_only(cmd), env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _assert_same(a: dict, b: dict):
    for part in ("weights", "moments"):
        assert a[part].keys() == b[part].keys() and a[part], part
        for k in a[part]:
            torch.testing.assert_close(a[part][k], b[part][k], msg=k)


@pytest.mark.integration
def test_a_sharded_checkpoint_resumes_two_ranks_to_one_and_back(dist_info, tmp_path):
    from sharded_driver import build, fake_step, full_state

    from regen.train.sharded_state import load_sharded, save_sharded

    _torchrun(["save", str(tmp_path)], tmp_path)  # 2 ranks: a step, then DCP shards, one file per rank
    assert len(list((tmp_path / "dcp").glob("*.distcp"))) == 2
    model, opt = build(7, dist_info)  # 1 rank, another init
    load_sharded(tmp_path / "dcp", model, opt)
    _assert_same(full_state(model, opt), torch.load(tmp_path / "ref.pt"))
    fake_step(model, opt, 2)
    save_sharded(tmp_path / "dcp1", model, opt)
    ref1 = full_state(model, opt)
    _torchrun(["load", str(tmp_path / "dcp1"), str(tmp_path / "got2.pt")], tmp_path)  # 1 rank -> 2 ranks
    _assert_same(torch.load(tmp_path / "got2.pt"), ref1)



@pytest.mark.integration
def test_a_nonfinite_shard_on_one_rank_stops_both_ranks_and_writes_nothing(tmp_path):
    """Each rank checks its own shards of the weights and the AdamW state before the sharded checkpoint; the verdict
    is agreed on the control plane, so rank 0 (whose shards are finite) refuses too."""
    _torchrun(["poison", str(tmp_path)], tmp_path)
    for rank in (0, 1):
        msg = (tmp_path / f"rank{rank}.txt").read_text()
        assert "not written: non-finite values in optimizer.state." in msg and ".exp_avg" in msg, msg
    assert (tmp_path / "rank1.txt").read_text().startswith("CheckpointError")
    assert "rank 1: " in (tmp_path / "rank0.txt").read_text()  # rank 0 names the rank that found it
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "latest.json").exists()
