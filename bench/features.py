"""Target features through producers and a Mooncake store: each side alone, the transport, end to end, K3-shaped.

    .venv/bin/python bench/features.py            # SmolLM2-135M (the local target), MiB..GiB objects
    .venv/bin/python bench/features.py --quick    # the tiny test target, KiB..MiB objects (seconds; in the suite)
    .venv/bin/python bench/features.py --only k3_stream --only overlap   # some sections

Runs in a private network namespace (only loopback: Mooncake's clients listen on all interfaces), re-executing
itself there. Sections, all in one run on this machine:

1. transport: for each object size, a pure client puts (producer side) and a segment-owning client gets, checks
   and copies out (trainer side) through a local `mooncake_master`: GiB/s each way and CPU-seconds per GiB; the
   baseline is a plain in-memory copy of the same bytes (`bytes(bytearray)`), ratio printed.
2. k3_stream: objects of Kimi-K3's shape (5 taps + the last hidden state, 7,168 wide, bf16: 84 KiB per token;
   rows of `--k3-tokens` tokens) through the real dispatcher and trainer-side client (`RemoteFeatures`, contract
   checked), in steps of 4 micro-batches with a budget of three objects: GiB/s, the store's own resident bytes
   (master metrics) against the budget, and per object the host copies, bytes copied host->device and the most objects
   on the device.
3. end_to_end: `regen train` on the same shards and steps, features in process vs through two local producer
   processes: tokens/s of each, their ratio, the data-wait fraction; and each side's capacity measured in that run:
   producer rows/s (per second of a producer's own work) and CPU-s per row, trainer rows/s and CPU-s per row with
   the features already in the store (the loop's time less its wait for producers).

4. overlap: steps of 4 K3-shaped micro-batches through the trainer's own client (`RemoteFeatures`, a real
   dispatcher and store, the objects produced before the clock starts), each a synthetic compute of about one
   read's duration: with the features resident (compute only), serial (`train.producers.read_ahead` 0: a step's
   objects read before its compute) and overlapped (read_ahead 2: the client's reader thread reads ahead while
   the micro-batch computes, the next step submitted at this one's start), in the same run: seconds per step and
   their ratios, the compute thread's stall, host slots, copies and the most objects resident on the device per
   mode. On CPU (the device is the host) it measures the store's read into a host slot overlapped with compute;
   on a GPU also the device copy, issued one micro-batch ahead as the trainer does.
5. value_check: the cost of refusing non-finite feature values (`regen.train.features.contract.check_values`, run
   on every object the trainer reads) on one K3-shaped row of `--k3-tokens` tokens: seconds per object, GiB/s,
   and its share of the time to copy the same bytes out of a buffer.

On a 2-core machine the trainer and the producers share the same two cores, so the end-to-end ratio measures the
overhead of the split (processes, copies, the store) and the competition for cores, not what the split buys on a
cluster, where producers have their own GPUs; the capacities say which side to grow.
"""
from __future__ import annotations

import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
from _preamble import ROOT, sibling  # noqa: E402 - bench/ off sys.path, the repository root first, HF offline

import argparse
import json
import resource
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

GiB = 1024 ** 3
SECTIONS = ("transport", "k3_stream", "overlap", "value_check", "end_to_end")


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def transport(sizes: list[int], reps: int, tmp: Path) -> list[dict]:
    from regen.train.features.store import MooncakeMaster, StoreClient

    out = []
    with MooncakeMaster(tmp / "master-transport.log") as master:
        largest = max(sizes)
        consumer = StoreClient(master.address, segment_bytes=max(64 << 20, 2 * largest),
                               local_buffer_bytes=max(64 << 20, 2 * largest))
        producer = StoreClient(master.address, segment_bytes=0, local_buffer_bytes=max(64 << 20, 2 * largest))
        for size in sizes:
            data = os.urandom(size)
            put_s = get_s = put_cpu = get_cpu = 0.0
            for r in range(reps):
                key = f"bench/{size}/{r}"
                t, c = time.perf_counter(), cpu_s()
                producer.put(key, [memoryview(data)], size, preferred_segment=consumer.segment)
                put_s, put_cpu = put_s + time.perf_counter() - t, put_cpu + cpu_s() - c
                t, c = time.perf_counter(), cpu_s()
                view, handle = consumer.get(key)
                copy = bytes(view)
                del view, handle
                get_s, get_cpu = get_s + time.perf_counter() - t, get_cpu + cpu_s() - c
                assert copy == data
                consumer.remove([key])
            t = time.perf_counter()
            for _ in range(reps):
                bytes(bytearray(data))
            base_s = time.perf_counter() - t
            moved = size * reps / GiB
            out.append({"object_bytes": size, "reps": reps, "put_gib_per_s": moved / put_s,
                        "get_gib_per_s": moved / get_s, "put_cpu_s_per_gib": put_cpu / moved,
                        "get_cpu_s_per_gib": get_cpu / moved, "memcpy_gib_per_s": moved / base_s,
                        "get_vs_memcpy": (moved / get_s) / (moved / base_s)})
        producer.close()
        consumer.close()
    return out


def k3_stream(tokens: int, objects: int, tmp: Path, grad_accum: int = 4) -> dict:
    """K3-shaped objects through the dispatcher and RemoteFeatures, budget 3 objects, fetched in steps of
    `grad_accum` (4: a step more than the budget holds, each object read out before the next is needed)."""
    from types import SimpleNamespace

    import torch

    from regen.train.features.client import RemoteFeatures
    from regen.train.features.contract import FeatureSpec, encode, make_header, object_nbytes
    from regen.train.features.dispatcher import Dispatcher, post
    from regen.train.features.pool import _StoreWatch
    from regen.train.features.store import MooncakeMaster, StoreClient

    spec = FeatureSpec("regen/bench-k3", (7, 31, 47, 63, 87), "attn_res", "bfloat16", 7168, 93, "k3-shape")
    size = object_nbytes(1, tokens, spec)
    budget = 3 * size
    mbs = [SimpleNamespace(epoch=0, index=g, input_ids=torch.full((1, tokens), 5 + g, dtype=torch.long),
                           attention_mask=torch.ones(1, tokens, dtype=torch.bool), sample_ids=[f"k3-{g}"])
           for g in range(objects)]
    taps = torch.randn(1, tokens, 5 * 7168).to(torch.bfloat16)
    last = torch.randn(1, tokens, 7168).to(torch.bfloat16)
    with MooncakeMaster(tmp / "master-k3.log") as master:
        trainer = StoreClient(master.address, segment_bytes=max(16 << 20, budget + size),
                              local_buffer_bytes=max(64 << 20, 2 * size))
        producer_store = StoreClient(master.address, segment_bytes=0, local_buffer_bytes=max(64 << 20, 2 * size))
        d = Dispatcher(iter([(0, m.index, m, 0) for m in mbs]), spec, store=trainer, segments=[trainer.segment],
                       budget_bytes=budget, max_ahead=objects).start()
        watch = _StoreWatch(master.metrics_url, period_s=0.05)
        watch.start()

        def produce():
            pid = post(d.url, "/register", {"engine": "bench", "engine_version": "0", "host": "bench", "pid": 0})[
                "producer_id"]
            while True:
                r = post(d.url, "/lease", {"producer_id": pid, "wait_s": 2})
                if r.get("done"):
                    return
                item = r.get("item")
                if not item:
                    continue
                mb = mbs[item["index"]]
                h = make_header(spec, epoch=0, index=item["index"], attempt=0, sample_ids=mb.sample_ids,
                                input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                                producer={"id": pid, "engine": "bench"}, stream_reading="bench")
                parts, n = encode(h, taps, last)
                producer_store.put(item["key"], parts, n, preferred_segment=item["preferred_segment"])
                post(d.url, "/complete", {"producer_id": pid, "lease_id": item["lease_id"], "key": item["key"],
                                          "header": h})

        head = SimpleNamespace(device="cpu", final_norm=lambda x: x)
        client = RemoteFeatures(d.url, trainer, spec, head, "cpu")
        th = threading.Thread(target=produce, daemon=True)
        t0 = time.perf_counter()
        th.start()
        for at in range(0, len(mbs), grad_accum):  # steps of grad_accum micro-batches, as the loop fetches them
            step = mbs[at:at + grad_accum]
            client.fetch(step)  # every object out of the store: a step larger than the store's budget
            for mb in step:
                client.features_of({"key": (0, mb.index)})
                client.release({"key": (0, mb.index)})  # train_step's release after the backward
        wall = time.perf_counter() - t0
        th.join(30)
        stats = dict(client.staging.stats)
        client.close()
        time.sleep(0.2)
        watch.stop_event.set()
        d.stop()
        producer_store.close()
        trainer.close()
    return {"tokens_per_row": tokens, "object_bytes": size, "objects": objects, "grad_accum": grad_accum,
            "budget_bytes": budget,
            "gib_per_s": objects * size / GiB / wall, "store_resident_bytes_max": watch.max_allocated,
            "resident_within_budget": watch.max_allocated <= budget, "store_samples": len(watch.samples),
            "read_s": client.stats["read_s"], "wait_s": client.stats["wait_s"],
            # copies per object on the trainer's side: the store's transfer (get_into a registered slot), then
            # regen.train.features.staging's own host copies (0 with get_into; 1 with get_buffer)
            "copies_per_object": 1 + stats["host_copies"] / max(1, stats["objects"]),
            "store_reads_into_slots_per_object": stats["store_reads_into_slots"]
            / max(1, stats["objects"]),
            "host_copies_per_object": stats["host_copies"] / max(1, stats["objects"]),
            "host_bytes_copied_per_object": stats["host_bytes"]
            / max(1, stats["objects"]),
            "device_copies_per_object": stats["device_copies"] / max(1, stats["objects"]),
            "device_bytes_copied_per_object": stats["device_bytes"]
            / max(1, stats["objects"]),
            "device_resident_objects_max": stats["resident_max"]}


def overlap(tokens: int, steps: int, tmp: Path, grad_accum: int = 4, read_ahead: int = 2) -> dict:
    """`steps` steps of `grad_accum` K3-shaped micro-batches through the trainer's own client (`RemoteFeatures`, a
    real dispatcher and Mooncake store, every object produced before the clock starts), each micro-batch a synthetic
    compute of about one object's read on its features, then released, as `train_step` does. Three runs in this
    process on the same objects: `resident` (compute only: the features already on hand), `serial`
    (train.producers.read_ahead 0: `fetch` reads a step's objects, then its compute) and `overlapped` (read_ahead
    `read_ahead`: the reader thread reads ahead while the micro-batch computes, the next step submitted at this
    one's start, as the loop does). Seconds per step after the first (which fills the host slots: its pages are
    faulted in once); ratios overlapped / serial and each / resident (1.0 = the reads fully hidden).
    On CPU the device is the host: what overlaps is the store's read into a host slot; on a GPU the device copy too."""
    from types import SimpleNamespace

    import torch

    from regen.train.features.client import RemoteFeatures
    from regen.train.features.contract import FeatureSpec, encode, make_header, object_nbytes, read_header
    from regen.train.features.dispatcher import Dispatcher, post
    from regen.train.features.staging import Staging
    from regen.train.features.store import MooncakeMaster, StoreClient

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = FeatureSpec("regen/bench-k3", (7, 31, 47, 63, 87), "attn_res", "bfloat16", 7168, 93, "k3-shape")
    size = object_nbytes(1, tokens, spec)
    n_obj = steps * grad_accum
    mbs = [SimpleNamespace(epoch=0, index=g, input_ids=torch.full((1, tokens), 5 + g, dtype=torch.long),
                           attention_mask=torch.ones(1, tokens, dtype=torch.bool), sample_ids=[f"k3-{g}"])
           for g in range(n_obj)]
    taps = torch.randn(1, tokens, 5 * 7168).to(torch.bfloat16)
    last = torch.randn(1, tokens, 7168).to(torch.bfloat16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the compute on one core, the reads on the other
    w = torch.randn(1024, 1024, device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def compute(t, iters):
        x = t[0, :, :1024].float()
        for _ in range(iters):
            x = torch.tanh(x @ w)
        sync()

    out = {"device": str(device), "object_bytes": size, "objects": n_obj, "steps": steps, "grad_accum": grad_accum,
           "read_ahead": read_ahead}
    with MooncakeMaster(tmp / "master-overlap.log") as master:
        trainer = StoreClient(master.address, segment_bytes=max(16 << 20, (n_obj + 1) * size),
                              local_buffer_bytes=max(64 << 20, 3 * size))
        producer = StoreClient(master.address, segment_bytes=0, local_buffer_bytes=max(64 << 20, 2 * size))
        parts_of = {}
        for mb in mbs:
            h = make_header(spec, epoch=0, index=mb.index, attempt=0, sample_ids=mb.sample_ids,
                            input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                            producer={"id": "p", "engine": "bench"}, stream_reading="bench")
            parts_of[mb.index] = (h, *encode(h, taps, last))
        # calibration: one object read into a host slot as the client does, and one compute iteration
        key = "bench/overlap/probe"
        h, parts, n = parts_of[0]
        producer.put(key, parts, n, preferred_segment=trainer.segment)
        probe = Staging(device, register=trainer.register, unregister=trainer.unregister)
        for _ in range(2):  # the second read into the same slot: as in steady state (the first one faults it in)
            t = time.perf_counter()
            staged, view = probe.stage_into(lambda buf: trainer.get_into(key, buf, n), n, 0)
            probe.locate(staged, read_header(view))
            del view
            read_s = time.perf_counter() - t
            probe.discard(staged)
        staged, view = probe.stage_into(lambda buf: trainer.get_into(key, buf, n), n, 0)
        probe.locate(staged, read_header(view))
        del view
        feats, _ = probe.ready(staged)
        t = time.perf_counter()
        compute(feats, 1)
        one = time.perf_counter() - t
        probe.release(staged)
        probe.close()
        trainer.remove([key])
        iters = max(1, round(read_s / max(one, 1e-6)))
        out.update({"probe_read_s": read_s, "compute_iters": iters})

        resident = taps.to(device)
        t0 = time.perf_counter()
        for _ in range(n_obj):
            compute(resident, iters)
        out["resident"] = {"step_s": (time.perf_counter() - t0) / steps}  # compute only: every step alike
        del resident

        for mode, ra in (("serial", 0), ("overlapped", read_ahead)):
            d = Dispatcher(iter([(0, m.index, m, 0) for m in mbs]), spec, store=trainer, segments=[trainer.segment],
                           budget_bytes=(n_obj + 1) * size, max_ahead=n_obj).start()
            pid = post(d.url, "/register", {"engine": "bench", "engine_version": "0", "host": "bench", "pid": 0})[
                "producer_id"]
            for _ in mbs:  # every object in the store before the clock starts: the producers are not measured
                item = post(d.url, "/lease", {"producer_id": pid, "wait_s": 2})["item"]
                h, parts, n = parts_of[item["index"]]
                producer.put(item["key"], parts, n, preferred_segment=item["preferred_segment"])
                post(d.url, "/complete", {"producer_id": pid, "lease_id": item["lease_id"], "key": item["key"],
                                          "header": h})
            head = SimpleNamespace(device=str(device), final_norm=lambda x: x)
            client = RemoteFeatures(d.url, trainer, spec, head, device, read_ahead=ra)
            computes, step_times = [], []
            for at in range(0, n_obj, grad_accum):
                t0 = time.perf_counter()
                step = mbs[at:at + grad_accum]
                if ra:
                    client.submit(step)
                    client.submit(mbs[at + grad_accum:at + 2 * grad_accum])  # the next step, as the loop pulls it
                else:
                    client.fetch(step)
                for mb in step:
                    feats, _ = client.features_of({"key": (0, mb.index)})
                    t = time.perf_counter()
                    compute(feats, iters)
                    computes.append(time.perf_counter() - t)
                    client.release({"key": (0, mb.index)})
                step_times.append(time.perf_counter() - t0)
            st = client.staging.stats
            timed = step_times[1:] or step_times  # the first step fills (and faults in) the host slots: left out
            out[mode] = {"step_s": sum(timed) / len(timed), "first_step_s": step_times[0],
                         "read_s_per_object": client.stats["read_s"] / n_obj,
                         "compute_s_per_object": sum(computes) / n_obj,
                         "stall_s_per_step": client.stats["stall_s"] / steps,
                         "store_reads_into_slots_per_object": st["store_reads_into_slots"] / n_obj,
                         "host_copies_per_object": st["host_copies"] / n_obj,
                         "device_bytes_per_object": st["device_bytes"] / n_obj,
                         "device_resident_objects_max": st["resident_max"], "host_slots": len(client.staging.host),
                         "host_slot_bytes_max": st["host_slot_bytes_max"]}
            client.close()
            d.stop()
        producer.close()
        trainer.close()
    torch.set_num_threads(threads)
    out["overlapped_vs_serial"] = out["overlapped"]["step_s"] / out["serial"]["step_s"]
    out["serial_vs_resident"] = out["serial"]["step_s"] / out["resident"]["step_s"]
    out["overlapped_vs_resident"] = out["overlapped"]["step_s"] / out["resident"]["step_s"]
    out["measures"] = ("the store's read into a host slot overlapped with compute (CPU: the device is the host)"
                       if device.type == "cpu" else
                       "the store's read into a pinned host slot + the device copy overlapped with compute")
    return out


def value_check(tokens: int, reps: int = 5) -> dict:
    """check_values on K3-shaped tensors of one row (5 x 7168 taps + 7168 last hidden, bf16): best of `reps`."""
    import torch

    from regen.train.features.contract import check_values

    taps = torch.randn(1, tokens, 5 * 7168).to(torch.bfloat16)
    last = torch.randn(1, tokens, 7168).to(torch.bfloat16)
    nbytes = (taps.numel() + last.numel()) * 2
    check_s, copy_s = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        check_values({"sample_ids": ["k3"]}, taps, last, epoch=0, index=0)
        check_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        taps.clone(), last.clone()
        copy_s.append(time.perf_counter() - t0)
    return {"tokens_per_row": tokens, "object_bytes": nbytes, "check_s": min(check_s),
            "check_gib_per_s": nbytes / GiB / min(check_s), "copy_s": min(copy_s),
            "check_vs_copy": min(check_s) / min(copy_s)}


def end_to_end(target: Path, steps: int, rows: int, length: int, tmp: Path, sets: list[str]) -> dict:
    synthetic_shards = sibling("train").synthetic_shards  # bench/train.py's generator

    from regen.train.features.store import env_for_children

    out = {}
    for mode in ("in_process", "producers"):
        run = tmp / f"e2e-{mode}"
        synthetic_shards(run, num_rows=rows, length=length, vocab=49152 if "smollm" in str(target) else 512)
        profile = tmp / "e2e.yaml"
        cmd = [sys.executable, "-m", "regen.cli", "train", "--profile", str(profile), "--run", str(run),
               "--set", f"train.features={mode}", "--set", f"train.max_steps={steps}"]
        for s in sets:
            cmd += ["--set", s]
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**env_for_children(), "REGEN_NETNS": "1"})
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            raise SystemExit(f"bench/features.py: regen train ({mode}) failed:\n{proc.stderr[-3000:]}")
        s = json.loads((run / "train" / "summary.json").read_text())
        out[mode] = {"tokens_per_s": s["tokens_per_s"], "loop_s": s["loop_s"], "wall_s": wall,
                     "loss_last": s["loss_last"]}
        if mode == "producers":
            f = s["features"]
            out[mode].update({k: f.get(k) for k in (
                "data_wait_fraction", "data_wait_fraction_after_first", "first_wait_s", "feature_bytes_per_s",
                "trainer_rows_per_s", "trainer_cpu_s_per_row",
                "producer_rows_per_s", "producer_rows_per_s_each", "producer_cpu_s_per_row", "read_s", "wait_s")})
    out["producers_vs_in_process_tokens_per_s"] = (out["producers"]["tokens_per_s"]
                                                   / out["in_process"]["tokens_per_s"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny test target and small objects (seconds)")
    ap.add_argument("--k3-tokens", type=int, default=None, help="tokens per K3-shaped row (default 4096; quick 64)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps of the end-to-end runs")
    ap.add_argument("--only", action="append", choices=SECTIONS, help="run only this section (repeatable)")
    args = ap.parse_args(argv)
    from regen.train.features.netns import ENV_FLAG, loopback_only

    if os.environ.get(ENV_FLAG) != "1":
        cmd = loopback_only([sys.executable, str(Path(__file__).resolve()), *(argv or sys.argv[1:])])
        if cmd is not None:
            from regen.train.features.store import env_for_children

            return subprocess.run(cmd, env={**env_for_children(), ENV_FLAG: "1"}).returncode
        print("bench/features.py: no network namespace here; Mooncake clients listen on all interfaces",
              file=sys.stderr)
    mod = sibling("train")  # bench/train.py
    tmp = Path(tempfile.mkdtemp(prefix="regen-bench-features-"))
    try:
        import yaml

        if args.quick:
            target = mod.tiny_target(tmp / "tiny")
            sizes, reps, k3_tokens, k3_objects = [256 << 10, 1 << 20, 4 << 20], 5, args.k3_tokens or 64, 8
            k3_overlap = 2  # steps of 4 micro-batches
            steps, rows, length = args.steps or 6, 24, 64
            train = {"target_layer_ids": [0, 1, 2], "num_draft_layers": 1, "markov_rank": 16, "num_anchors": 8,
                     "max_len": 64, "max_tokens": 256, "max_batch": 4}
        else:
            target = ROOT / "data" / "models" / "smollm2-135m"
            if not (target / "config.json").exists():
                raise SystemExit("bench/features.py: data/models/smollm2-135m is missing: run `bash scripts/setup.sh`")
            sizes, reps, k3_tokens, k3_objects = [1 << 20, 16 << 20, 64 << 20, 256 << 20], 5, args.k3_tokens or 4096, 12
            k3_overlap = 4
            steps, rows, length = args.steps or 40, 160, 192
            local = yaml.safe_load((ROOT / "data" / "profiles" / "local.yaml").read_text())["train"]
            train = {k: local[k] for k in ("target_layer_ids", "num_draft_layers", "markov_rank", "num_anchors",
                                           "max_len", "max_tokens", "max_batch", "fc_norm", "mask_token_id",
                                           "draft_vocab_size", "lr", "truncate")}
            train["dtype"] = train["target_dtype"] = "float32"
        train.update({"enabled": True, "target": str(target), "device": "cpu", "epochs": 0, "heldout_fraction": 0.0,
                      "min_loss_tokens": 4, "shuffle_buffer": 16, "bucket_window": 16, "checkpoint_every": 0,
                      "log_every": 1, "seed": 0})
        (tmp / "e2e.yaml").write_text(yaml.safe_dump({"name": "bench-features", "train": train}))
        sections = {"transport": lambda: transport(sizes, reps, tmp),
                    "k3_stream": lambda: k3_stream(k3_tokens, k3_objects, tmp),
                    "overlap": lambda: overlap(k3_tokens, k3_overlap, tmp),  # steps of 4 micro-batches
                    "value_check": lambda: value_check(k3_tokens),
                    "end_to_end": lambda: end_to_end(target, steps, rows, length, tmp,
                                                     ["train.producers.num_local=2",
                                                      "train.producers.local_threads=1"])}
        result = {"machine": _machine(), "quick": args.quick}
        for name, run in sections.items():
            if not args.only or name in args.only:
                result[name] = run()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if "end_to_end" in result:
        e = result["end_to_end"]
        print(f"end to end: producers {e['producers']['tokens_per_s']:.0f} tokens/s vs in process "
              f"{e['in_process']['tokens_per_s']:.0f} = {e['producers_vs_in_process_tokens_per_s']:.2f}x; data wait "
              f"{100 * e['producers']['data_wait_fraction']:.0f}% "
              f"({100 * e['producers']['data_wait_fraction_after_first']:.0f}% after the producers' start-up); "
              f"trainer can take {e['producers']['trainer_rows_per_s']:.2f} rows/s, producers give "
              f"{e['producers']['producer_rows_per_s'] or 0:.2f} rows/s", file=sys.stderr)
    if "k3_stream" in result:
        k = result["k3_stream"]
        print(f"K3-shaped rows of {k['tokens_per_row']} tokens ({k['object_bytes'] / GiB:.3f} GiB): "
              f"{k['gib_per_s']:.2f} GiB/s, store resident max {k['store_resident_bytes_max'] / GiB:.3f} GiB of a "
              f"{k['budget_bytes'] / GiB:.3f} GiB budget", file=sys.stderr)
        print(f"  per object: the store's transfer into a host slot ({k['store_reads_into_slots_per_object']:.0f}) "
              f"+ {k['host_copies_per_object']:.0f} host copy after it, "
              f"{k['device_bytes_copied_per_object'] / GiB:.3f} GiB host->device "
              f"({k['device_copies_per_object']:.0f} copies; 0 on CPU: the device is the host), "
              f"at most {k['device_resident_objects_max']} object(s) resident on the device", file=sys.stderr)
    if "overlap" in result:
        o = result["overlap"]
        print(f"overlap, {o['steps']} steps of {o['grad_accum']} K3-shaped objects of {o['object_bytes'] / GiB:.3f} "
              f"GiB ({o['measures']}): step {o['resident']['step_s']:.3f} s with the features resident, serial "
              f"(read_ahead 0) {o['serial']['step_s']:.3f} s = {o['serial_vs_resident']:.2f}x, overlapped "
              f"(read_ahead {o['read_ahead']}) {o['overlapped']['step_s']:.3f} s = {o['overlapped_vs_resident']:.2f}x; "
              f"overlapped / serial {o['overlapped_vs_serial']:.2f} (read {o['serial']['read_s_per_object']:.3f} s, "
              f"compute {o['serial']['compute_s_per_object']:.3f} s per object; host slots "
              f"{o['serial']['host_slots']} serial, {o['overlapped']['host_slots']} overlapped)", file=sys.stderr)
    if "value_check" in result:
        v = result["value_check"]
        print(f"non-finite value check of a K3-shaped row of {v['tokens_per_row']} tokens: "
              f"{v['check_s'] * 1e3:.1f} ms ({v['check_gib_per_s']:.2f} GiB/s, {v['check_vs_copy']:.2f}x a copy of "
              "the same bytes)", file=sys.stderr)
    return 0


def _machine() -> dict:
    import platform

    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    return {"cpu": model, "cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags,
            "load_avg_at_start": os.getloadavg()}


if __name__ == "__main__":
    sys.exit(main())
