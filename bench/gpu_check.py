"""The trainer's first GPU check, in one run (issue 26, point 10). `bench/gpu_check.sh` runs it under a time limit.

    .venv/bin/python bench/gpu_check.py                  # on a GPU: every section at the kimi-k3 shapes
    .venv/bin/python bench/gpu_check.py --cpu --quick    # here: the same code paths at tiny shapes (seconds)
    .venv/bin/python bench/gpu_check.py --only k3_step --tokens 16384 --attention flex

Sections (each prints one JSON object on a line of its own, then a summary; exit 1 when a check fails):

1. train: `regen train` at world size 1 (NCCL on CUDA) on a tiny random target built here (`bench/train.py
   --quick`): the loss must fall and the run must end without error.
2. k3_step: the kimi-k3 draft (5 MLA layers, H 7,168, 64 heads, V 163,840), built on the training device,
   sharded by FSDP2 with bf16 compute, trained by `regen.train.loop.train_step` on synthetic features of one
   row of `--tokens` tokens (and one whose key length L = S + N·K has L % 128 == 64, the cuDNN NaN condition of
   pytorch/pytorch#196678): step seconds, tokens/s, `torch.cuda.max_memory_allocated` against `regen plan`'s
   memory per GPU for the same row length at world size 1, the attention path (`train.attention`; SDPA pinned to
   memory-efficient attention on CUDA), and finite loss, grad norm and weights.
3. h2d: feature bytes per second into the device for one K3 feature object of `--tokens` tokens: the trainer's
   path before issue 26 (`torch.frombuffer(...).clone()` then a pageable copy), `regen.train.features.staging`
   (one copy into a reused pinned slot, `non_blocking` on a side stream), the pinned copy alone, the host copy.

No network: everything is synthetic or built here. With `--cpu` (or no CUDA) the shapes shrink to a K3-structured
toy (`--quick` fewer steps): the check of the code paths, not a measurement.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse
import json
import math
import os
import subprocess
import time

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
GiB = 1024 ** 3
SECTIONS = ("train", "k3_step", "h2d")


def emit(rec: dict) -> None:
    print(json.dumps(rec), flush=True)


def section_train(args, device) -> dict:
    steps = 3 if args.quick else 20
    cmd = [sys.executable, str(ROOT / "bench" / "train.py"), "--quick", "--steps", str(steps),
           "--set", f"train.device={device.type}", "--set", "train.lr=3e-3"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.train_timeout_s)
    rec = {"section": "train", "device": device.type, "steps": steps, "seconds": round(time.perf_counter() - t0, 1),
           "returncode": proc.returncode}
    if proc.returncode != 0:
        return rec | {"ok": False, "error": (proc.stderr or proc.stdout)[-2000:]}
    out = json.loads(proc.stdout[proc.stdout.index("{"):])
    rec |= {k: out[k] for k in ("loss_first", "loss_last", "train_tokens_per_s", "device")}
    rec["ok"] = bool(out["loss_last"] < out["loss_first"]) and math.isfinite(out["loss_last"])
    return rec


def k3_config(args, cpu: bool):
    from regen.train.draft_config import DSparkConfig, kimi_k3_config

    if not cpu:
        return kimi_k3_config(num_anchors=args.anchors)
    return DSparkConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=512, target_hidden_size=64,
                        target_num_hidden_layers=12, target_layer_ids=(1, 3, 5, 7, 9), fc_norm=True,
                        aux_hidden_stream="attn_res", mask_token_id=500, markov_rank=8, eos_token_id=(2,),
                        pad_token_id=None, num_anchors=args.anchors)


def plan_memory_gib(tokens: int) -> dict | None:
    """`regen plan`'s memory per GPU for the kimi-k3 draft as this check runs it: world size 1, one micro-batch of
    `tokens` per step (so one feature object resident, no accumulation)."""
    from regen.config import load_profile
    from regen.plan import assumptions, draft_plan

    profile = load_profile("kimi-k3", [f"train.max_tokens={tokens}", f"train.max_len={tokens}", "train.grad_accum=1"])
    a = assumptions(profile, {}) | {"world_size": 1}
    d = draft_plan(profile, a, 0.0)
    return d.get("memory_per_gpu_gib")


def section_k3_step(args, device, info) -> dict:
    import torch

    from regen.train.loop import make_objective, reduce_metrics, train_step
    from regen.train.loss import sample_anchors
    from regen.train.model import DSparkDraft
    from regen.train.parallel import shard_model

    cpu = device.type != "cuda"
    cfg = k3_config(args, cpu)
    S = args.tokens
    K, N = cfg.block_size, cfg.num_anchors
    r = (S + N * K) % 128  # a second row length whose key length L = S + N·K has L % 128 == 64
    S_nan = S - ((r - 64) % 128) if S > 256 else S
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):  # built where it trains (no 24 GB host copy per rank)
        draft = DSparkDraft(cfg)
    draft.embed_tokens.to(torch.bfloat16)
    draft.lm_head.to(torch.bfloat16)
    draft.attention_impl = args.attention
    model = shard_model(make_objective(draft), info, blocks=draft.layers, param_dtype=torch.bfloat16)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    build_s = time.perf_counter() - t0
    Ht, T = cfg.target_hidden_size, len(cfg.target_layer_ids)

    def row(length: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, cfg.vocab_size - 8, (1, length), generator=g)
        loss_mask = torch.zeros(1, length, dtype=torch.long)
        loss_mask[:, length // 4:] = 1
        anchors, keep = sample_anchors(loss_mask, N, g)
        batch = {"input_ids": ids.to(device), "loss_mask": loss_mask.to(device),
                 "attention_mask": torch.ones(1, length, dtype=torch.long, device=device), "key": (0, seed),
                 "num_tokens": length}
        feats = (torch.randn(1, length, T * Ht, generator=g).to(device, torch.bfloat16),
                 torch.randn(1, length, Ht, generator=g).to(device, torch.bfloat16))
        return (batch, anchors.to(device), keep.to(device)), feats

    class Source:
        def __init__(self):
            self.feats = {}

        def features_of(self, batch):
            return self.feats[batch["key"]]

    src = Source()
    lengths = [S, S_nan] * ((args.k3_steps + 1) // 2)
    lengths = lengths[:max(2, args.k3_steps)]
    times, metrics, norms = [], [], []
    if not cpu:
        torch.cuda.reset_peak_memory_stats()
    for i, length in enumerate(lengths):
        mb, feats = row(length, i)
        src.feats[(0, i)] = feats
        if not cpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        m = train_step(model, src, opt, [mb])
        r = reduce_metrics(m)  # reads the device: the step is complete after it
        if not cpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        metrics.append(r["loss"])
        norms.append(r["grad_norm"])
        del src.feats[(0, i)]
    finite_weights = all(bool(torch.isfinite(p.full_tensor() if hasattr(p, "full_tensor") else p).all())
                         for p in model.parameters() if p.requires_grad)
    timed = times[1:] or times
    step_s = sum(timed) / len(timed)
    rec = {"section": "k3_step", "device": str(device), "tokens": S, "tokens_nan_condition": S_nan,
           "num_anchors": N, "block_size": K, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
           "attention": args.attention + (" (SDPA pinned: EFFICIENT_ATTENTION)" if args.attention == "sdpa" and not cpu
                                          else ""),
           "build_s": round(build_s, 2), "step_s": round(step_s, 4), "tokens_per_s": round(S / step_s, 1),
           "losses": [round(x, 4) for x in metrics], "grad_norms": [round(x, 4) for x in norms],
           "finite": all(math.isfinite(x) for x in metrics + norms) and finite_weights}
    if not cpu:
        rec["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 2)
        rec["gpu"] = torch.cuda.get_device_name()
    try:
        rec["plan_memory_per_gpu_gib"] = plan_memory_gib(S)  # kimi-k3 shapes at this row length, W = 1
    except Exception as exc:  # noqa: BLE001 - a figure for comparison, not the check
        rec["plan_memory_per_gpu_gib"] = f"unavailable: {exc}"
    rec["ok"] = rec["finite"]
    del model, opt, draft
    return rec


def section_h2d(args, device) -> dict:
    import torch

    cpu = device.type != "cuda"
    Ht, T = (64, 5) if cpu else (7168, 5)
    nbytes = args.tokens * (T + 1) * Ht * 2
    src = bytearray(nbytes)  # an object as the store's buffer holds it
    view = memoryview(src)
    reps = 2 if args.quick else 3

    def timed(fn):
        best = math.inf
        for _ in range(reps):
            if not cpu:
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if not cpu:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return round(nbytes / best / GiB, 3)

    n = nbytes // 2
    rec = {"section": "h2d", "device": str(device), "object_bytes": nbytes,
           "host_clone_gib_s": timed(lambda: torch.frombuffer(view, dtype=torch.bfloat16, count=n).clone())}
    from regen.train.features.staging import Staging

    staging = Staging(device)  # the trainer's path: on CUDA reused pinned slots, 2 device slots, a side stream
    header = {"dtype": "bfloat16", "tensors": {"taps": {"offset": 0, "shape": [1, args.tokens, T * Ht]},
                                                "last_hidden": {"offset": args.tokens * T * Ht * 2,
                                                                "shape": [1, args.tokens, Ht]}}}

    def through_staging():  # stage (host copy), issue (device copy), ready (the stream waits), release
        staged = staging.stage(view, header)
        out = staging.ready(staged)
        staging.release(staged)
        return out

    rec["staging_gib_s"] = timed(through_staging)
    rec["staging"] = staging.stats
    if not cpu:
        rec["before_clone_then_pageable_gib_s"] = timed(
            lambda: torch.frombuffer(view, dtype=torch.bfloat16, count=n).clone().to(device))
        pinned = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
        dst = torch.empty(n, dtype=torch.bfloat16, device=device)
        rec["pinned_h2d_only_gib_s"] = timed(lambda: dst.copy_(pinned, non_blocking=True))
    rec["ok"] = True
    return rec


def parse(argv=None):
    p = argparse.ArgumentParser(prog="bench/gpu_check.py", description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="run on CPU at toy shapes (the default without CUDA)")
    p.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    p.add_argument("--only", action="append", choices=SECTIONS, help="run only these sections (repeatable)")
    p.add_argument("--tokens", type=int, default=None, help="row length of k3_step and h2d (GPU default 32768)")
    p.add_argument("--anchors", type=int, default=None, help="num_anchors (GPU default 512, CPU 16)")
    p.add_argument("--k3-steps", type=int, default=None, help="k3_step steps, the first one untimed (default 4)")
    p.add_argument("--attention", choices=("sdpa", "flex"), default="sdpa", help="train.attention of k3_step")
    p.add_argument("--train-timeout-s", type=float, default=300.0)
    args = p.parse_args(argv)
    for name in ("tokens", "anchors", "k3_steps"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {v}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    cpu = args.cpu or not torch.cuda.is_available()
    if cpu and not args.cpu:
        print("no CUDA device visible: running the CPU fallback (toy shapes)", file=sys.stderr)
    if cpu and args.attention == "flex":
        print("--attention flex needs CUDA for training (no flex backward on CPU)", file=sys.stderr)
        return 2
    args.tokens = args.tokens or (256 if cpu else 32768)
    args.anchors = args.anchors or (16 if cpu else 512)
    args.k3_steps = args.k3_steps or (2 if args.quick else 4)
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    sections = args.only or list(SECTIONS)
    print(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}), device {device}"
          + (f" {torch.cuda.get_device_name()}" if not cpu else "") + f", sections {sections}", file=sys.stderr)
    results = []
    if "train" in sections:
        results.append(section_train(args, device))
        emit(results[-1])
    info = None
    if "k3_step" in sections:
        from regen.train.parallel import destroy_distributed, init_distributed

        info = init_distributed(device.type)
        try:
            results.append(section_k3_step(args, device, info))
        except Exception as exc:  # noqa: BLE001 - reported as the section's result
            import traceback

            results.append({"section": "k3_step", "ok": False, "error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc()[-3000:]})
        finally:
            destroy_distributed()
        emit(results[-1])
        if not cpu:
            torch.cuda.empty_cache()
    if "h2d" in sections:
        results.append(section_h2d(args, device))
        emit(results[-1])
    ok = all(r.get("ok") for r in results)
    emit({"summary": {r["section"]: r.get("ok") for r in results}, "ok": ok, "device": str(device),
          "date": time.strftime("%Y-%m-%d", time.gmtime())})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
