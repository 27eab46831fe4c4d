"""Scenarios that need several processes on one private loopback network; run by the tests inside a network
namespace (`regen.train.features.netns.loopback_only`) and print one JSON line of results.

    python feature_drivers.py roundtrip TARGET SHARDS_DIR DTYPE... features through the store vs in process, each
                                                                    case (a triple) in turn through one master
    python feature_drivers.py resume PROFILE RUN_A RUN_B           killed-and-resumed run vs uninterrupted,
                                                                    with a store node that outlives the trainer
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def roundtrip(*args: str) -> list[dict]:
    """Each case (the triple TARGET SHARDS_DIR DTYPE) in turn through one Mooncake master: each case's figures
    (`_roundtrip_one`), in order. One process and one master for every case: each would otherwise pay its own
    interpreter, imports and master."""
    from regen.train.features.store import MooncakeMaster

    cases = [args[i:i + 3] for i in range(0, len(args), 3)]
    with MooncakeMaster(Path(cases[0][1]).parent / "master.log") as master:
        return [_roundtrip_one(master, *case) for case in cases]


def _roundtrip_one(master, target: str, shards: str, dtype: str) -> dict:
    """Each micro-batch of the feed: a producer-side TargetFeatures -> contract.encode -> store put (pure client)
    -> store get (the consumer's segment) -> decode, against a separately loaded in-process TargetFeatures."""
    import torch

    from regen.train.features.contract import FeatureSpec, check_header, decode, encode, make_header, read_header
    from regen.train.features.store import StoreClient
    from regen.train.feed import FeedConfig, ShardFeed
    from regen.train.target import TargetContract, TargetFeatures
    from regen.train.target_head import target_revision

    dt = getattr(torch, dtype)
    producer_side = TargetFeatures.from_pretrained(target, TargetContract((0, 1, 2)), dtype=dt)
    trainer_side = TargetFeatures.from_pretrained(target, TargetContract((0, 1, 2)), dtype=dt)
    tc = producer_side.config.get_text_config()
    spec = FeatureSpec("regen/roundtrip", (0, 1, 2), "prefix", dtype, tc.hidden_size, tc.num_hidden_layers,
                       target_revision(target))
    feed = ShardFeed(shards, FeedConfig(max_len=64, max_tokens=256, max_batch=4, min_loss_tokens=4))
    out = {"microbatches": 0, "equal": 0, "max_abs_diff": 0.0, "alone_differs": 0, "rows": 0}
    consumer = StoreClient(master.address, segment_bytes=64 << 20)
    producer = StoreClient(master.address, segment_bytes=0)
    for step in feed.steps(1):
        for mb in step.microbatches:
            taps, last = producer_side.features(mb.input_ids, mb.attention_mask)
            header = make_header(spec, epoch=mb.epoch, index=mb.index, attempt=0, sample_ids=mb.sample_ids,
                                 input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                                 producer={"id": "p", "engine": "transformers"}, stream_reading="test")
            parts, n = encode(header, taps, last)
            key = f"regen/roundtrip/{mb.index}"
            producer.put(key, parts, n, preferred_segment=consumer.segment)
            view, handle = consumer.get(key)
            h = read_header(view)
            check_header(h, spec, epoch=mb.epoch, index=mb.index, input_ids=mb.input_ids,
                         attention_mask=mb.attention_mask)
            got = decode(view, h)
            del view, handle
            consumer.remove([key])
            want = trainer_side.features(mb.input_ids, mb.attention_mask)
            out["microbatches"] += 1
            out["rows"] += len(mb.sample_ids)
            out["equal"] += int(all(torch.equal(a, b) for a, b in zip(got, want)))
            out["max_abs_diff"] = max(out["max_abs_diff"], *(float((a.float() - b.float()).abs().max())
                                                             for a, b in zip(got, want)))
            if mb.input_ids.shape[0] > 1:  # the same row computed alone, unpadded: does batching matter?
                n0 = int(mb.attention_mask[0].sum())
                alone = trainer_side.features(mb.input_ids[:1, :n0], mb.attention_mask[:1, :n0])
                out["alone_differs"] += int(not torch.equal(alone[0][0], want[0][0, :n0]))
    producer.close()
    consumer.close()
    return out


def _metrics(url: str) -> dict:
    from regen.train.features.store import store_metrics

    return store_metrics(url)


def _train(profile: str, run: str, sets: list[str], **popen):
    cmd = [sys.executable, "-m", "regen.cli", "train", "--profile", profile, "--run", run]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.Popen(cmd, **popen)


def resume(profile: str, run_a: str, run_b: str) -> dict:
    """A store node (`regen features store`, with its own master) outlives the trainer. Run A trains without
    interruption; run B is SIGKILLed after a checkpoint while objects are in the store, then resumed."""
    node = subprocess.Popen([sys.executable, "-m", "regen.cli", "features", "store", "--bytes", "64MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=Path(run_a).parent)
    try:
        info = json.loads(node.stdout.readline())
        sets = [f"train.producers.store.master={info['master']}",
                f"train.producers.store.metrics_url={info['metrics_url']}",
                "train.producers.store.segment_bytes_per_rank=0"]  # the objects live on the store node
        a = _train(profile, run_a, sets, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert a.wait(600) == 0, "uninterrupted run failed"
        b = _train(profile, run_b, sets, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        log = Path(run_b) / "train" / "log.jsonl"
        left = 0
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:  # past the first checkpoint (checkpoint_every), with objects stored
            steps = len(log.read_text().splitlines()) if log.exists() else 0
            left = _metrics(info["metrics_url"]).get("key_count", 0)
            if steps >= 4 and left > 0 and (Path(run_b) / "train" / "latest.json").exists():
                break
            time.sleep(0.05)
        os.kill(b.pid, signal.SIGKILL)
        b.wait()
        time.sleep(1.0)
        left_after_kill = _metrics(info["metrics_url"]).get("key_count", 0)
        killed_at = len(log.read_text().splitlines())
        b2 = _train(profile, run_b, sets, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert b2.wait(600) == 0, "resumed run failed"
        end = _metrics(info["metrics_url"])
        summary_b = json.loads((Path(run_b) / "train" / "summary.json").read_text())
        return {"killed_at_step": killed_at, "objects_left_after_kill": left_after_kill,
                "removed_at_resume": summary_b["features"]["objects_left_by_earlier_run"],
                "store_keys_at_end": end.get("key_count"), "store_bytes_at_end": end.get("allocated_bytes"),
                "log_a": [json.loads(x) for x in (Path(run_a) / "train" / "log.jsonl").read_text().splitlines()],
                "log_b": [json.loads(x) for x in log.read_text().splitlines()]}
    finally:
        node.terminate()
        node.wait(30)


if __name__ == "__main__":
    what, *args = sys.argv[1:]
    print(json.dumps({"roundtrip": roundtrip, "resume": resume}[what](*args)))
