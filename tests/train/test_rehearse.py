"""`regen rehearse` on small shapes: the trainer's step on fake tensors, its memory against `regen plan`, its host
syncs per micro-batch and its device placement (regen/report/rehearse.py, regen/train/rehearse.py)."""
from __future__ import annotations

import pytest

from regen.config import load_profile

pytestmark = pytest.mark.integration  # the trainer's step under fake tensors and FSDP: about 50 s for the module

K3_SMALL = ["train.max_tokens=1024", "train.grad_accum=3", "train.num_draft_layers=1", "train.num_anchors=64"]
SHAPES = {  # small shapes; the kimi-k3 ones are in docs/plan.md (regen rehearse --profile kimi-k3)
    "local": ("local", ["train.grad_accum=3", "train.draft_vocab_size=0"]),
    "k3-small": ("kimi-k3", K3_SMALL),
    "k3-small-flex": ("kimi-k3", K3_SMALL + ["train.attention=flex"]),
}


@pytest.fixture(scope="module")
def reports():
    from regen.report.rehearse import rehearse

    return {name: rehearse(load_profile(p, over)) for name, (p, over) in SHAPES.items()}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_step_runs_on_fake_tensors_and_places_nothing_on_the_host(reports, name):
    r = reports[name]
    assert r["ok"], r["placement_errors"]
    assert r["optimizer_stepped"]
    assert r["memory"]["rehearsed_total"] > 0
    assert any(c["op"].endswith("allreduce_") for c in r["collectives"])


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_plan_equals_the_rehearsed_peak_within_15_percent(reports, name):
    m = reports[name]["memory"]
    assert 0.85 <= m["ratio"] <= 1.15, (m["plan_total"], m["rehearsed_total"], m["groups"])


def test_fsdp_collectives_are_seen_with_their_devices():
    from regen.report.rehearse import rehearse

    r = rehearse(load_profile("kimi-k3", ["train.max_tokens=256", "train.grad_accum=2", "train.num_draft_layers=1",
                                          "train.num_anchors=16"]), placement=False)
    ops = {c["op"] for c in r["collectives"]}
    assert {"c10d._allgather_base_", "c10d._reduce_scatter_base_"} <= ops
    assert all("cpu" in c["devices"] for c in r["collectives"])


def test_a_host_tensor_meeting_a_device_one_is_named():
    import torch

    from regen.train.rehearse_modes import Watch

    w = Watch(device="meta")
    with w:
        torch.ones(3, device="meta") + torch.ones(3)
    (e,) = [e for e in w.events if e.kind == "placement"]
    assert e.op == "add.Tensor" and "test_rehearse.py" not in e.where  # not a regen line: '?'


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_at_most_one_host_sync_per_micro_batch_from_the_loss_and_step(reports, name):
    assert reports[name]["syncs_loss_and_step_per_micro_batch"] <= 1, reports[name]["syncs_per_micro_batch"]


def test_the_local_profile_as_shipped_rehearses_with_its_reduced_draft_vocabulary():
    """The default local profile (a reduced draft vocabulary: the draft's lm_head is not the target's, and is cast, not
    shared) runs on fake tensors: a frozen tensor already in the compute dtype is not converted again, which fake
    parameters could not be swapped for."""
    from regen.report.rehearse import rehearse

    r = rehearse(load_profile("local", []))
    assert r["ok"], r["placement_errors"]
    assert r["optimizer_stepped"] and r["memory"]["rehearsed_total"] > 0


def test_flex_rehearses_below_sdpa_and_leaves_torchs_cpu_guard_in_place(reports):
    """flex's step runs on the stand-ins (the HOP's fake forward and backward: outputs, logsumexp and gradients, as
    the fused kernel allocates) and peaks below sdpa's on the same shape, whose dense bool [B, 1, Q, L] mask flex
    never builds; once the rehearsal is over, torch refuses flex's backward on real CPU tensors again."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    flex, sdpa = reports["k3-small-flex"], reports["k3-small"]
    assert flex["shape"]["attention"] == "flex" and sdpa["shape"]["attention"] == "sdpa"
    assert flex["memory"]["rehearsed_total"] < sdpa["memory"]["rehearsed_total"]
    q = torch.zeros(1, 1, 128, 16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(q, q, q)
