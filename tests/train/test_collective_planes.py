"""The control plane follows the default process group: planes left from a destroyed group are not used."""
from __future__ import annotations

import pytest
import torch

from regen.train import collectives
from regen.train.parallel import init_distributed


def test_planes_left_from_a_destroyed_group_are_not_used():
    import torch.distributed as dist

    from regen.train.parallel import destroy_distributed

    if dist.is_initialized():
        pytest.skip("a process group of another test module is up")
    init_distributed("cpu")
    assert collectives.is_set_up()
    dist.destroy_process_group()  # as some callers do, without destroy_distributed
    assert not collectives.is_set_up()
    init_distributed("cpu")
    assert collectives.is_set_up()
    assert collectives.control_all_reduce_sum(torch.ones(1), "x").tolist() == [1.0]
    destroy_distributed()
