"""bench/draft_probe.py: what a draft uses (backbone, Markov bigram, context features), read teacher-forced."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_helpers import ShardWriter, make_rows, write_profile

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("draft_probe", ROOT / "bench" / "draft_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def setup(tiny_target):
    from transformers import AutoConfig

    from regen.config import load_profile
    from regen.train.draft_config import build_draft_config
    from regen.train.model import DSparkDraft
    from regen.train.target import TargetContract, TargetFeatures

    cfg = load_profile(str(write_profile(Path(tiny_target).parent / "probe.yaml", tiny_target)), {}).train
    dc = build_draft_config(cfg, AutoConfig.from_pretrained(str(tiny_target)))
    target = TargetFeatures.from_pretrained(tiny_target, TargetContract.from_draft_config(dc))
    torch.manual_seed(0)
    draft = DSparkDraft.from_target(target.model, dc).eval()
    rows = [{"input_ids": r["input_ids"], "loss_mask": [False] * r["loss_spans"][0]["start"]
             + [True] * (r["num_tokens"] - r["loss_spans"][0]["start"])} for r in make_rows(6, seed=3)]
    return draft, target, rows


@pytest.mark.integration
def test_probe_reads_each_part_of_the_draft(setup):
    draft, target, rows = setup
    bench = _bench()
    unsupervised = {"input_ids": rows[0]["input_ids"], "loss_mask": [False] * len(rows[0]["input_ids"])}
    out = bench.probe(draft, target, rows + [unsupervised])
    assert out["num_rows"] == len(rows)  # a row without a supervised anchor is not counted as probed
    K = draft.config.block_size
    assert set(out["slots"]) == set(bench.VARIANTS) and all(len(v) == K for v in out["slots"].values())
    assert all(0.0 <= x <= 1.0 for v in out["slots"].values() for x in v)
    assert out["num_slots"][0] >= out["num_slots"][-1] > 0  # a supervised prefix per block
    (layer,) = out["attention"]["layers"]
    total = layer["own_block"] + sum(layer["distance"].values())
    assert total == pytest.approx(1.0, abs=1e-4)  # slot 1 attends to its visible context and its own block only
    # the probe's explicit attention is the model's: the draft's outputs are unchanged under it
    ids = torch.tensor([rows[0]["input_ids"]])
    taps, _ = target.features(ids, torch.ones_like(ids))
    anchors = torch.tensor([[5, 9]])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    with torch.no_grad():
        plain = draft(taps, ids, anchors, keep)
        with bench.recorded_attention([]) as store:
            patched = draft(taps, ids, anchors, keep)
    assert len(store) == 1 and torch.allclose(plain, patched, atol=1e-5)
    # anchors in chunks (bounded memory on long rows) give the same figures: blocks never see each other
    chunked = bench.probe(draft, target, rows, chunk=3)
    assert chunked["num_blocks"] == out["num_blocks"] and chunked["num_slots"] == out["num_slots"]
    for v in bench.VARIANTS:
        assert chunked["slots"][v] == pytest.approx(out["slots"][v])
    assert chunked["attention"]["layers"][0]["distance"] == pytest.approx(layer["distance"], abs=1e-6)
    with torch.no_grad():
        assert torch.equal(draft(taps, ids, anchors, keep), plain)  # restored after the block
    from regen.train import layers

    q = torch.zeros(1, 1, 2, 4)
    with bench.recorded_attention([]), pytest.raises(NotImplementedError, match="is_causal"):
        layers.F.scaled_dot_product_attention(q, q, q, is_causal=True)  # not what the draft's layers call


@pytest.mark.integration
def test_probe_variants_separate_the_parts(setup):
    """Without the Markov head's output the draft is its backbone; with its context masked out the draft reads no
    target feature, so other features leave that variant's figures unchanged."""
    import copy

    draft, target, rows = setup
    bench = _bench()
    no_markov = copy.deepcopy(draft)
    torch.nn.init.zeros_(no_markov.markov_head.markov_w2.weight)
    out = bench.probe(no_markov, target, rows)
    assert out["slots"]["draft"] == out["slots"]["backbone"]

    class NoisyFeatures:  # the same target, its tap features replaced by noise
        def __init__(self, target):
            self.target = target

        def features(self, ids, mask):
            taps, last = self.target.features(ids, mask)
            return torch.randn(taps.shape, generator=torch.Generator().manual_seed(ids.shape[1])), last

        def logits(self, last):
            return self.target.logits(last)

    real, noisy = bench.probe(draft, target, rows), bench.probe(draft, NoisyFeatures(target), rows)
    assert noisy["slots"]["no_context"] == real["slots"]["no_context"]
    assert noisy["slots"]["markov"] == real["slots"]["markov"]


@pytest.mark.integration
def test_probe_command(tmp_path, tiny_target):
    from transformers import AutoConfig

    from regen.config import load_profile
    from regen.train.draft_config import build_draft_config
    from regen.train.model import DSparkDraft, save_draft
    from regen.train.target import TargetContract, TargetFeatures

    run = tmp_path / "run"
    ShardWriter(run).add(make_rows(12, seed=1), complete=True)
    profile = write_profile(tmp_path / "tiny.yaml", tiny_target, heldout_fraction=0.5)
    cfg = load_profile(str(profile), {}).train
    dc = build_draft_config(cfg, AutoConfig.from_pretrained(str(tiny_target)))
    target = TargetFeatures.from_pretrained(tiny_target, TargetContract.from_draft_config(dc))
    save_draft(DSparkDraft.from_target(target.model, dc), tmp_path / "draft")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "bench" / "draft_probe.py"), "--run", str(run), "--profile", str(profile),
           "--draft", str(tmp_path / "draft"), "--rows", "4"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "slot-1 attention" in proc.stdout and "draft / draft with context masked out" in proc.stdout
    assert (tmp_path / "draft" / "probe-heldout.json").exists()
    proc = subprocess.run(cmd[:-4] + ["--draft", str(tmp_path / "nowhere")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--draft" in proc.stderr
    nothing_held = write_profile(tmp_path / "all-trained.yaml", tiny_target, heldout_fraction=0.0)
    proc = subprocess.run(cmd[:4] + ["--profile", str(nothing_held)] + cmd[6:], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "heldout_fraction is 0" in proc.stderr and "Traceback" not in proc.stderr
