"""`--ray`: the same run split across two Ray actors (a loopback-only local Ray, stopped at the end) gives the
same rows as the local run."""
from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from conftest import conversations, fast_config, write_prompts

from regen.generate import ledger
from regen.generate.stage import run_generate
from regen.rundir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def rows(run: RunDir) -> dict:
    out = {}
    for p in ledger.part_paths(run.generations):
        for r in pq.read_table(p).to_pylist():
            out[(r["prompt_id"], r["turn"])] = (r["request_key"], r["status"], r["content"], r["reasoning_content"])
    return out


def test_ray_actors_give_the_same_result_as_local(server, tmp_path, monkeypatch):
    import psutil

    from regen.generate import ray_runner as ray_generate

    listeners = []
    original = ray_generate.init_ray

    def init_and_look(address, num_cpus=None):
        original(address, num_cpus)
        ours = {p.pid for p in psutil.Process().children(recursive=True)}
        listeners.extend(c.laddr.ip for c in psutil.net_connections(kind="inet")
                         if c.status == psutil.CONN_LISTEN and c.pid in ours)

    monkeypatch.setattr(ray_generate, "init_ray", init_and_look)
    convs = conversations(40)
    local, on_ray = RunDir.at(tmp_path / "local"), RunDir.at(tmp_path / "ray")
    write_prompts(local, convs)
    write_prompts(on_ray, convs)
    run_generate(fast_config(), local, endpoints=[server.base_url], progress=False)
    m = run_generate(fast_config(ray_actors=2), on_ray, endpoints=[server.base_url], ray_address="local", progress=False)
    assert m["accounting"]["balanced"] and m["ray"]
    assert rows(on_ray) == rows(local)
    writers = {e["writer"] for e in m["parts"]}
    assert writers == {"r0", "r1"}  # each actor wrote its own parts
    assert listeners and set(listeners) <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, listeners  # loopback only
    import ray

    assert not ray.is_initialized()
