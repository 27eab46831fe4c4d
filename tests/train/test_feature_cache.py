"""The in-process target's features kept per row (`train.feature_cache_gib`, regen.train.feature_cache): each row's
features are its own unbatched forward, read back unchanged on later epochs; a run with the cache equals, bit for bit,
a run whose cache keeps nothing, and is close to a run without it."""
from __future__ import annotations

import pytest
import torch

from regen.rundir import RunDir
from regen.train.feature_cache import CachedFeatures
from regen.train.loop import run_train
from regen.train.target import TargetContract, TargetFeatures


def _batch(rows: list[list[int]]) -> dict:
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r)
        mask[b, :len(r)] = True
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="module")
def target(tiny_target):
    t = TargetFeatures.from_pretrained(tiny_target, TargetContract(target_layer_ids=(0, 1, 2)))
    yield t
    t.close()


ROWS = [list(range(3, 40)), list(range(100, 120)), list(range(200, 231))]


def test_a_row_is_its_own_forward_padded_with_zeros_and_read_back_unchanged(target):
    cache = CachedFeatures(target, 1 << 30)
    batch = _batch(ROWS[:2])
    taps, last = cache.features_of(batch)
    ref_taps, ref_last = target.features(batch["input_ids"], batch["attention_mask"])
    assert taps.shape == ref_taps.shape and last.shape == ref_last.shape and taps.dtype == ref_taps.dtype
    for b, r in enumerate(ROWS[:2]):
        alone_taps, alone_last = target.features(torch.tensor([r]))
        assert torch.equal(taps[b, :len(r)], alone_taps[0]) and torch.equal(last[b, :len(r)], alone_last[0])
        # against the padded batch's forward: equal within the rounding of a batched matmul
        torch.testing.assert_close(taps[b, :len(r)], ref_taps[b, :len(r)], rtol=1e-5, atol=1e-5)
        assert not taps[b, len(r):].any() and not last[b, len(r):].any()  # padding: zeros
    assert cache.stats()["misses"] == 2 and cache.stats()["rows"] == 2 and cache.stats()["hits"] == 0

    # the second row again, now batched with a new one: read from the cache, the new one computed
    calls = []
    features = target.features
    target.features = lambda *a, **k: calls.append(a[0].shape) or features(*a, **k)
    try:
        taps2, last2 = cache.features_of(_batch([ROWS[2], ROWS[1]]))
    finally:
        del target.features
    assert calls == [torch.Size([1, len(ROWS[2])])]  # one forward: the new row alone
    n = len(ROWS[1])
    assert torch.equal(taps2[1, :n], taps[1, :n]) and torch.equal(last2[1, :n], last[1, :n])
    s = cache.stats()
    assert (s["hits"], s["misses"], s["rows"], s["uncached"]) == (1, 3, 3, 0)
    assert s["bytes"] == sum(len(r) for r in ROWS) * (taps.shape[-1] + last.shape[-1]) * taps.element_size()


def test_rows_past_the_budget_are_computed_every_time_and_counted(target):
    one_row = len(ROWS[0]) * (3 * 64 + 64) * 4  # taps of 3 layers + the last hidden state, fp32, hidden 64
    cache = CachedFeatures(target, one_row)
    for _ in range(2):
        taps, _ = cache.features_of(_batch(ROWS[:2]))
    s = cache.stats()
    assert (s["rows"], s["bytes"], s["hits"], s["misses"], s["uncached"]) == (1, one_row, 1, 3, 2)
    alone, _ = target.features(torch.tensor([ROWS[1]]))
    assert torch.equal(taps[1, :len(ROWS[1])], alone[0])
    with pytest.raises(ValueError, match="positive byte budget"):
        CachedFeatures(target, 0)


def test_an_empty_row_stays_zeros_and_the_counts_reduce_over_ranks(target):
    """A row of no tokens (train.min_loss_tokens 0 lets one through) is zeros, not a crash; the host copies of
    prepare_microbatch are used when the batch has them; stats(reduce) sums the counts as the trainer's control-plane
    all-reduce would (here: two ranks of the same counts)."""
    cache = CachedFeatures(target, 1 << 30)
    batch = _batch([ROWS[0], [9]])
    batch["attention_mask"][1] = False  # the second row: no token
    batch["host_input_ids"], batch["host_attention_mask"] = batch["input_ids"].clone(), batch["attention_mask"].clone()
    taps, last = cache.features_of(batch)
    assert not taps[1].any() and not last[1].any()
    assert torch.equal(taps[0], target.features(torch.tensor([ROWS[0]]))[0][0])
    empty = _batch([[9]])
    empty["attention_mask"][0] = False
    assert cache.features_of(empty)[0].shape == taps[:1, :1].shape  # all empty: the target's own batch path
    s = cache.stats(reduce=lambda counts: counts * 2)
    assert (s["rows"], s["misses"], s["hits"]) == (2, 2, 0) and s["capacity_bytes_per_rank"] == 1 << 30


def test_the_budget_in_bytes_the_config_and_the_plan():
    from regen.config import load_profile
    from regen.train.feature_cache import feature_cache_bytes
    from regen.train.features.plan import host_plan

    assert feature_cache_bytes(0) == 0 and feature_cache_bytes(1e-12) == 1 and feature_cache_bytes(2) == 2 << 30
    for bad in ("inf", "-inf", "nan", "-1", "lots"):
        with pytest.raises(Exception, match="feature_cache_gib"):
            load_profile("local", [f"train.feature_cache_gib={bad}"])
    local = load_profile("local").train
    host = host_plan(local, None, 1, producers=False)
    assert host["host_memory_per_gpu_gib"] == {"feature_cache": 2.0, "total": 2.0}
    assert "per rank" in host["host_memory_formulas"]["feature_cache"]
    off = host_plan(local.model_copy(update={"feature_cache_gib": 0.0}), None, 1, producers=False)
    assert off["host_memory_per_gpu_gib"] == {"total": 0.0}


def test_a_kept_row_whose_tokens_differ_under_the_same_key_is_recomputed(target):
    """A digest collision (forced here) never hands one row another row's features: the kept token ids are compared
    in full, and the row is computed and not kept."""
    cache = CachedFeatures(target, 1 << 30)
    cache.features_of(_batch([ROWS[0]]))
    (key, (ids, t, h)), = cache._rows.items()
    cache._rows[key] = (torch.tensor(ROWS[1] + ROWS[1][:len(ROWS[0]) - len(ROWS[1])]), t, h)  # same key, other ids
    taps, _ = cache.features_of(_batch([ROWS[0]]))
    assert torch.equal(taps[0], target.features(torch.tensor([ROWS[0]]))[0][0])
    assert cache.stats()["uncached"] == 1 and cache.stats()["hits"] == 0


@pytest.mark.integration
def test_a_run_with_the_cache_equals_one_whose_cache_keeps_nothing_and_is_close_to_one_without(tmp_path, tiny_target):
    """Three runs of 12 steps over 12 rows (4 epochs): the cache's hits replace the target's forwards, the weights
    equal bit for bit those of a run whose budget keeps no row (every row computed alone, every time), and the losses
    follow a run without the cache within the rounding of a batched forward."""
    from safetensors.torch import load_file
    from test_train import train_cfg
    from train_helpers import ShardWriter, make_rows, write_profile

    def run(name: str, gib: float) -> tuple[dict, dict]:
        writer = ShardWriter(tmp_path / name)
        writer.add(make_rows(12, seed=3), complete=True)
        profile = write_profile(tmp_path / f"{name}.yaml", tiny_target, max_batch=4, shuffle_buffer=4, bucket_window=4)
        # fp32 on every CPU: `dtype` and `target_dtype: auto` are bf16 where the CPU has AVX-512 BF16, and the batched
        # forward of the run without the cache then differs from the per-row one by bf16 rounding, not by 1e-3
        s = run_train(train_cfg(profile, max_steps=12, feature_cache_gib=gib, dtype="float32",
                                target_dtype="float32"),
                      RunDir.at(tmp_path / name))
        return s, load_file(s["checkpoint"] + "/model.safetensors")

    cached, w_cached = run("cached", 1.0)
    nothing_kept, w_nothing = run("nothing-kept", 1e-9)
    plain, w_plain = run("plain", 0.0)
    assert cached["feature_cache"]["misses"] == 12 and cached["feature_cache"]["rows"] == 12
    assert cached["feature_cache"]["hits"] == 3 * 12  # epochs 2-4 read every row back
    assert nothing_kept["feature_cache"]["rows"] == 0 and nothing_kept["feature_cache"]["misses"] == 4 * 12
    assert "feature_cache" not in plain
    assert w_cached.keys() == w_nothing.keys() == w_plain.keys()
    for k in w_cached:
        assert torch.equal(w_cached[k], w_nothing[k]), k
        torch.testing.assert_close(w_cached[k], w_plain[k], rtol=1e-3, atol=1e-4, msg=k)
    for a, b in zip(cached["history"], plain["history"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"]), (a, b)


@pytest.mark.integration
@pytest.mark.parametrize("attention_type,fc_norm", [("mla", False), ("gqa", True)])
def test_the_features_of_padded_positions_never_reach_the_loss(tmp_path, tiny_target, monkeypatch, attention_type,
                                                                fc_norm):
    """The cache pads with zeros where the batched forward computes the padding tokens' states: two runs over rows
    of different lengths (4 to a micro-batch, so every micro-batch is padded), one with the target's features at
    padded positions zeroed, end with the same weights bit for bit."""
    from safetensors.torch import load_file
    from test_train import train_cfg
    from train_helpers import ShardWriter, make_rows, write_profile

    features_of = TargetFeatures.features_of

    def run(name: str, zero_padding: bool) -> dict:
        def patched(self, batch):
            taps, last = features_of(self, batch)
            if zero_padding:
                keep = batch["attention_mask"][..., None]
                taps, last = taps * keep, last * keep
            return taps, last

        monkeypatch.setattr(TargetFeatures, "features_of", patched)
        ShardWriter(tmp_path / name).add(make_rows(12, seed=3), complete=True)
        profile = write_profile(tmp_path / f"{name}.yaml", tiny_target, max_batch=4, shuffle_buffer=4, bucket_window=4,
                                attention_type=attention_type, fc_norm=fc_norm, draft_vocab_size=128)
        s = run_train(train_cfg(profile, max_steps=6), RunDir.at(tmp_path / name))
        return load_file(s["checkpoint"] + "/model.safetensors")

    padded, zeroed = run("padded", False), run("zeroed", True)
    assert padded.keys() == zeroed.keys()
    for k in padded:
        assert torch.equal(padded[k], zeroed[k]), k


@pytest.mark.integration
def test_two_ranks_count_every_row_they_saw_and_train_as_one_rank_does(tmp_path, tiny_target):
    """torchrun, 2 ranks in process, each with its own cache: the summary's counts are summed over the ranks (every
    row a rank saw is a hit or a miss), and the weights equal one rank's with grad_accum 2 to rounding."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from safetensors.torch import load_file
    from train_helpers import ShardWriter, make_rows, one_torch_thread, write_profile

    from regen.config import load_profile

    ShardWriter(tmp_path / "one").add(make_rows(16, seed=3), complete=True)
    shutil.copytree(tmp_path / "one" / "shards", tmp_path / "two" / "shards")
    profile = write_profile(tmp_path / "p.yaml", tiny_target, max_batch=4, shuffle_buffer=4, bucket_window=4)
    common = ["train.max_steps=6", "train.dtype=float32", "train.target_dtype=float32", "train.feature_cache_gib=1"]
    with one_torch_thread():
        one = run_train(load_profile(str(profile), common + ["train.grad_accum=2"]).train, RunDir.at(tmp_path / "one"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "regen.train",
           "--", "--profile", str(profile), "--run", str(tmp_path / "two")]
    for s in common + ["train.grad_accum=1"]:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "train" / "summary.json").read_text())
    seen = 6 * 2 * 4  # steps x micro-batches a step (one per rank, or grad_accum 2) x rows in each
    for s in (one["feature_cache"], two["feature_cache"]):
        assert s["hits"] + s["misses"] == seen and s["misses"] == s["rows"] >= 16 and s["uncached"] == 0, s
    a, b = load_file(one["checkpoint"] + "/model.safetensors"), load_file(two["checkpoint"] + "/model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
