"""One optimizer step on a tiny target: accumulation equals one large batch; checkpoint round trip."""
from __future__ import annotations

import json

import pytest
import torch

from regen.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from regen.train.feed import FeedConfig, ShardFeed
from regen.train.model import DSparkDraft, small_config_for_target
from regen.train.parallel import full_model_state, full_optim_state, init_distributed, shard_model
from regen.train.step import make_objective, prepare_microbatch, train_step
from regen.train.target import TargetContract, TargetFeatures
from regen.train.trainer import lr_lambda


@pytest.fixture(scope="module")
def dist_info():
    info = init_distributed("cpu")
    yield info
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def target(tiny_target):
    return TargetFeatures.from_pretrained(tiny_target, TargetContract((0, 1, 2)))


def build(target, info, seed=0, lr=1e-2, sgd=False):
    torch.manual_seed(seed)
    cfg = small_config_for_target(target.config, target_layer_ids=(0, 1, 2), markov_rank=16, num_anchors=6)
    draft = DSparkDraft.from_target(target.model, cfg)
    model = shard_model(make_objective(draft), info, blocks=draft.layers)
    trainable = [p for p in model.parameters() if p.requires_grad]
    # SGD makes the update linear in the gradient (Adam's first step is ~sign(g): equal within rounding only)
    opt = torch.optim.SGD(trainable, lr=lr) if sgd else torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(10, 0.04, 0.0))
    return model, opt, sched


def microbatches(run_dir, n=2):
    feed = ShardFeed(run_dir / "shards", FeedConfig(max_len=64, max_tokens=256, max_batch=3, min_loss_tokens=4,
                                                    shuffle_buffer=8, bucket_window=8), grad_accum=n)
    return next(feed.steps()).microbatches


def concat(mbs):
    """One batch holding every row of `mbs` (right-padded), anchors padded with switched-off dummies."""
    width = max(b["input_ids"].shape[1] for b, _, _ in mbs)
    n = max(a.shape[1] for _, a, _ in mbs)

    def pad(x, w, value=0):
        return torch.nn.functional.pad(x, (0, w - x.shape[1]), value=value)

    batch = {k: torch.cat([pad(b[k], width) for b, _, _ in mbs]) for k in ("input_ids", "loss_mask", "attention_mask")}
    return batch, torch.cat([pad(a, n) for _, a, _ in mbs]), torch.cat([pad(k, n, False) for _, _, k in mbs])


def params(model):
    return {k: v.clone() for k, v in full_model_state(model).items()}


def test_gradient_accumulation_equals_one_large_batch(tiny_run, target, dist_info):
    _, run_dir = tiny_run
    model_a, opt_a, _ = build(target, dist_info, sgd=True, lr=1.0)
    cfg = model_a.config
    mbs = [prepare_microbatch(mb, 0, cfg, torch.device("cpu")) for mb in microbatches(run_dir)]
    assert len(mbs) == 2 and not torch.equal(mbs[0][1], mbs[1][1])
    before = params(model_a)
    m_a = train_step(model_a, target, opt_a, mbs)
    model_b, opt_b, _ = build(target, dist_info, sgd=True, lr=1.0)
    assert all(torch.equal(before[k], v) for k, v in params(model_b).items())
    m_b = train_step(model_b, target, opt_b, [concat(mbs)])
    assert m_a["weight"] == pytest.approx(m_b["weight"])
    assert m_a["sums"][0].item() == pytest.approx(m_b["sums"][0].item(), rel=1e-5)  # same objective
    after_a, after_b = params(model_a), params(model_b)
    changed = [k for k in after_a if not torch.equal(after_a[k], before[k])]
    assert "draft.context_proj.weight" in changed and "draft.markov_head.markov_w2.weight" in changed
    for k in after_a:
        torch.testing.assert_close(after_a[k] - before[k], after_b[k] - before[k], rtol=1e-4, atol=1e-7, msg=k)


def _trained(run_dir, target, info):
    model, opt, sched = build(target, info)
    feed = ShardFeed(run_dir / "shards", FeedConfig(max_len=64, max_tokens=256, max_batch=3, min_loss_tokens=4))
    for step in list(feed.steps())[:2]:
        train_step(model, target, opt, [prepare_microbatch(mb, 0, model.config, "cpu") for mb in step.microbatches])
        sched.step()
    return model, opt, sched, feed


def _assert_restored(path, model, opt, sched, feed, target, info, run_dir):
    model2, opt2, sched2 = build(target, info, seed=1)
    feed2 = ShardFeed(run_dir / "shards", FeedConfig(max_len=64, max_tokens=256, max_batch=3, min_loss_tokens=4))
    assert not torch.equal(params(model2)["draft.context_proj.weight"], params(model)["draft.context_proj.weight"])
    assert load_checkpoint(path, model2, opt2, sched2, feed2) == 2
    p1, p2 = params(model), params(model2)
    assert p1.keys() == p2.keys() and all(torch.equal(p1[k], p2[k]) for k in p1)
    o1, o2 = full_optim_state(model, opt), full_optim_state(model2, opt2)
    assert o1["state"].keys() == o2["state"].keys() and len(o1["state"]) > 5
    for name, st in o1["state"].items():
        for key, value in st.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(o2["state"][name][key])), (name, key)
    assert sched2.state_dict() == sched.state_dict() and feed2.state_dict() == feed.state_dict()


def test_checkpoint_round_trip(tiny_run, target, dist_info, tmp_path):
    _, run_dir = tiny_run
    model, opt, sched, feed = _trained(run_dir, target, dist_info)
    path = save_checkpoint(tmp_path, 2, model, opt, sched, feed, training={"note": "test"})
    assert latest_checkpoint(tmp_path) == path
    config = json.loads((path / "config.json").read_text())
    assert config["target_layer_ids"] == [0, 1, 2] and config["markov_rank"] == 16 and "fc_norm" in config
    assert (path / "resume" / ".metadata").is_file() and not (path / "optimizer.pt").exists()
    _assert_restored(path, model, opt, sched, feed, target, dist_info, run_dir)


def test_a_checkpoint_of_the_full_state_format_still_resumes(tiny_run, target, dist_info, tmp_path):
    """A step folder written before the sharded state: model.safetensors + optimizer.pt (the full AdamW state keyed
    by name, rank 0's), no resume/; one with neither is refused with the remedy."""
    import shutil

    from regen.train.checkpoint import CheckpointError, verify_checkpoint

    _, run_dir = tiny_run
    model, opt, sched, feed = _trained(run_dir, target, dist_info)
    path = save_checkpoint(tmp_path, 2, model, opt, sched, feed, training={"note": "test"})
    shutil.rmtree(path / "resume")
    (path / "MANIFEST.json").unlink()
    torch.save(full_optim_state(model, opt), path / "optimizer.pt")  # what the full-state checkpoint held
    assert verify_checkpoint(path) is None
    _assert_restored(path, model, opt, sched, feed, target, dist_info, run_dir)
    (path / "optimizer.pt").unlink()
    assert "optimizer.pt missing" in verify_checkpoint(path)  # resume passes over such a folder
    model2, opt2, sched2 = build(target, dist_info, seed=1)
    with pytest.raises(CheckpointError, match=r"no resumable state .*--init-from"):
        load_checkpoint(path, model2, opt2, sched2, feed)


def test_a_nonfinite_optimizer_shard_is_never_written(tiny_run, target, dist_info, tmp_path):
    from regen.train.checkpoint import CheckpointError

    _, run_dir = tiny_run
    model, opt, sched, feed = _trained(run_dir, target, dist_info)
    p = dict(model.named_parameters())["draft.context_proj.weight"]
    opt.state[p]["exp_avg_sq"].to_local()[0, 0] = float("inf")
    with pytest.raises(CheckpointError, match=r"not written: non-finite values in optimizer\.state\.draft\."
                                              r"context_proj\.weight\.exp_avg_sq"):
        save_checkpoint(tmp_path, 2, model, opt, sched, feed, training={})
    assert not (tmp_path / "checkpoints").exists() and latest_checkpoint(tmp_path) is None


def test_micro_batch_normalisation_equals_the_reference_formula(tiny_run, target, dist_info):
    """`loss_normalization="micro_batch"` (the reference's): the step's gradient is (1/A) Σ_i ∇L_i, each L_i the
    micro-batch's own loss Σ w·term / Σ w; the default ("step") differs from it when the micro-batches carry
    different weight sums."""
    _, run_dir = tiny_run
    model_a, opt_a, _ = build(target, dist_info, sgd=True, lr=1.0)
    cfg = model_a.config
    mbs = [prepare_microbatch(mb, 0, cfg, torch.device("cpu")) for mb in microbatches(run_dir)]
    before = params(model_a)
    m_a = train_step(model_a, target, opt_a, mbs, grad_clip=1e9, loss_normalization="micro_batch")

    model_b, opt_b, _ = build(target, dist_info, sgd=True, lr=1.0)
    losses = []
    for batch, anchors, keep in mbs:  # the reference: each micro-batch alone, divided by A
        loss, _ = model_b(batch, target.features(batch["input_ids"], batch["attention_mask"]), anchors, keep)
        (loss / len(mbs)).backward()
        losses.append(float(loss.detach()))
    opt_b.step()
    assert m_a["sums"][0].item() == pytest.approx(sum(losses) / len(mbs), rel=1e-5)
    after_a, after_b = params(model_a), params(model_b)
    for k in after_a:
        torch.testing.assert_close(after_a[k] - before[k], after_b[k] - before[k], rtol=1e-4, atol=1e-7, msg=k)

    model_c, opt_c, _ = build(target, dist_info, sgd=True, lr=1.0)
    m_c = train_step(model_c, target, opt_c, mbs, grad_clip=1e9)  # default: one normalisation for the step
    from regen.train.loss import decay_weights, evaluation_mask

    w = [float((evaluation_mask(a, k, b["loss_mask"], cfg.block_size) * decay_weights(cfg.block_size)).sum())
         for b, a, k in mbs]
    assert w[0] != pytest.approx(w[1])  # unequal weights: the two rules weigh the micro-batches differently
    step_loss = sum(wi * li for wi, li in zip(w, losses)) / sum(w)
    assert m_c["sums"][0].item() == pytest.approx(step_loss, rel=1e-5)
    assert m_c["sums"][0].item() != pytest.approx(m_a["sums"][0].item(), rel=1e-4)
    with pytest.raises(ValueError, match="loss_normalization"):
        train_step(model_c, target, opt_c, mbs, loss_normalization="sequence")
