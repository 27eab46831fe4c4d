"""Target features through producers and a Mooncake store: each side alone, the transport, end to end, K3-shaped.

    .venv/bin/python bench/features.py            # SmolLM2-135M (the local target), MiB..GiB objects
    .venv/bin/python bench/features.py --quick    # the tiny test target, KiB..MiB objects (seconds; in the suite)

Runs in a private network namespace (only loopback: Mooncake's clients listen on all interfaces), re-executing
itself there. Sections, all in one run on this machine:

1. transport: for each object size, a pure client puts (producer side) and a segment-owning client gets, checks
   and copies out (trainer side) through a local `mooncake_master`: GiB/s each way and CPU-seconds per GiB; the
   baseline is a plain in-memory copy of the same bytes (`bytes(bytearray)`), ratio printed.
2. k3_stream: objects of Kimi-K3's shape (5 taps + the last hidden state, 7,168 wide, bf16: 84 KiB per token;
   rows of `--k3-tokens` tokens) through the real dispatcher and trainer-side client (`RemoteFeatures`, contract
   checked) with a budget of three objects: GiB/s, and the store's own resident bytes (master metrics) against
   the budget.
3. end_to_end: `regen train` on the same shards and steps, features in process vs through two local producer
   processes: tokens/s of each, their ratio, the data-wait fraction; and each side's capacity measured in that run:
   producer rows/s (per second of a producer's own work) and CPU-s per row, trainer rows/s and CPU-s per row with
   the features already in the store (the loop's time less its wait for producers).

4. value_check: the cost of refusing non-finite feature values (`regen.train.features.contract.check_values`, run
   on every object the trainer reads) on one K3-shaped row of `--k3-tokens` tokens: seconds per object, GiB/s,
   and its share of the time to copy the same bytes out of a buffer.

On a 2-core machine the trainer and the producers share the same two cores, so the end-to-end ratio measures the
overhead of the split (processes, copies, the store) and the competition for cores, not what the split buys on a
cluster, where producers have their own GPUs; the capacities say which side to grow.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import json
import os
import resource
import shutil
import subprocess
import tempfile
import threading
import time

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
GiB = 1024 ** 3


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


def k3_stream(tokens: int, objects: int, tmp: Path) -> dict:
    """K3-shaped objects through the dispatcher and RemoteFeatures, budget 3 objects."""
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
        for mb in mbs:
            client.fetch([mb])
            client.features_of({"key": (0, mb.index)})
        wall = time.perf_counter() - t0
        th.join(30)
        time.sleep(0.2)
        watch.stop_event.set()
        d.stop()
        producer_store.close()
        trainer.close()
    return {"tokens_per_row": tokens, "object_bytes": size, "objects": objects, "budget_bytes": budget,
            "gib_per_s": objects * size / GiB / wall, "store_resident_bytes_max": watch.max_allocated,
            "resident_within_budget": watch.max_allocated <= budget, "store_samples": len(watch.samples),
            "read_s": client.stats["read_s"], "wait_s": client.stats["wait_s"],
            # copies per object on the trainer's side: the store's get_buffer, then regen.train.features.staging's
            "copies_per_object": 1 + client.staging.stats["host_copies"] / max(1, client.staging.stats["objects"]),
            "host_bytes_copied_per_object": client.staging.stats["host_bytes"] / max(1, client.staging.stats["objects"]),
            "device_bytes_copied_per_object": client.staging.stats["device_bytes"] / max(1, client.staging.stats["objects"])}


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
    from bench_train import synthetic_shards  # bench/train.py's generator (loaded by path in main)

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
    args = ap.parse_args(argv)
    from regen.train.features.netns import ENV_FLAG, loopback_only

    if os.environ.get(ENV_FLAG) != "1":
        cmd = loopback_only([sys.executable, str(Path(__file__).resolve()), *(argv or sys.argv[1:])])
        if cmd is not None:
            from regen.train.features.store import env_for_children

            return subprocess.run(cmd, env={**env_for_children(), ENV_FLAG: "1"}).returncode
        print("bench/features.py: no network namespace here; Mooncake clients listen on all interfaces",
              file=sys.stderr)
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_train", Path(__file__).with_name("train.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["bench_train"] = mod
    tmp = Path(tempfile.mkdtemp(prefix="regen-bench-features-"))
    try:
        import yaml

        if args.quick:
            target = mod.tiny_target(tmp / "tiny")
            sizes, reps, k3_tokens, k3_objects = [256 << 10, 1 << 20, 4 << 20], 5, args.k3_tokens or 64, 6
            steps, rows, length = args.steps or 6, 24, 64
            train = {"target_layer_ids": [0, 1, 2], "num_draft_layers": 1, "markov_rank": 16, "num_anchors": 8,
                     "max_len": 64, "max_tokens": 256, "max_batch": 4}
        else:
            target = ROOT / "data" / "models" / "smollm2-135m"
            if not (target / "config.json").exists():
                raise SystemExit("bench/features.py: data/models/smollm2-135m is missing: run `bash scripts/setup.sh`")
            sizes, reps, k3_tokens, k3_objects = [1 << 20, 16 << 20, 64 << 20, 256 << 20], 5, args.k3_tokens or 4096, 12
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
        result = {"machine": _machine(), "quick": args.quick,
                  "transport": transport(sizes, reps, tmp),
                  "k3_stream": k3_stream(k3_tokens, k3_objects, tmp),
                  "value_check": value_check(k3_tokens),
                  "end_to_end": end_to_end(target, steps, rows, length, tmp,
                                           ["train.producers.num_local=2", "train.producers.local_threads=1"])}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result, indent=2))
    e = result["end_to_end"]
    print(f"end to end: producers {e['producers']['tokens_per_s']:.0f} tokens/s vs in process "
          f"{e['in_process']['tokens_per_s']:.0f} = {e['producers_vs_in_process_tokens_per_s']:.2f}x; data wait "
          f"{100 * e['producers']['data_wait_fraction']:.0f}% ({100 * e['producers']['data_wait_fraction_after_first']:.0f}% "
          f"after the producers' start-up); trainer can take {e['producers']['trainer_rows_per_s']:.2f} "
          f"rows/s, producers give {e['producers']['producer_rows_per_s'] or 0:.2f} rows/s", file=sys.stderr)
    k = result["k3_stream"]
    print(f"K3-shaped rows of {k['tokens_per_row']} tokens ({k['object_bytes'] / GiB:.3f} GiB): {k['gib_per_s']:.2f} "
          f"GiB/s, store resident max {k['store_resident_bytes_max'] / GiB:.3f} GiB of a "
          f"{k['budget_bytes'] / GiB:.3f} GiB budget", file=sys.stderr)
    v = result["value_check"]
    print(f"non-finite value check of a K3-shaped row of {v['tokens_per_row']} tokens: {v['check_s'] * 1e3:.1f} ms "
          f"({v['check_gib_per_s']:.2f} GiB/s, {v['check_vs_copy']:.2f}x a copy of the same bytes)", file=sys.stderr)
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
