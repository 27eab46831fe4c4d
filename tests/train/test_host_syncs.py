"""No host synchronisation in the trainer's hot loop: the loss, the fused loss and the feature value checks issue no
data-dependent op on the training device (`.item()`, `nonzero`, boolean-mask indexing, `torch.unique`, a read back).

Two witnesses: the `meta` device, where every such op raises (so one micro-batch's loss and backward running there
proves there is none), and a dispatch mode that records them on CPU tensors, with the line they come from."""
from __future__ import annotations

import os
import traceback

import pytest
import torch
from test_dspark_model import tiny_cfg
from torch.utils._python_dispatch import TorchDispatchMode

import regen
from regen.train.loss import SlotLayout, dspark_loss, sample_anchors, slot_layout
from regen.train.model import DSparkDraft

A = torch.ops.aten
DATA_DEPENDENT = {A._local_scalar_dense.default, A.nonzero.default, A.nonzero_static.default, A.masked_select.default,
                  A._unique2.default, A.unique_dim.default, A.unique_consecutive.default, A.masked_scatter.default,
                  A.repeat_interleave.Tensor}
INDEXING = {A.index.Tensor, A.index_put.default, A.index_put_.default, A._index_put_impl_.default}


# regen's package folder (not any path holding "/regen/": a clone may itself be a folder named regen)
PACKAGE = os.path.dirname(os.path.abspath(regen.__file__)) + os.sep


class HostSyncs(TorchDispatchMode):
    """Records every op whose result depends on tensor values on the host (a host synchronisation on a GPU): the
    ops above, and indexing with a boolean mask. `seen`: [(op, file:line in regen)]."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = func in DATA_DEPENDENT or (func in INDEXING and any(
            i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]))
        if hit:
            where = [f for f in traceback.extract_stack() if f.filename.startswith(PACKAGE)]
            self.seen.append((str(func), f"{where[-1].filename[len(PACKAGE):]}:{where[-1].lineno}"
                              if where else "outside regen"))
        return func(*args, **kwargs)


def _micro_batch(S=40, seed=0, vocab=500):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (2, S), generator=g)
    lm = torch.ones(2, S)
    lm[:, :4] = 0
    lm[1, 30:] = 0
    lm[0, 17] = 0  # a block cut short inside
    feats = (torch.randn(2, S, 3 * 64, generator=g), torch.randn(2, S, 64, generator=g))
    return {"input_ids": ids, "loss_mask": lm}, feats


def test_the_recorder_sees_each_kind_of_host_sync():
    """The witness can fail: each op the loss used to issue is recorded."""
    x = torch.arange(6.0)
    with HostSyncs() as rec:
        x[x > 2]
        torch.unique(x)
        x.nonzero()
        float(x.sum())
        y = torch.zeros(6)
        y[x > 2] = 1.0
    assert [op for op, _ in rec.seen] == ["aten.index.Tensor", "aten._unique2.default", "aten.nonzero.default",
                                          "aten._local_scalar_dense.default", "aten.index_put_.default"]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("extra", [{}, {"markov_rank": 0}, {"final_logit_softcapping": 3.0, "fc_norm": True}])
def test_one_micro_batch_loss_and_backward_run_on_meta_without_a_host_sync(fused, extra):
    """As the trainer runs it (`regen.train.step.prepare_microbatch`): anchors and the slot layout from the host
    copies, then everything on the device, here `meta`, where any `.item()`, `nonzero`, boolean-mask index or
    `unique` raises. Several vocabulary chunks (chunk_slots=3), metrics kept on the device."""
    cfg = tiny_cfg(block_size=4, **extra)
    batch, feats = _micro_batch()
    anchors, keep = sample_anchors(batch["loss_mask"], cfg.num_anchors, torch.Generator().manual_seed(1))
    layout = slot_layout(anchors, keep, batch["loss_mask"], cfg.block_size, cfg.loss_decay_gamma)
    assert layout.n > 6  # several chunks of 3 slots
    with torch.device("meta"):
        d = DSparkDraft(cfg)
    meta = "meta"
    mb = {k: v.to(meta) for k, v in batch.items()}
    mb["slot_layout"] = layout.to(meta)
    with HostSyncs() as rec:
        loss, m = dspark_loss(d, mb, tuple(f.to(meta) for f in feats), anchors.to(meta), keep.to(meta), fused=fused,
                              chunk_slots=3, denominator=5.0, metrics_on_device=True, layout=mb["slot_layout"])
        loss.backward()
    assert loss.is_meta and all(v.is_meta for v in m.values())
    assert d.context_proj.weight.grad is not None and d.context_proj.weight.grad.is_meta
    assert rec.seen == []


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_the_layout_gives_the_same_numbers_and_the_device_part_records_no_sync(draft_vocab):
    """On CPU: the loss with the host-built layout equals the loss that builds it itself (loss, metrics, every
    gradient, bitwise), and with the layout given, the loss and its backward record no data-dependent op."""
    torch.manual_seed(0)
    batch, feats = _micro_batch()
    if draft_vocab:  # a reduced vocabulary: the targets outside it leave the loss mask first, as the trainer does
        keep_ids = torch.unique(batch["input_ids"])[:-5]
        cfg = tiny_cfg(block_size=4, draft_vocab_size=keep_ids.numel())
        d = DSparkDraft(cfg)
        d.set_draft_vocab(keep_ids)
        batch["loss_mask"] = batch["loss_mask"] * d.in_draft_vocab(batch["input_ids"])
    else:
        cfg = tiny_cfg(block_size=4)
        d = DSparkDraft(cfg)
    with torch.no_grad():
        d.lm_head.weight.normal_(std=0.3)
    anchors, keep = sample_anchors(batch["loss_mask"], cfg.num_anchors, torch.Generator().manual_seed(1))
    runs = []
    for given in (False, True):
        d.zero_grad()
        layout = (slot_layout(anchors, keep, batch["loss_mask"], cfg.block_size, cfg.loss_decay_gamma,
                              input_ids=batch["input_ids"], t2d=d.t2d if draft_vocab else None) if given else None)
        with HostSyncs() as rec:
            loss, m = dspark_loss(d, batch, feats, anchors, keep, chunk_slots=3, denominator=5.0,
                                  metrics_on_device=True, layout=layout)
            loss.backward()
        runs.append((loss.detach(), m, {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None},
                     rec.seen))
    (l0, m0, g0, seen0), (l1, m1, g1, seen1) = runs
    assert seen1 == [] and seen0 and all(w.startswith("train/loss.py") for _, w in seen0)  # the layout's, on the host
    assert torch.equal(l0, l1) and set(g0) == set(g1) and all(torch.equal(g0[n], g1[n]) for n in g0)
    assert all(torch.equal(m0[k], m1[k]) for k in m0)


def test_a_layout_that_does_not_match_the_loss_mask_is_refused():
    cfg = tiny_cfg(block_size=4)
    d = DSparkDraft(cfg)
    batch, feats = _micro_batch()
    anchors, keep = sample_anchors(batch["loss_mask"], cfg.num_anchors, torch.Generator().manual_seed(1))
    layout = slot_layout(anchors, keep, batch["loss_mask"], cfg.block_size, cfg.loss_decay_gamma)
    stale = {**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])}  # changed after the layout was built
    with pytest.raises(RuntimeError, match="slot layout does not match the loss mask"):
        dspark_loss(d, stale, feats, anchors, keep, layout=layout)
    loss, m = dspark_loss(d, stale, feats, anchors, keep, layout=SlotLayout.empty(layout.num_slots))  # as zero_loss
    assert float(loss.detach()) == 0.0 and m["num_slots"] == 0
    with pytest.raises(ValueError, match="covers 64 slots"):
        dspark_loss(d, batch, feats, anchors[:, :4], keep[:, :4], layout=SlotLayout.empty(64))
    with pytest.raises(ValueError, match="built without the draft vocabulary"):
        dv = DSparkDraft(tiny_cfg(block_size=4, draft_vocab_size=300))
        dspark_loss(dv, batch, feats, anchors, keep, layout=layout)


def test_deferred_feature_value_checks_read_nothing_per_micro_batch():
    """The GPU's value check (`contract.value_summary`) counts on the device: handing an object over records no
    data-dependent op; `take_breaches` reads the counts once and names the same value as the immediate check."""
    from regen.train.features.contract import FeatureContractError, check_values, value_breach, value_summary

    header = {"sample_ids": ["a", "b"], "producer": {"id": "p0", "engine": "test"}}
    taps, last = torch.randn(2, 9, 12), torch.randn(2, 9, 4)
    taps[1, 6, 3] = float("nan")
    taps[1, 7, 0] = float("-inf")
    with HostSyncs() as rec:
        summary = value_summary(taps, last, positions_per_pass=4)  # three passes over the positions
    assert rec.seen == []
    msg = value_breach(header, summary.tolist(), 9, epoch=0, index=3)
    with pytest.raises(FeatureContractError) as e:
        check_values(header, taps, last, epoch=0, index=3)
    assert msg == str(e.value) and "taps holds 2 non-finite values, the first at row 1 (b), position 6" in msg
    assert value_breach(header, value_summary(last, last).tolist(), 9, epoch=0, index=3) is None


# -- flex_attention: bucketed shapes, compilations counted, no silent eager fallback ----------------------------

def test_flex_row_lengths_are_bucketed_to_a_few_shapes():
    from regen.train.attention import flex_bucket

    assert [flex_bucket(n) for n in (1, 40, 128, 129, 4096, 4097, 32768, 33000, 65536)] == \
        [128, 128, 128, 256, 4096, 5120, 32768, 40960, 65536]
    sizes = {flex_bucket(n) for n in range(1024, 65537, 7)}
    assert len(sizes) == 25 and all(flex_bucket(n) <= 1.25 * n + 128 for n in range(1, 70000, 13))


def test_flex_mask_of_bucketed_lengths_equals_the_dense_mask_on_the_real_ones():
    from torch.nn.attention.flex_attention import create_mask

    from regen.train.attention import dspark_block_mask
    from regen.train.loss import create_block_attention_mask

    anchors = torch.tensor([[1, 9, 22, 33], [3, 12, 25, 0]])
    keep = torch.tensor([[True, True, True, True], [True, True, True, False]])
    am = torch.ones(2, 40, dtype=torch.long)
    am[1, 30:] = 0
    fm = dspark_block_mask(anchors, keep, 40, 4, attention_mask=am)
    assert (fm.q_len, fm.kv_len, fm.q_bucket, fm.kv_bucket) == (16, 56, 128, 256)
    dense = create_block_attention_mask(anchors, keep, 40, 4, attention_mask=am)
    dense[~keep.repeat_interleave(4, 1)] = True  # a dummy block attends everywhere (finite; weighted 0 by the loss)
    full = create_mask(fm.block_mask.mask_mod, 2, 1, fm.q_bucket, fm.kv_bucket, device="cpu")[:, 0]
    assert torch.equal(full[:, :16, :56], dense)
    assert not full[:, :16, 56:].any()  # no real query sees a padding key
    assert full[:, 16:].sum(-1).eq(1).all() and full[:, 16:, 0].all()  # a padding query sees key 0 only


def test_flex_compilations_are_counted_and_the_eager_fallback_is_refused(monkeypatch):
    """dynamo's recompile limit, hit for real (a function compiled with the `eager` backend, so no C++ build):
    past it dynamo would run the function eagerly, silently; `_guarded` raises instead, naming the way out."""
    from regen.train import attention

    monkeypatch.setattr(attention, "FLEX_MAX_SHAPES", 2)
    monkeypatch.setitem(attention.FLEX_STATS, "attention_compiles", 0)
    fn = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    for n in (3, 3, 4, 5, 6):  # limit = FLEX_MAX_SHAPES + 2 = 4 compiled shapes
        assert torch.equal(attention._guarded("attention", fn, torch.ones(n)), torch.full((n,), 2.0))
    assert attention.FLEX_STATS["attention_compiles"] == 4
    with pytest.raises(RuntimeError, match="recompile limit in the attention .*refused. Use train.attention=sdpa"):
        attention._guarded("attention", fn, torch.ones(7))
    monkeypatch.setitem(attention.FLEX_STATS, "shapes", {(1, 128, 256), (1, 128, 384)})
    attention._count_shape((1, 128, 256))  # seen: nothing new to compile
    with pytest.raises(RuntimeError, match="3th shape .* past the limit of 2"):
        attention._count_shape((1, 256, 512))
