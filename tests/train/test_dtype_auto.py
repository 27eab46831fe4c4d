"""`train.dtype` / `train.target_dtype: auto`: bf16 only where the CPU computes it natively."""
from __future__ import annotations

import pytest
import torch

from regen.config import load_profile
from regen.rundir import RunDir
from regen.train import trainer
from regen.train.loop import run_train
from regen.train.trainer import native_bf16, resolve_dtype

AVX2_EPYC = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma f16c bmi2\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16\n"
NEOVERSE = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_native_bf16_reads_the_cpu_flags():
    assert not native_bf16(AVX2_EPYC)
    assert native_bf16(SAPPHIRE) and native_bf16(NEOVERSE)
    assert not native_bf16("")


def test_auto_is_fp32_on_a_cpu_without_bf16_and_bf16_with_it(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(trainer, "native_bf16", lambda cpuinfo=None: False)
    assert resolve_dtype("auto", cpu) == torch.float32
    monkeypatch.setattr(trainer, "native_bf16", lambda cpuinfo=None: True)
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    assert resolve_dtype("float32", cpu) == torch.float32 and resolve_dtype("bfloat16", cpu) == torch.bfloat16


def test_the_local_profile_asks_for_auto():
    train = load_profile("local").train
    assert train.dtype == "auto" and train.target_dtype == "auto"


@pytest.mark.integration
def test_the_choice_is_in_the_summary_and_the_log(tiny_run, monkeypatch, caplog):
    monkeypatch.setattr(trainer, "native_bf16", lambda cpuinfo=None: False)
    profile, run_dir = tiny_run
    cfg = load_profile(str(profile), {"train.max_steps": 2, "train.dtype": "auto", "train.target_dtype": "auto"}).train
    with caplog.at_level("INFO"):
        s = run_train(cfg, RunDir.at(run_dir))
    assert s["dtype"] == {"draft": "float32", "target": "float32", "asked": ["auto", "auto"], "cpu_native_bf16": False}
    assert any("dtype: draft float32, target float32" in r.getMessage() for r in caplog.records)
