"""A feature producer: leases micro-batches from the dispatcher, runs the target, puts their features in the store.

    python -m regen.train.features.producer --dispatcher http://HOST:PORT [--model DIR] [--device cuda:0]
    regen features produce --dispatcher http://HOST:PORT ...

This is the transformers producer (`engine: transformers`): the full target, loaded from a local directory with
`regen.train.target.TargetFeatures` (the same hooks and stream as in-process training), on `--device` (`cpu`,
`cuda:N`, or `auto` = transformers' `device_map="auto"` over every visible GPU, so one producer may own several
devices). The interface a producer of another engine (e.g. vLLM `extract_hidden_states` with a Mooncake connector)
must meet is small: register and heartbeat, lease, put one object per lease under the lease's key in the layout
of `regen.train.features.contract` (with `layer_id_convention` and `last_hidden_norm` saying what it computed),
then complete or fail the lease.

Loop: register (the dispatcher answers with the run's feature spec and store); refuse to run on a checkpoint whose
`target_revision` differs from the trainer's; heartbeat from a thread; lease -> forward -> put -> complete; a
failure (an exception, a micro-batch longer than `--max-len`) is reported and the loop goes on; `done` ends it.
A producer whose dispatcher is unreachable for `--orphan-timeout-s` exits (status 3); one whose dispatcher
restarted (a resumed run) registers again.
"""
from __future__ import annotations

import argparse
import base64
import logging
import os
import socket
import sys
import threading
import time

from regen.errors import InputError
from regen.train.features.dispatcher import post

log = logging.getLogger("regen.train.features.producer")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dispatcher", required=True, help="the trainer's dispatcher URL, e.g. http://10.0.0.5:7600")
    p.add_argument("--model", default=None, help="local target checkpoint (default: the trainer's train.target path)")
    p.add_argument("--device", default="cpu", help="cpu | cuda:N | auto (device_map=auto over the visible GPUs)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the run's feature dtype)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--max-len", type=int, default=0,
                   help="longest micro-batch (tokens per row) this producer runs; 0 = the model's "
                        "max_position_embeddings. Longer ones are failed back to the dispatcher")
    p.add_argument("--name", default="", help="a label for logs and the dispatcher's status")
    p.add_argument("--hostname", default=None,
                   help="the address this producer's store client announces (default: 127.0.0.1 when the store's "
                        "master is on loopback, else this host's address)")
    p.add_argument("--orphan-timeout-s", type=float, default=60.0,
                   help="exit when the dispatcher is unreachable this long (0 = wait for a new one forever)")
    p.add_argument("--connect-timeout-s", type=float, default=600.0, help="wait this long for the dispatcher")


class _Heartbeat(threading.Thread):
    def __init__(self, url: str, producer_id: str, period_s: float):
        super().__init__(name="producer-heartbeat", daemon=True)
        self.url, self.producer_id, self.period_s = url, producer_id, period_s
        self.stop_event = threading.Event()
        self.reregister = threading.Event()
        self.last_ok = time.monotonic()

    def run(self) -> None:
        while not self.stop_event.wait(self.period_s):
            try:
                r = post(self.url, "/heartbeat", {"producer_id": self.producer_id}, timeout_s=10)
                self.last_ok = time.monotonic()
                if r.get("reregister"):
                    self.reregister.set()
            except OSError:
                pass


class Producer:
    """One producer process's state: the target, the store client, the dispatcher connection."""

    def __init__(self, args):
        self.args = args
        self.url = args.dispatcher.rstrip("/")
        self.target = self.store = self.spec = None
        self.producer_id = None

    def info(self) -> dict:
        import torch
        import transformers

        return {"engine": "transformers", "engine_version": transformers.__version__, "torch": torch.__version__,
                "host": socket.gethostname(), "pid": os.getpid(), "name": self.args.name,
                "device": self.args.device}

    def _call(self, path: str, body: dict | None = None, timeout_s: float = 60.0) -> dict:
        """A dispatcher call that retries while the dispatcher is unreachable, up to --orphan-timeout-s."""
        t0 = time.monotonic()
        while True:
            try:
                return post(self.url, path, body, timeout_s=timeout_s)
            except OSError as exc:
                limit = self.args.orphan_timeout_s
                if limit and time.monotonic() - t0 > limit:
                    raise SystemExit(f"producer: dispatcher {self.url} unreachable for {limit:.0f} s ({exc}); exiting")
                time.sleep(1.0)

    def connect(self) -> dict:
        t0 = time.monotonic()
        while True:
            try:
                return post(self.url, "/config", timeout_s=10)
            except OSError:
                if time.monotonic() - t0 > self.args.connect_timeout_s:
                    raise InputError(f"dispatcher {self.url} did not answer within {self.args.connect_timeout_s:.0f} "
                                     "s: is the trainer running, and is --dispatcher its address?") from None
                time.sleep(1.0)

    def load(self, config: dict) -> None:
        import torch

        from regen.train.features.contract import FeatureSpec
        from regen.train.features.store import StoreClient
        from regen.train.target import TargetContract, TargetFeatures
        from regen.train.target_head import target_revision

        self.spec = FeatureSpec.from_dict(config["spec"])
        model = self.args.model or config["store"].get("target")
        if not model:
            raise InputError("no target checkpoint: pass --model DIR (the trainer did not name one)")
        revision = target_revision(model)
        if revision != self.spec.target_revision:
            raise InputError(f"producer: {model} is not the trainer's target checkpoint (target_revision "
                             f"{revision[:16]} vs {self.spec.target_revision[:16]}): point --model at the same files")
        if self.args.threads > 0:
            torch.set_num_threads(self.args.threads)
        dtype = getattr(torch, self.args.dtype or self.spec.dtype)
        if str(dtype).removeprefix("torch.") != self.spec.dtype:
            raise InputError(f"producer --dtype {self.args.dtype} but the trainer expects {self.spec.dtype} features")
        contract = TargetContract(self.spec.target_layer_ids, self.spec.aux_hidden_stream)
        if self.args.device == "auto":
            from transformers import AutoModelForCausalLM

            m = AutoModelForCausalLM.from_pretrained(model, local_files_only=True, dtype=dtype, device_map="auto")
            self.target = TargetFeatures(m, contract)
        else:
            self.target = TargetFeatures.from_pretrained(model, contract, dtype=dtype, device=self.args.device)
        tc = getattr(self.target.config, "text_config", None) or self.target.config
        self.max_len = self.args.max_len or int(getattr(tc, "max_position_embeddings", 0) or 0)
        st = config["store"]
        hostname = self.args.hostname or ("127.0.0.1" if st["master"].startswith(("127.", "localhost"))
                                          else socket.gethostbyname(socket.gethostname()))
        self.store = StoreClient(st["master"], segment_bytes=0, local_buffer_bytes=int(st["local_buffer_bytes"]),
                                 protocol=st.get("protocol", "tcp"), hostname=hostname)
        self.stream_reading = ("transformers forward hook: output of decoder layer L" if self.spec.aux_hidden_stream
                               == "prefix" else "transformers: input of layer L+1's post-attention norm "
                               "(regen.train.target's attn_res reading, not K3 AttnRes)")

    def register(self) -> None:
        r = self._call("/register", self.info())
        if r["config"]["spec"] != self.spec.to_dict():
            raise SystemExit(f"producer: the dispatcher at {self.url} now serves another feature spec "
                             f"({r['config']['spec']}); start a new producer for it")
        self.producer_id = r["producer_id"]
        log.info("registered as %s with session %s", self.producer_id, r["session"])

    def compute(self, item: dict):
        """(header, taps, last_hidden) of one leased micro-batch."""
        import numpy as np
        import torch

        from regen.train.features.contract import make_header

        B, S = item["shape"]
        if self.max_len and S > self.max_len:
            raise ValueError(f"micro-batch of {S} tokens per row is longer than this producer's max_len "
                             f"{self.max_len}")
        ids = torch.from_numpy(np.frombuffer(base64.b64decode(item["input_ids_b64"]), "<i4").reshape(B, S)
                               .astype("int64"))
        mask = torch.from_numpy(np.frombuffer(base64.b64decode(item["attention_mask_b64"]), "u1").reshape(B, S)
                                .astype(bool))
        dev = self.target.device
        taps, last = self.target.features(ids.to(dev), mask.to(dev))
        header = make_header(self.spec, epoch=item["epoch"], index=item["index"], attempt=item["attempt"],
                             sample_ids=item["sample_ids"], input_ids=ids, attention_mask=mask,
                             producer={"id": self.producer_id, **self.info()}, stream_reading=self.stream_reading)
        return header, taps.cpu(), last.cpu()

    def serve(self) -> int:
        from regen.train.features.contract import encode

        hb = _Heartbeat(self.url, self.producer_id, float(self.heartbeat_s))
        hb.start()
        try:
            while True:
                if hb.reregister.is_set():
                    hb.reregister.clear()
                    self.register()
                    hb.producer_id = self.producer_id
                r = self._call("/lease", {"producer_id": self.producer_id, "wait_s": 2.0})
                if r.get("done"):
                    log.info("the dispatcher has no more work: exiting")
                    return 0
                if r.get("reregister"):
                    self.register()
                    hb.producer_id = self.producer_id
                    continue
                item = r.get("item")
                if not item:
                    continue
                t0, c0 = time.monotonic(), time.process_time()
                try:
                    header, taps, last = self.compute(item)
                    parts, nbytes = encode(header, taps, last)
                    if nbytes != item["nbytes"]:
                        raise ValueError(f"object of {nbytes} bytes, the dispatcher budgeted {item['nbytes']}")
                    self.store.put(item["key"], parts, nbytes, preferred_segment=item.get("preferred_segment"))
                except Exception as exc:  # noqa: BLE001 - every failure is reported as a failed lease, not fatal
                    log.warning("micro-batch %s:%s failed: %s: %s", item["epoch"], item["index"],
                                type(exc).__name__, exc)
                    self._call("/fail", {"producer_id": self.producer_id, "lease_id": item["lease_id"],
                                         "reason": f"{type(exc).__name__}: {exc}"})
                    continue
                done = self._call("/complete", {"producer_id": self.producer_id, "lease_id": item["lease_id"],
                                                "key": item["key"], "header": header,
                                                "busy_s": time.monotonic() - t0,
                                                "cpu_s": time.process_time() - c0})
                if not done.get("ok"):
                    self.store.remove([item["key"]])
        finally:
            hb.stop_event.set()


def main(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    prod = Producer(args)
    config = prod.connect()
    prod.heartbeat_s = config.get("heartbeat_s", 1.0)
    prod.load(config)
    prod.register()
    try:
        return prod.serve()
    finally:
        if prod.store is not None:
            prod.store.close()


def script_main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s producer %(message)s", stream=sys.stderr)
    p = argparse.ArgumentParser(prog="regen features produce", description=__doc__.splitlines()[0])
    add_arguments(p)
    from regen.errors import exit_code

    return exit_code(lambda: main(p.parse_args(argv)), "regen features produce")


def exit_now(status: int) -> None:
    """End this producer process with `status` once its logs are flushed, without the interpreter's finalization:
    its work is reported and its store client closed (`main`), and tearing down the torch and transformers modules
    alone took 0.65 s of CPU per exit (2026-12-07, AMD EPYC with avx512_bf16), paid while the pool waits for every
    producer to end (`FeaturePool.end_local`)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_now(script_main())
