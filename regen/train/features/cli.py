"""`regen features`: the producer pool's processes, for clusters and for looking at a running pool.

    regen features produce --dispatcher http://HOST:PORT [--model DIR] [--device cuda:0]   one producer
    regen features produce-vllm --dispatcher URL --vllm-python VENV/bin/python             one vLLM producer
    regen features store --bytes 64GiB [--master HOST:PORT | --master local]               a store node
    regen features status --run runs/k3 [--out DIR] | --dispatcher URL                     a pool's status

`produce` is `regen.train.features.producer`, `produce-vllm` is `regen.train.features.vllm_producer`. `store` mounts
`--bytes` of this machine's memory into a Mooncake store (a node that holds feature objects and outlives any
trainer); with `--master local` it also starts a `mooncake_master` on 127.0.0.1 and prints its address. It prints
one JSON line {master, metrics_url, segment} once ready and runs until SIGTERM/SIGINT. `status` prints the
dispatcher's JSON status (items by state, producers, bytes), found through `<train dir>/features/dispatcher.json`.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from regen.config.units import parse_bytes
from regen.errors import InputError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from regen.train.features import producer, vllm_producer

    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    producer.add_arguments(sub.add_parser("produce", help="run one feature producer against a dispatcher"))
    vllm_producer.add_arguments(sub.add_parser("produce-vllm", help="run one producer whose engine is a vLLM "
                                               "server (extract_hidden_states)"))
    s = sub.add_parser("store", help="mount memory into a Mooncake store (and start a master on loopback)")
    s.add_argument("--bytes", required=True, help="memory to mount, e.g. 64GiB")
    s.add_argument("--master", default="local", help="host:port of a master, or `local` to start one on 127.0.0.1")
    s.add_argument("--hostname", default="127.0.0.1", help="the address this node announces")
    s.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"))
    st = sub.add_parser("status", help="print a running pool's dispatcher status")
    st.add_argument("--run", default=None, help="the run directory (reads <run>/train/features/dispatcher.json)")
    st.add_argument("--out", default=None, help="the training directory when not <run>/train")
    st.add_argument("--dispatcher", default=None, help="or the dispatcher's URL")


def _store(args) -> int:
    from regen.train.features.store import MooncakeMaster, StoreClient

    size = parse_bytes(args.bytes)
    master = None
    address, metrics = args.master, None
    if args.master == "local":
        master = MooncakeMaster(Path.cwd() / "mooncake_master.log").start()
        address, metrics = master.address, master.metrics_url
    client = StoreClient(address, segment_bytes=size, local_buffer_bytes=16 << 20, protocol=args.protocol,
                         hostname=args.hostname)
    print(json.dumps({"master": address, "metrics_url": metrics, "segment": client.segment, "bytes": size}),
          flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    try:
        done.wait()
    finally:
        client.close()
        if master is not None:
            master.stop()
    return 0


def _status(args) -> int:
    from regen.train.features.dispatcher import post

    url = args.dispatcher
    if url is None:
        if not args.run:
            raise InputError("give --run (or --out) or --dispatcher")
        path = Path(args.out or Path(args.run) / "train") / "features" / "dispatcher.json"
        if not path.exists():
            raise InputError(f"{path} not found: no producer pool has run in that training directory")
        url = json.loads(path.read_text())["url"]
    try:
        print(json.dumps(post(url, "/status"), indent=2))
    except OSError as exc:
        raise InputError(f"dispatcher {url} is not answering ({exc}): the trainer is not running") from None
    return 0


def main(args) -> int:
    if args.action in ("produce", "produce-vllm"):
        if args.action == "produce":
            from regen.train.features.producer import main as produce
        else:
            from regen.train.features.vllm_producer import main as produce

        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s producer %(message)s", stream=sys.stderr)
        return produce(args)
    return _store(args) if args.action == "store" else _status(args)
