"""Shared test fixtures. Stage-specific fixtures live in tests/<stage>/conftest.py."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
POOL = REPO_ROOT / "data" / "pool"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The embedded target's prepared model directory (made by scripts/setup.sh), used by tests/target and the
    draft-serving tests of tests/serve."""
    from regen.config import resolve_path
    from regen.config.serve import ServeConfig

    path = resolve_path(ServeConfig().model_dir)
    if not (path / "model.safetensors").exists():
        pytest.fail(f"{path} is missing: run `bash scripts/setup.sh` (it calls `python -m regen.target.prepare_model`)")
    return path


@pytest.fixture(scope="session")
def pool_dir() -> Path:
    """`data/pool`: the first rows of every file of the public prompt sets (its SOURCES.md), in the repository."""
    return POOL


# The quick tier (`pytest -m quick`, docs/development.md): every test marked neither `slow` (starts a real server or
# model end to end) nor `integration` (starts processes or trains: seconds to a minute each). Computed here so that
# a new test joins the quick tier by default and leaves it by one marker.
HEAVY_MARKERS = ("slow", "integration")


# On test workers (pytest -n N, `--dist loadscope --no-loadscope-reorder` in addopts) each module runs whole on one
# worker, so its module fixtures are built once, and modules are handed out in collection order: the longest go
# first (each over 100 s of worker time in the 2026-12-07 run, docs/development.md), so that no worker starts one
# while the other is nearly done. The rest keep their order.
LONGEST_FIRST = ("serve/test_spec_roundtrip.py", "serve/test_spec_roundtrip_fc_norm.py", "train/test_producers.py",
                 "train/test_vllm_producer.py", "serve/test_endpoint_vllm.py", "e2e/test_local_pipeline.py",
                 "train/test_train_faults.py", "e2e/test_loop.py", "flows/test_deployments.py")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects (the mark plugin's own hook)
def pytest_collection_modifyitems(items):
    for item in items:
        if not any(item.get_closest_marker(name) for name in HEAVY_MARKERS):
            item.add_marker(pytest.mark.quick)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda it: rank.get(it.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))


def pytest_configure(config):
    """Under pytest-xdist (`-n N`) each worker gets its share of the cores: torch's intra-op threads, and the
    OMP_NUM_THREADS its subprocesses inherit, set to cores // workers (at least 1), so that the workers' threads
    together do not outnumber the cores."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if not workers:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch

    torch.set_num_threads(threads)
