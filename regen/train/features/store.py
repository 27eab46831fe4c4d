"""The Mooncake store that carries feature objects from producers to trainer ranks, and its master.

Data plane: Mooncake Store (kvcache-ai/Mooncake, PyPI `mooncake-transfer-engine-non-cuda` here, the CUDA/RDMA
build of the same family on GPU clusters). Objects are put with a hard pin (never evicted: an evicted feature
object would be a hole in the training data) and removed explicitly with `force` once consumed (a read grants a
lease that blocks plain removal, ../shared/docs/stack-notes.md "Mooncake store").

Memory: each trainer rank mounts a segment of its share of the byte budget, and a producer puts a micro-batch's
object with `preferred_segment` = the segment of the rank that will consume it, so the bytes travel once,
producer -> consumer's memory, and the consumer's read is local. Segments can also come from store nodes
(`regen features store`) that outlive a trainer. Metadata: Mooncake's P2P handshake (no metadata server to run).

`MooncakeMaster` starts `mooncake_master` on loopback (RPC and metrics ports on 127.0.0.1, chosen free) for local
runs and tests and stops it; on a cluster the user names an existing master (`train.producers.store.master`).
`store_metrics` reads the master's own Prometheus figures (`master_allocated_bytes`, ...), which is how resident
bytes are measured: from the store, not from a client's list of keys.

Listening: the master binds loopback here; a Mooncake *client* (every producer and trainer rank) opens its
transfer-engine and handshake listeners on all interfaces, a choice hard-coded in Mooncake 0.3.x
(`real_client.cpp`: `coro_rpc_server(..., "0.0.0.0")`). Local pools therefore run in a private network namespace
where the machine allows it (`regen.train.features.pool.loopback_only`).
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from regen.errors import InputError

log = logging.getLogger(__name__)

# Mooncake's ErrorCode (mooncake-store/include/types.h), the ones a feature store meets
ERROR_NAMES = {-1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND",
               -200: "NO_AVAILABLE_HANDLE (no segment has room)", -600: "INVALID_PARAMS (larger than the local "
               "buffer?)", -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE",
               -707: "LEASE_EXPIRED", -800: "TRANSFER_FAIL", -900: "RPC_FAIL", -901: "RPC_TIMEOUT"}
INSTALL_HINT = ("install Mooncake's store: `pip install mooncake-transfer-engine-non-cuda` (CPU machines; "
                "`mooncake-transfer-engine` on GPU clusters) and `apt-get install libibverbs1 librdmacm1`; "
                "`bash scripts/setup.sh` does both")


class StoreError(RuntimeError):
    """A store operation failed; `code` is Mooncake's error code."""

    def __init__(self, what: str, code: int):
        super().__init__(f"{what}: Mooncake error {code} {ERROR_NAMES.get(code, '')}".rstrip())
        self.code = code


def _mooncake():
    os.environ.setdefault("GLOG_minloglevel", "1")  # Mooncake logs every connection at INFO (glog)
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        from mooncake import store
    except ImportError as exc:
        raise InputError(f"the Mooncake store is not importable ({exc}): {INSTALL_HINT}") from None
    return store


def master_binary() -> str:
    """Path of `mooncake_master` (beside this interpreter, else on PATH). Raises InputError when absent."""
    here = Path(sys.executable).with_name("mooncake_master")
    found = str(here) if here.exists() else shutil.which("mooncake_master")
    if not found:
        raise InputError(f"mooncake_master not found beside {sys.executable} or on PATH: {INSTALL_HINT}")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the process that started it dies (Linux prctl PR_SET_PDEATHSIG), so
    a SIGKILLed trainer leaves no master or producer behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen | None = None, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise InputError(f"{what} exited with status {proc.returncode} before listening on {host}:{port}")
        try:
            socket.create_connection((host, port), 0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise InputError(f"{what} did not listen on {host}:{port} within {timeout_s:.0f} s")


class MooncakeMaster:
    """A `mooncake_master` on 127.0.0.1 with free RPC and metrics ports; `address` "127.0.0.1:P", `metrics_url`.

    Started by `start()`, stopped by `stop()` (or `with`); dies with the process that started it. Its log goes to
    `log_path` (it is verbose)."""

    def __init__(self, log_path: str | Path, *, host: str = "127.0.0.1"):
        self.host, self.log_path = host, Path(log_path)
        self.rpc_port = self.metrics_port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def start(self, timeout_s: float = 30.0) -> "MooncakeMaster":
        self.rpc_port, self.metrics_port = free_port(self.host), free_port(self.host)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [master_binary(), f"--rpc_port={self.rpc_port}", f"--rpc_address={self.host}",
               f"--metrics_host={self.host}", f"--metrics_port={self.metrics_port}",
               "--enable_http_metadata_server=false", "--rpc_thread_num=2"]
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=die_with_parent)
        try:
            wait_for_port(self.host, self.rpc_port, timeout_s, self.proc, f"mooncake_master (log {self.log_path})")
            wait_for_port(self.host, self.metrics_port, timeout_s, self.proc, "mooncake_master metrics")
        except BaseException:
            self.stop()
            raise
        log.info("mooncake master on %s (metrics %s), log %s", self.address, self.metrics_url, self.log_path)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self):
        return self.start() if self.proc is None else self

    def __exit__(self, *exc):
        self.stop()


def store_metrics(metrics_url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """The master's own gauges: {"allocated_bytes", "capacity_bytes", "key_count"} (Prometheus text at
    `metrics_url`, `master_allocated_bytes` etc.). Raises OSError when the master does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as r:
        text = r.read().decode()
    want = {"master_allocated_bytes": "allocated_bytes", "master_total_capacity_bytes": "capacity_bytes",
            "master_key_count": "key_count"}
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in want and not s.labels:
                out[want[s.name]] = float(s.value)
    return out


class StoreClient:
    """One process's connection to the store. `segment_bytes` > 0 mounts that much of this process's memory into the
    store (a trainer rank's share of the budget, or a store node); 0 is a pure client (a producer).
    `local_buffer_bytes` must hold the largest object this process puts or gets."""

    def __init__(self, master: str, *, segment_bytes: int = 0, local_buffer_bytes: int = 64 << 20,
                 protocol: str = "tcp", hostname: str = "127.0.0.1", device: str = "",
                 metadata: str = "P2PHANDSHAKE"):
        mc = _mooncake()
        self._mc = mc
        self.master, self.local_buffer_bytes = master, int(local_buffer_bytes)
        self.store = mc.MooncakeDistributedStore()
        rc = self.store.setup(hostname, metadata, int(segment_bytes), int(local_buffer_bytes), protocol, device,
                              master)
        if rc != 0:
            raise InputError(f"could not connect to the Mooncake master at {master} (setup returned {rc}): is it "
                             "running and reachable? (train.producers.store.master)")
        self.segment = self.store.get_hostname() if segment_bytes > 0 else None

    def put(self, key: str, parts: list, nbytes: int, *, preferred_segment: str | None = None) -> None:
        """Store `parts` (buffers, concatenated) under `key`, hard-pinned, near `preferred_segment` when given.
        Raises StoreError (e.g. NO_AVAILABLE_HANDLE when no segment has room)."""
        if nbytes > self.local_buffer_bytes:
            raise InputError(f"feature object {key} of {nbytes:,} bytes exceeds this process's Mooncake local "
                             f"buffer of {self.local_buffer_bytes:,}: raise train.producers.store.local_buffer_bytes")
        cfg = self._mc.ReplicateConfig()
        cfg.with_hard_pin = True
        if preferred_segment:
            cfg.preferred_segment = preferred_segment
        rc = self.store.put_parts(key, *parts, config=cfg)
        if rc != 0:
            raise StoreError(f"put {key} ({nbytes:,} bytes)", rc)

    def get(self, key: str):
        """(memoryview of the object, handle to keep alive while the view is used). Raises StoreError."""
        handle = self.store.get_buffer(key)
        if handle is None or not getattr(handle, "size", 0):
            raise StoreError(f"get {key}", -704)
        return memoryview(handle).cast("B"), handle

    def register(self, buf) -> None:
        """Register `buf` (a contiguous CPU uint8 tensor, pinned or not, kept alive by the caller) as a target of
        `get_into`. Raises StoreError."""
        rc = self.store.register_buffer(buf.data_ptr(), buf.numel())
        if rc != 0:
            raise StoreError(f"register a {buf.numel():,}-byte buffer", rc)

    def unregister(self, buf) -> None:
        self.store.unregister_buffer(buf.data_ptr())

    def size(self, key: str) -> int:
        """The stored object's bytes. Raises StoreError (absent)."""
        n = self.store.get_size(key)
        if n < 0:
            raise StoreError(f"size of {key}", n)
        return int(n)

    def get_into(self, key: str, buf, nbytes: int) -> None:
        """Read the object `key` of `nbytes` bytes straight into `buf` (a registered CPU uint8 tensor of at least
        `nbytes`): the store's one transfer, no client buffer and no copy after it (TorchSpec's `batch_get_into`).
        Raises StoreError (absent, or not `nbytes` long)."""
        n = self.store.get_into(key, buf.data_ptr(), int(nbytes))
        if n != nbytes:
            raise StoreError(f"get_into {key} ({nbytes:,} bytes expected, {n} read)", n if n < 0 else -704)

    def remove(self, keys: list[str]) -> list[int]:
        """Force-remove `keys` (a consumer's read lease does not block it); returns per-key codes (0 or -704)."""
        return list(self.store.batch_remove(list(keys), True)) if keys else []

    def remove_prefix(self, prefix: str) -> int:
        """Force-remove every object whose key starts with `prefix`; returns how many were removed."""
        import re

        n = self.store.remove_by_regex("^" + re.escape(prefix), True)
        return max(0, int(n))

    def close(self) -> None:
        if self.store is not None:
            try:
                self.store.close()
            finally:
                self.store = None


def env_for_children() -> dict:
    """The environment for processes that connect to a store: Mooncake's logs kept at warnings."""
    return {**os.environ, "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "WARNING"),
            "GLOG_minloglevel": os.environ.get("GLOG_minloglevel", "1")}
