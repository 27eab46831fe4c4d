"""Run under torchrun (2 ranks, gloo) by tests/train/test_collectives.py: the feature fetch's any-rank-failed
agreement with the hot plane declared NCCL (REGEN_TRAIN_DECLARE_BACKEND=nccl) and a hot-plane timeout far
shorter than the failing rank's wait. Writes <out>/rank<R>.json: what each rank saw."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

from regen.errors import InputError
from regen.train import collectives
from regen.train.features.pool import FeaturePool
from regen.train.parallel import destroy_distributed, init_distributed


class Features:
    """A feature source whose fetch fails on rank 1 after `wait_s` (a producer timeout), at once elsewhere."""

    def __init__(self, fail_rank: int | None, wait_s: float):
        self.fail_rank, self.wait_s = fail_rank, wait_s

    def fetch(self, microbatches):
        if dist.get_rank() == self.fail_rank:
            time.sleep(self.wait_s)
            raise InputError("no producer for 120 s (train.producers.no_producer_timeout_s)")
        return []


def main(out: str, hot_timeout_s: float, control_timeout_s: float, wait_s: float) -> None:
    info = init_distributed("cpu", timeout_s=hot_timeout_s, control_timeout_s=control_timeout_s)
    rec = {"rank": info.rank, "declared": collectives.planes().declared}
    pool = FeaturePool()
    pool.info = info
    pool.features = Features(None, 0.0)
    rec["first"] = sorted(pool.fetch_step([]))  # every rank fine: nothing zeroed
    pool.features = Features(1, wait_s)
    t0 = time.monotonic()
    try:
        pool.fetch_step([])
        rec["second"] = "no error"
    except InputError as exc:
        rec["second"] = f"InputError: {exc}"
    except Exception as exc:  # noqa: BLE001 - a timeout of the wrong plane is what the test looks for
        rec["second"] = f"{type(exc).__name__}: {exc}"
    rec["waited_s"] = time.monotonic() - t0
    Path(out, f"rank{info.rank}.json").write_text(json.dumps(rec))
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1], *map(float, sys.argv[2:5]))
