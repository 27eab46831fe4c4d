"""`regen generate --ray ADDRESS|auto|local`: the same run split across Ray actors.

Actor i of n takes the prompts with `regen.generate.runner.in_shard(prompt_id, (i, n))` (a hash of the id), runs
its own `regen.generate.runner.Runner` (one async client per actor, on its own node with SPREAD scheduling) and
writes its own parts and journal as writer `r<i>` under the exactly-once rules of `regen.generate.ledger`. The
generations directory must be on storage every node sees (a shared filesystem). The driver merges the actors' metrics
and writes the manifest.

Addresses: `auto` connects to the running cluster (RAY_ADDRESS or a local head), starting a loopback-only
local one when there is none; `local` always starts one; anything else is a cluster address. A Ray started
here listens on 127.0.0.1 only (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, see ../shared/docs/stack-notes.md, "Ray"),
has no dashboard and no usage stats, and is shut down at the end. On one small machine Ray is overhead;
it is never the default.
"""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from regen.config.generate import GenerateConfig
from regen.generate.metrics import ProgressLine

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def init_ray(address: str, num_cpus: int | None = None) -> None:
    """Connect to (or start, on loopback) a Ray cluster; see module doc for the address forms."""
    for k, v in LOOPBACK_ENV.items():
        os.environ[k] = v  # inherited by the Ray processes started here
    import ray
    from ray._private import ray_constants

    # The variable is read when ray is imported; a process that imported ray before (a test session) needs
    # the constant itself set, or the node binds every interface.
    ray_constants.ENABLE_RAY_CLUSTER = False
    if address not in ("auto", "local"):
        ray.init(address=address, log_to_driver=False)
        return
    if address == "auto":
        try:
            ray.init(address="auto", log_to_driver=False)
            return
        except (ConnectionError, RuntimeError):
            pass
    ray.init(include_dashboard=False, num_cpus=num_cpus, log_to_driver=False, _node_ip_address="127.0.0.1")


def _actor_class():
    import ray

    @ray.remote(max_concurrency=2)
    class GenerateActor:
        """One writer: a Runner over its shard in its own event loop; `progress()` is callable meanwhile."""

        def __init__(self):
            self.runner = None

        def run(self, cfg_json: str, gen_dir: str, files: list[str], endpoints: list[str], api_key: str | None,
                writer: str, shard: tuple[int, int]) -> dict:
            from regen.generate.runner import Runner

            cfg = GenerateConfig.model_validate_json(cfg_json)
            self.runner = Runner(cfg, Path(gen_dir), [Path(f) for f in files], endpoints, api_key, writer,
                                 tuple(shard), progress=False)
            summary = asyncio.run(self.runner.run())
            summary["endpoints"] = getattr(self.runner, "endpoint_summary", [])
            summary["throughput"] = self.runner.metrics.throughput_rows()
            return summary

        def progress(self) -> tuple[int, int, dict, int]:
            r = self.runner
            if r is None:
                return 0, 0, {"req_per_s": 0.0, "out_tok_per_s": 0.0, "failures": {}}, 0
            in_flight = r.client.in_flight if r.client is not None else 0
            return r.done_units, r.total_units, {**r.metrics.snapshot(), "limit": r._limit()}, in_flight

    return GenerateActor


def run_on_ray(cfg: GenerateConfig, gen_dir: Path, files: list[Path], endpoints: list[str], api_key: str | None,
               address: str, progress: bool = True) -> list[dict]:
    """Run every shard on Ray actors; returns their metrics summaries (with `throughput` rows)."""
    import ray

    actors_wanted = cfg.ray_actors or None
    init_ray(address, num_cpus=max(2, actors_wanted or 2) if address in ("auto", "local") else None)
    try:
        n = actors_wanted or max(1, len([nd for nd in ray.nodes() if nd.get("Alive")]))
        Actor = _actor_class()
        actors = [Actor.options(scheduling_strategy="SPREAD", num_cpus=0).remote() for _ in range(n)]
        quiet = cfg.model_copy(update={"progress_interval_s": 0})  # the driver prints the whole run's line
        refs = [a.run.remote(quiet.model_dump_json(), str(gen_dir), [str(f) for f in files], endpoints, api_key,
                             f"r{i}", (i, n)) for i, a in enumerate(actors)]
        bar = None
        pending = list(refs)
        last: dict[int, tuple] = {}  # actor index -> its last progress state (a finished or dead actor keeps its last)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            if progress or cfg.progress_interval_s > 0:  # the actors print none (their cfg: interval 0)
                # only actors still running are asked: a dead actor's call would raise here and end the session
                # while the others still work (its own error comes from ray.get(refs) once the others are done)
                asked = {i: actors[i].progress.remote() for i, r in enumerate(refs) if r in pending}
                for i, ref in asked.items():
                    try:
                        last[i] = ray.get(ref)
                    except ray.exceptions.RayError:
                        pass
                states = list(last.values())
                done, total = sum(s[0] for s in states), sum(s[1] for s in states)
                if bar is None and total:
                    bar = ProgressLine(total, done, progress, cfg.progress_interval_s)
                if bar is not None:
                    snap = {"req_per_s": sum(s[2]["req_per_s"] for s in states),
                            "out_tok_per_s": sum(s[2]["out_tok_per_s"] for s in states), "failures": {}}
                    for s in states:
                        for k, v in s[2]["failures"].items():
                            snap["failures"][k] = snap["failures"].get(k, 0) + v
                    limits = [s[2].get("limit") for s in states]
                    bar.update(done, snap, sum(s[3] for s in states),
                               sum(limits) if all(x is not None for x in limits) else None)
        if bar is not None:
            bar.close()
        return ray.get(refs)
    finally:
        ray.shutdown()
        time.sleep(0.1)
