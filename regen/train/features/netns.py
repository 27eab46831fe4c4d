"""Local producer pools in a private network namespace: only loopback, so nothing they open is on the network.

A Mooncake client (every trainer rank and producer) opens its transfer-engine and handshake listeners on all
interfaces, hard-coded in Mooncake 0.3.x (`real_client.cpp`: `coro_rpc_server(1, 0, "0.0.0.0")`), and the master's
optional HTTP metadata server does the same. A local run (`train.producers.store.master: local`, one machine)
needs nothing but loopback, so `regen train` and `regen run` run such a trainer (with its master and producers) as
a child in a new network namespace with only `lo` up (`unshare --net`, as root or in a user namespace), where those
listeners exist for nothing outside. Where the kernel refuses namespaces, the run goes on in place with a warning
naming the listeners. On a cluster the listeners are the point (producers and trainers on different nodes), and
the network's own isolation applies.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)
ENV_FLAG = "REGEN_NETNS"  # set inside the namespace: do not wrap again


@functools.lru_cache(maxsize=1)
def _prefix() -> tuple[str, ...] | None:
    """The command prefix that runs a command with only `lo` up, or None when this machine cannot make one."""
    if not shutil.which("unshare") or not shutil.which("ip"):
        return None
    for extra in ((), ("--map-root-user",)):
        cmd = ("unshare", "--net", *extra, "sh", "-c", 'ip link set lo up && exec "$@"', "sh")
        try:
            ok = subprocess.run([*cmd, "true"], capture_output=True, timeout=20).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return cmd
    return None


def loopback_only(cmd: list[str]) -> list[str] | None:
    """`cmd` wrapped to run in a fresh network namespace with only loopback up, or None where impossible."""
    prefix = _prefix()
    return None if prefix is None else [*prefix, *cmd]


def should_isolate(cfg) -> bool:
    """True for a one-machine producer run that is not already isolated and not one rank of torchrun's (its ranks
    must share a namespace: wrap torchrun itself, docs/train.md, "Training at scale")."""
    return (cfg.features == "producers" and cfg.producers.store.master == "local"
            and os.environ.get(ENV_FLAG) != "1" and "TORCHELASTIC_RUN_ID" not in os.environ
            and int(os.environ.get("WORLD_SIZE", "1")) == 1)


def run_train_isolated(cfg, run, *, follow: bool = False, train_dir: str | Path | None = None) -> int | None:
    """Run `python -m regen.train` with exactly `cfg` on `run` in a private network namespace and return its exit
    status (its summary is `<train dir>/summary.json`), or None when this machine cannot make a namespace (the
    caller then trains in place)."""
    import yaml

    cfg = cfg.model_copy(update={"seed": cfg.seed if cfg.seed is not None else 0})  # as run_train reads it
    out = Path(train_dir) if train_dir else Path(run.train)
    profile = out / "features" / "train-profile.yaml"
    profile.parent.mkdir(parents=True, exist_ok=True)
    profile.write_text(yaml.safe_dump({"name": "train", "train": json.loads(cfg.model_dump_json())}))
    cmd = [sys.executable, "-m", "regen.train", "--profile", str(profile), "--run", str(run.root),
           "--responses", run.responses, "--out", str(out)]
    if follow:
        cmd.append("--follow")
    wrapped = loopback_only(cmd)
    if wrapped is None:
        log.warning("no network namespace on this machine: the Mooncake clients of this local producer pool listen "
                    "on all interfaces (Mooncake 0.3 hard-codes 0.0.0.0)")
        return None
    log.info("training with a local producer pool in a private network namespace (only loopback)")
    return subprocess.run(wrapped, env={**os.environ, ENV_FLAG: "1"}).returncode
