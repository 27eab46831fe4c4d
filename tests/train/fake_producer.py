"""A stand-in feature producer for tests/train/test_producer_roster.py: speaks the dispatcher's HTTP protocol
with the standard library only (no torch, no target, no store), so it starts in a few tens of milliseconds and
stops exactly where a test wants it killed.

    python fake_producer.py URL NAME ACTION...

Actions, in order: `register`; `lease` (long-polls until it holds a lease); `complete` (the lease it holds, an
object it never wrote: the stand-in store has none); `wait-dead` (polls /status until the dispatcher declared this
registration dead; it sends nothing that would count as a heartbeat); `serve` (lease and complete until the
dispatcher says there is no more work, registering again when told); `block` (sleeps until killed). After the
last action it exits with status 0.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.request


def post(url: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def main(url: str, name: str, actions: list[str]) -> int:
    info = {"engine": "fake", "engine_version": "0", "host": socket.gethostname(), "pid": os.getpid(), "name": name}
    pid = item = None
    for action in actions:
        if action == "register":
            pid = post(url, "/register", info)["producer_id"]
        elif action == "lease":
            while item is None:
                item = post(url, "/lease", {"producer_id": pid, "wait_s": 1.0}).get("item")
        elif action == "complete":
            post(url, "/complete", {"producer_id": pid, "lease_id": item["lease_id"], "key": item["key"],
                                    "header": {"fake": True}, "busy_s": 0.01})
            item = None
        elif action == "wait-dead":
            while not any(p["id"] == pid and p["state"] == "dead" for p in post(url, "/status")["producers"]):
                time.sleep(0.05)
        elif action == "serve":
            while True:
                r = post(url, "/lease", {"producer_id": pid, "wait_s": 1.0})
                if r.get("done"):
                    break
                if r.get("reregister"):
                    pid = post(url, "/register", info)["producer_id"]
                elif r.get("item"):
                    it = r["item"]
                    post(url, "/complete", {"producer_id": pid, "lease_id": it["lease_id"], "key": it["key"],
                                            "header": {"fake": True}, "busy_s": 0.01})
        elif action == "block":
            while True:
                time.sleep(60)
        else:
            raise SystemExit(f"fake_producer: unknown action {action!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
