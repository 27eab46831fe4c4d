"""The vLLM producer against the transformers producer, on one private loopback network (run inside a network
namespace by tests/train/test_vllm_producer.py, or by hand for the figures); prints one JSON line.

    python vllm_drivers.py compare MODEL SHARDS_DIR VLLM_PYTHON OUT_DIR [--train PROFILE RUN_DIR]

One vLLM server (extract_hidden_states + regen's connector, started as the vLLM producer starts it) serves the
whole run. For the same feed (rows, order, padding) the trainer's own side (`FeaturePool` with no local producers,
`RemoteFeatures`: contract check, final norm of a pre-norm last state) reads every micro-batch once from a
transformers producer and once from a vLLM producer; both producers are separate processes, each alone while it
works. With `--train`, `regen train` then runs PROFILE on RUN_DIR through its dispatcher with one vLLM producer.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

LAYER_IDS = (1, 14, 27)  # the local profile's taps of SmolLM2-135M
FEED = dict(max_len=160, max_tokens=640, max_batch=4, min_loss_tokens=4, shuffle_buffer=16, bucket_window=16)


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "REGEN_NETNS": "1",
            "MC_LOG_LEVEL": "WARNING", "GLOG_minloglevel": "1"}


def start_server(model: str, vllm_python: str, out: Path, threads: int, batched: int):
    """A vLLM server as `regen features produce-vllm` starts it (same command), for several producers in turn;
    `batched` > 0 caps the tokens of one engine step (--max-num-batched-tokens), so long rows prefill in chunks."""
    from regen.train.features.store import free_port
    from regen.train.features.vllm_producer import REPO_ROOT, VllmServer, server_command, vllm_layer_ids

    staging = Path("/dev/shm" if os.path.isdir("/dev/shm") else out) / f"regen-vllm-test-{os.getpid()}"
    staging.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = server_command(vllm_python, model, port=port, layer_ids=vllm_layer_ids(LAYER_IDS, 30),
                         staging_dir=str(staging), dtype="float32", max_model_len=1024,
                         extra=["--enforce-eager", *(["--max-num-batched-tokens", str(batched)] if batched else [])])
    # nobind: vLLM's CPU build otherwise pins its engine to core 0 and reserves the rest, so its `threads` share
    # one core beside the other test worker while a core stays idle
    env = {**_env(), "PYTHONPATH": str(REPO_ROOT), "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": str(threads),
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    t0 = time.monotonic()
    server = VllmServer.start(cmd, port, str(out / "vllm-server.log"), 900, env)
    return server, staging, time.monotonic() - t0


def read_through_pool(model: str, shards: str, out: Path, producer_cmd: list[str], name: str) -> dict:
    """Every micro-batch of the feed's first epoch, as a trainer rank gets it from `producer_cmd` (a producer
    process started against this pool's dispatcher). Returns {features: {(e, i): (taps, last)}, figures}."""
    import torch

    from regen.config.train import ProducersConfig
    from regen.train.features.contract import FeatureSpec
    from regen.train.features.pool import FeaturePool, namespace_for
    from regen.train.feed import FeedConfig, ShardFeed
    from regen.train.parallel import init_distributed
    from regen.train.target_head import TargetHead, target_revision

    head = TargetHead.from_pretrained(model, dtype=torch.float32)
    tc = head.config
    train_dir = out / name
    spec = FeatureSpec(namespace_for(train_dir), LAYER_IDS, "prefix", "float32", int(tc.hidden_size),
                       int(tc.num_hidden_layers), target_revision(model))
    cfg = FeedConfig(**FEED)
    num_steps = ShardFeed(shards, cfg).count_steps(1)
    pcfg = ProducersConfig(num_local=0, lease_timeout_s=30, heartbeat_s=0.5, startup_timeout_s=900)
    info = init_distributed("cpu")  # world size 1, as `regen train` on one process
    pool = FeaturePool.start(pcfg, info=info, spec=spec, head=head, plan_feed=ShardFeed(shards, cfg), num_epochs=1,
                             num_steps=num_steps, max_tokens=cfg.max_tokens, max_batch=cfg.max_batch,
                             train_dir=train_dir, target_path=model)
    logf = open(out / f"{name}.log", "wb")
    proc = subprocess.Popen([*producer_cmd, "--dispatcher", pool.dispatcher.url, "--orphan-timeout-s", "30"],
                            env=_env(), stdout=logf, stderr=subprocess.STDOUT)
    got, rows, t_first = {}, 0, None
    try:
        for step in ShardFeed(shards, cfg).steps(1):
            zeroed = pool.fetch_step(step.microbatches)
            assert not zeroed, zeroed
            for mb in step.microbatches:
                t_first = t_first or time.monotonic()
                got[(mb.epoch, mb.index)] = (pool.features.features_of({"key": (mb.epoch, mb.index)}),
                                             mb.attention_mask.clone())
                rows += len(mb.sample_ids)
        t_end = time.monotonic()
        status = pool.dispatcher.status()
        prod = status["producers"][0]
        figures = {"rows": rows, "microbatches": len(got), "producer_busy_s": prod["busy_s"],
                   "producer_rows_per_s": rows / prod["busy_s"] if prod["busy_s"] else None,
                   "wall_rows_per_s_after_first": (rows / (t_end - t_first)) if t_end > t_first else None,
                   "pre_norm_applied": pool.features.stats["pre_norm_applied"], "engine": prod["engine"]}
    finally:
        pool.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        logf.close()
    return {"features": got, "figures": figures}


def compare(hf: dict, vl: dict, model: str, shards: str) -> dict:
    """How far the vLLM features are from the transformers ones at real positions (per tap slot: max |diff|, and
    the per-token error relative to the token's state norm), whether padding is zero, and two controls: the
    distance of the vLLM taps from the layer below each tap (what a lost +1 shift gives, TorchSpec #87) and of
    the last state from the final-normed state of layer L-2 (TorchSpec #87's wrong last slot)."""
    import torch

    from regen.train.feed import FeedConfig, ShardFeed
    from regen.train.target import TargetContract, TargetFeatures
    from regen.train.target_head import TargetHead

    H = 576
    below = TargetFeatures.from_pretrained(model, TargetContract(tuple(i - 1 for i in LAYER_IDS) + (28,)),
                                           dtype=torch.float32)
    head = TargetHead.from_pretrained(model, dtype=torch.float32)
    mbs = {(mb.epoch, mb.index): mb for st in ShardFeed(shards, FeedConfig(**FEED)).steps(1) for mb in st.microbatches}
    out = {"taps_max_abs": 0.0, "taps_max_rel": 0.0, "last_max_abs": 0.0, "last_max_rel": 0.0, "taps_scale": 0.0,
           "last_scale": 0.0, "padding_nonzero": 0, "padded_positions": 0}
    controls = {"control_tap_below": [], "control_last_l_minus_2": []}

    def rel(x, y):
        return (x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-12)

    for key, ((t_hf, l_hf), mask) in hf.items():
        (t_vl, l_vl), _ = vl[key]
        m = mask.bool()
        for name, a, b in (("taps", t_vl, t_hf), ("last", l_vl, l_hf)):
            for x, y in zip(a[m].split(H, -1), b[m].split(H, -1)):
                out[f"{name}_max_abs"] = max(out[f"{name}_max_abs"], float((x - y).abs().max()))
                out[f"{name}_max_rel"] = max(out[f"{name}_max_rel"], float(rel(x, y).max()))
                out[f"{name}_scale"] = max(out[f"{name}_scale"], float(y.abs().max()))
        out["padding_nonzero"] += int((t_vl[~m] != 0).sum() + (l_vl[~m] != 0).sum())
        out["padded_positions"] += int((~m).sum())
        mb = mbs[key]
        t_below, _ = below.features(mb.input_ids, mb.attention_mask)
        chunks = t_below[m].split(H, -1)
        for x, y in zip(t_vl[m].split(H, -1), chunks[:-1]):
            controls["control_tap_below"].append(rel(x, y))
        controls["control_last_l_minus_2"].append(rel(l_vl[m], head.final_norm(chunks[-1])))
    for name, values in controls.items():  # per token: min, median, and the fraction above 1e-3
        v = torch.cat(values)
        out[f"{name}_min_rel"], out[f"{name}_median_rel"] = float(v.min()), float(v.median())
        out[f"{name}_frac_over_1e-3"] = float((v > 1e-3).float().mean())
    return out


def main(model: str, shards: str, vllm_python: str, out: str, train: list[str]) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    threads = int(os.environ.get("REGEN_TEST_THREADS", "2"))
    batched = int(os.environ.get("REGEN_TEST_BATCHED_TOKENS", "0"))
    server, staging, start_s = start_server(model, vllm_python, out, threads, batched)
    result = {"server_start_s": round(start_s, 1), "threads": threads, "max_num_batched_tokens": batched}
    try:
        result["prefill_steps_of_a_150_token_row"] = prefill_steps(server.url, staging, 150)
        py = [sys.executable, "-m"]
        hf = read_through_pool(model, shards, out, py + ["regen.train.features.producer", "--model", model,
                                                         "--threads", str(threads)], "transformers")
        vl = read_through_pool(model, shards, out, py + ["regen.train.features.vllm_producer", "--model", model,
                                                         "--server", server.url, "--staging-dir", str(staging)],
                               "vllm")
        result["transformers"], result["vllm"] = hf["figures"], vl["figures"]
        result["diff"] = compare(hf["features"], vl["features"], model, shards)
        if train:
            result["train"] = train_through_dispatcher(train[0], train[1], server.url, staging, model)
    finally:
        server.stop()
        for p in staging.glob("*"):
            p.unlink(missing_ok=True)
        staging.rmdir()
    return result


def prefill_steps(url: str, staging: Path, num_tokens: int) -> int:
    """Engine steps the connector saw computing one row of `num_tokens` (its kv_transfer_params answer)."""
    from regen.train.features.vllm_producer import SERVED_NAME, _http, vllm_layer_ids

    path = staging / "steps.bin"
    T, H = len(LAYER_IDS), 576
    path.write_bytes(bytes(num_tokens * (T + 1) * H * 4))
    Path(f"{path}.rows").write_bytes(bytes(1))
    target = {"path": str(path), "row": 0, "dtype": "float32", "num_tokens": num_tokens, "num_taps": T,
              "hidden_size": H, "layer_ids": vllm_layer_ids(LAYER_IDS, 30), "taps_offset": 0,
              "last_offset": num_tokens * T * H * 4}
    r = _http(url + "/v1/completions", {"model": SERVED_NAME, "prompt": list(range(10, 10 + num_tokens)),
                                        "max_tokens": 1, "kv_transfer_params": {"regen": target}}, timeout_s=300)
    assert Path(f"{path}.rows").read_bytes() == bytes([1]), "the connector did not write the row"
    for p in staging.glob("steps.bin*"):
        p.unlink()
    return int(r["kv_transfer_params"]["regen"]["prefill_steps"])


def train_through_dispatcher(profile: str, run: str, server_url: str, staging: Path, model: str) -> dict:
    """`regen train` with `train.features=producers` and no local producer; one vLLM producer joins through
    `<train dir>/features/dispatcher.json`, as a cluster's would. Returns the logged losses and the summary."""
    cmd = [sys.executable, "-m", "regen.cli", "train", "--profile", profile, "--run", run,
           "--set", "train.features=producers", "--set", "train.producers.num_local=0",
           "--set", "train.producers.startup_timeout_s=300", "--set", "train.producers.lease_timeout_s=30"]
    trainer = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    info = Path(run) / "train" / "features" / "dispatcher.json"
    deadline = time.monotonic() + 300
    while not info.exists() and trainer.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if not info.exists():
        trainer.kill()
        raise RuntimeError("the trainer wrote no dispatcher.json: " + (trainer.communicate()[0] or "")[-3000:])
    url = json.loads(info.read_text())["url"]
    with open(Path(run) / "vllm-producer.log", "wb") as logf:
        producer = subprocess.Popen([sys.executable, "-m", "regen.train.features.vllm_producer", "--dispatcher", url,
                                     "--model", model, "--server", server_url, "--staging-dir", str(staging),
                                     "--orphan-timeout-s", "10"],
                                    env=_env(), stdout=logf, stderr=subprocess.STDOUT)
        out, _ = trainer.communicate(timeout=900)
        producer.wait(120)
    if trainer.returncode != 0:
        raise RuntimeError(f"regen train failed ({trainer.returncode}): {out[-3000:]}")
    log = [json.loads(x) for x in (Path(run) / "train" / "log.jsonl").read_text().splitlines()]
    summary = json.loads((Path(run) / "train" / "summary.json").read_text())
    return {"losses": [x["loss"] for x in log], "steps": summary["steps"],
            "engines": sorted({p["engine"] for p in summary["features"]["producers"]}),
            "pre_norm": summary["features"].get("objects"), "producer_exit": producer.returncode}


if __name__ == "__main__":
    what, model, shards, vllm_python, out, *rest = sys.argv[1:]
    assert what == "compare", what
    train = rest[1:3] if rest[:1] == ["--train"] else []
    print(json.dumps(main(model, shards, vllm_python, out, train)))
