"""The trainer's GPU check, in one run: the kimi-k3 step, its attention, its feature path, `regen train` on a GPU.

    bash bench/gpu_check.sh                          # on one GPU (an H200: about 4 minutes); figures as JSON lines
    .venv/bin/python bench/gpu_check.py --cpu --quick  # here: the same code paths at toy shapes (seconds)
    .venv/bin/python bench/gpu_check.py --only k3_step --tokens 16384

Sections, each guarded (one failing or raising does not hide the others), each printing one JSON object on a line
of its own, then a summary (exit 0: every section passed; 1: one failed; 2: bad arguments; 3: no CUDA device):

0. imports: every module the sections use, with where each came from (the image's packages, the carried wheels or
   the working tree). Runs first, on any machine: a missing package is named before anything needs a GPU.
1. k3_step: the kimi-k3 draft (5 MLA layers, H 7,168, 64 heads, V 163,840) built on the device, sharded by FSDP2 with
   bf16 compute, trained by `regen.train.step.train_step` on synthetic features of one row of `--tokens` tokens and
   one whose key length L = S + N·K has L % 128 == 64 (the cuDNN NaN condition of pytorch/pytorch#196678): step
   seconds, tokens/s, the step's FLOPs counted by `torch.utils.flop_counter.FlopCounterMode` on an untimed step,
   TFLOP/s and MFU (against `--peak-tflops`, default the GPU's dense bf16 peak from NVIDIA's datasheets),
   `max_memory_allocated` and `max_memory_reserved` beside `regen plan`'s memory per GPU for the same row at world
   size 1, the host syncs of one step seen by `torch.cuda.set_sync_debug_mode("warn")` with the regen line each comes
   from, and finite loss, grad norm and weights.
2. store_step: one step of `--grad-accum` micro-batches (default 3) whose features come through the trainer's feature
   client (`RemoteFeatures`: store read into a host slot, header check, pinned staging, side-stream copy) from an
   in-memory store, against the same rows with features already on the device: step seconds of each, the objects
   resident on the device at most, pinned host bytes.
3. h2d: feature bytes per second into the device for one K3 feature object of `--tokens` tokens: the staging path
   (`regen.train.features.staging`), a clone then a pageable copy, the pinned copy alone, the host copy.
4. train: `regen train` at world size 1 (NCCL on CUDA) on a tiny random target built here (`bench/train.py --quick`):
   the loss must fall and the run must end without error (under a time limit: a process of its own).
5. attention: one K3 attention layer's core (q [1, 64, N·K, 192], k [1, 64, L, 192], v [1, 64, L, 128], bf16, the
   DSpark block mask of 512 anchors over a `--tokens` row) forward and backward with SDPA's memory-efficient and
   cuDNN backends and `flex_attention` with the block mask: milliseconds, agreement with memory-efficient attention
   (max abs difference of the output and of dq, dk, dv), finiteness; SDPA also at a key length with L % 128 == 64.
   Last, because flex compiles.

No network: everything is synthetic or built here. Without CUDA the check stops after the imports with exit status 3
and says so; `--cpu` runs every section at a K3-structured toy shape instead (`--quick` fewer steps): the check of
the code paths, not a measurement.
"""
from __future__ import annotations

import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
from _preamble import ROOT  # noqa: E402 - bench/ off sys.path, the repository root first, HF offline

import argparse
import collections
import json
import math
import subprocess
import time
import traceback
import warnings
from pathlib import Path

GiB = 1024 ** 3
SECTIONS = ("k3_step", "store_step", "h2d", "train", "attention")  # flex compiles last
NO_CUDA_EXIT = 3
# every module a section imports: checked first (section 0), so a package the GPU image lacks is named up front
MODULES = ("torch", "torch.distributed.fsdp", "torch.nn.attention", "torch.nn.attention.flex_attention",
           "torch.utils.flop_counter", "pydantic", "yaml", "safetensors", "pyarrow", "transformers",
           "regen.config", "regen.report.plan", "regen.train.loop", "regen.train.trainer", "regen.train.step",
           "regen.train.model", "regen.train.draft_config", "regen.train.parallel", "regen.train.loss", "regen.train.attention",
           "regen.train.features.client", "regen.train.features.contract", "regen.train.features.staging")
# dense bf16 tensor-core peak per GPU, TFLOP/s (NVIDIA datasheets: H100/H200 SXM 989, B200 2,250, GB200 2,500 per GPU,
# A100 312); matched on torch.cuda.get_device_name(), the first match wins
PEAK_BF16_TFLOPS = (("GB200", 2500.0), ("B200", 2250.0), ("H200", 989.0), ("H100", 989.0), ("A100", 312.0))


def emit(rec: dict) -> None:
    print(json.dumps(rec), flush=True)


def section_imports(args, device) -> dict:
    import importlib

    origins, missing = {}, {}
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
            origins[name] = str(Path(getattr(mod, "__file__", "") or "").parent)
        except Exception as exc:  # noqa: BLE001 - every missing module named, not only the first
            missing[name] = f"{type(exc).__name__}: {exc}"
    import torch

    return {"section": "imports", "python": sys.version.split()[0], "torch": torch.__version__,
            "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(), "origins": origins,
            "missing": missing, "ok": not missing}


def peak_tflops(args) -> float | None:
    import torch

    if args.peak_tflops:
        return args.peak_tflops
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((p for key, p in PEAK_BF16_TFLOPS if key in name), None)


def k3_config(args, cpu: bool):
    from regen.train.draft_config import DSparkConfig, kimi_k3_config

    if not cpu:
        return kimi_k3_config(num_anchors=args.anchors)
    return DSparkConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=512, target_hidden_size=64,
                        target_num_hidden_layers=12, target_layer_ids=(1, 3, 5, 7, 9), fc_norm=True,
                        aux_hidden_stream="attn_res", mask_token_id=500, markov_rank=8, eos_token_id=(2,),
                        pad_token_id=None, num_anchors=args.anchors)


def plan_memory_gib(tokens: int, grad_accum: int = 1) -> dict | None:
    """`regen plan`'s memory per GPU for the kimi-k3 draft as this check runs it: world size 1, `grad_accum`
    micro-batches of `tokens` per step."""
    from regen.config import load_profile
    from regen.report.plan import assumptions, draft_plan

    profile = load_profile("kimi-k3", [f"train.max_tokens={tokens}", f"train.max_len={tokens}",
                                       f"train.grad_accum={grad_accum}"])
    a = assumptions(profile, {}) | {"world_size": 1}
    return draft_plan(profile, a, 0.0).get("memory_per_gpu_gib")


def nan_condition_length(S: int, N: int, K: int) -> int:
    """A row length near S whose key length L = S + N·K has L % 128 == 64."""
    r = (S + N * K) % 128
    return S - ((r - 64) % 128) if S > 256 else S


class K3Bench:
    """The K3 draft as the trainer builds it (on the device, FSDP2 bf16), its optimizer and synthetic rows."""

    def __init__(self, args, device, info):
        import torch

        from regen.train.model import DSparkDraft
        from regen.train.parallel import shard_model
        from regen.train.step import make_objective

        self.torch, self.device, self.cpu = torch, device, device.type != "cuda"
        self.cfg = cfg = k3_config(args, self.cpu)
        torch.manual_seed(0)
        t0 = time.perf_counter()
        with torch.device(device):  # built where it trains (no 24 GB host copy per rank)
            draft = DSparkDraft(cfg)
        draft.embed_tokens.to(torch.bfloat16)
        draft.lm_head.to(torch.bfloat16)
        draft.attention_impl = args.attention
        self.draft = draft
        self.model = shard_model(make_objective(draft), info, blocks=draft.layers, param_dtype=torch.bfloat16)
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-4)
        self.build_s = time.perf_counter() - t0
        self.Ht, self.T = cfg.target_hidden_size, len(cfg.target_layer_ids)

    def row(self, length: int, seed: int):
        """((batch, anchors, keep), (taps, last_hidden)) of a synthetic row (random ids, the last 3/4 supervised),
        prepared by the trainer's own `prepare_microbatch` (anchors, the loss's slot layout, all on the host)."""
        from types import SimpleNamespace

        from regen.train.step import prepare_microbatch

        torch, cfg, device = self.torch, self.cfg, self.device
        g = torch.Generator().manual_seed(seed)
        loss_mask = torch.zeros(1, length, dtype=torch.long)
        loss_mask[:, length // 4:] = 1
        mb = SimpleNamespace(epoch=0, index=seed, sample_ids=[f"gpu-check-{seed}"], loss_mask=loss_mask,
                             input_ids=torch.randint(3, cfg.vocab_size - 8, (1, length), generator=g),
                             attention_mask=torch.ones(1, length, dtype=torch.long))
        batch, anchors, keep = prepare_microbatch(mb, 0, cfg, device)
        gd = torch.Generator(device=device).manual_seed(seed)
        feats = (torch.randn(1, length, self.T * self.Ht, generator=gd, device=device, dtype=torch.bfloat16),
                 torch.randn(1, length, self.Ht, generator=gd, device=device, dtype=torch.bfloat16))
        return (batch, anchors, keep), feats

    def sync(self):
        if not self.cpu:
            self.torch.cuda.synchronize()

    def step(self, source, mbs) -> tuple[float, dict]:
        from regen.train.step import reduce_metrics, train_step

        self.sync()
        t = time.perf_counter()
        m = train_step(self.model, source, self.opt, mbs)
        r = reduce_metrics(m)  # reads the device: the step is complete after it
        self.sync()
        return time.perf_counter() - t, r | {"finite": m["finite"]}


class Resident:
    """Features already on the device, by micro-batch key (the baseline of the feature path)."""

    def __init__(self):
        self.feats = {}

    def features_of(self, batch):
        return self.feats[batch["key"]]


def count_syncs(fn):
    """Run `fn()` under `torch.cuda.set_sync_debug_mode("warn")`: {regen file:line (or the op's caller): count} of
    the synchronizing CUDA calls it made, and fn's result."""
    import torch

    import regen

    seen = collections.Counter()
    package = os.path.dirname(os.path.abspath(regen.__file__)) + os.sep  # not any path holding /regen/

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(package)]
        f = frames[-1] if frames else None
        seen[f"{f.filename[len(package):]}:{f.lineno}" if f else f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return dict(seen.most_common()), out


def section_k3_step(args, device, info) -> dict:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    kb = K3Bench(args, device, info)
    cfg, S = kb.cfg, args.tokens
    S_nan = nan_condition_length(S, cfg.num_anchors, cfg.block_size)
    src = Resident()
    if not kb.cpu:
        torch.cuda.reset_peak_memory_stats()
    # untimed first step, its FLOPs counted with the dense attention (counted whole, as SDPA computes it; flex skips
    # masked tiles, so its figure is the same work done faster). FlopCounterMode is a dispatch mode, under which
    # torch.compile'd flex falls back to eager: the counted step runs SDPA whatever --attention
    mb, feats = kb.row(S, 0)
    src.feats[(0, 0)] = feats
    counter = FlopCounterMode(display=False)
    kb.draft.attention_impl = "sdpa"
    try:
        with counter:
            first_s, r0 = kb.step(src, [mb])
    finally:
        kb.draft.attention_impl = args.attention
    flops = counter.get_total_flops()
    from regen.train.flops import row_flops

    counted_by_plan = row_flops(cfg, tokens=S)  # regen plan's per-part count (every slot supervised: an upper bound)
    del src.feats[(0, 0)]
    times, losses, norms, finite = [], [r0["loss"]], [r0["grad_norm"]], [r0["finite"]]
    lengths = [S, S_nan] * ((args.k3_steps + 1) // 2)
    for i, length in enumerate(lengths[:max(2, args.k3_steps)], start=1):
        mb, feats = kb.row(length, i)
        src.feats[(0, i)] = feats
        dt, r = kb.step(src, [mb])
        times.append((length, dt))
        losses.append(r["loss"])
        norms.append(r["grad_norm"])
        finite.append(r["finite"])
        del src.feats[(0, i)]
    step_s = [dt for length, dt in times if length == S]
    step_s = sum(step_s) / len(step_s)
    rec = {"section": "k3_step", "device": str(device), "tokens": S, "tokens_nan_condition": S_nan,
           "num_anchors": cfg.num_anchors, "block_size": cfg.block_size, "layers": cfg.num_hidden_layers,
           "hidden": cfg.hidden_size, "attention": args.attention + (" (SDPA pinned: EFFICIENT_ATTENTION)"
                                                                     if args.attention == "sdpa" and not kb.cpu else ""),
           "build_s": round(kb.build_s, 2), "first_step_s (FLOPs counted)": round(first_s, 3),
           "step_s": round(step_s, 4), "step_s_nan_condition": [round(dt, 4) for n, dt in times if n == S_nan],
           "tokens_per_s": round(S / step_s, 1), "flops_per_row_counted": flops,
           "plan_over_counted": round(counted_by_plan["total"] / flops, 4),
           "flops_per_row_plan": {k: round(v / 1e12, 2) for k, v in counted_by_plan.items()},
           "tflops_per_s": round(flops / step_s / 1e12, 1),
           "losses": [round(x, 4) for x in losses], "grad_norms": [round(x, 4) for x in norms]}
    peak = peak_tflops(args)
    if peak:
        rec |= {"peak_tflops": peak, "mfu": round(flops / step_s / 1e12 / peak, 4)}
    if not kb.cpu:
        rec["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 2)
        rec["max_memory_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GiB, 2)
        rec["gpu"] = torch.cuda.get_device_name()
        mb, feats = kb.row(S, 99)
        src.feats[(0, 99)] = feats
        syncs, (dt, r) = count_syncs(lambda: kb.step(src, [mb]))
        rec["syncs_per_step"] = {"total": sum(syncs.values()), "where": syncs}
        finite.append(r["finite"])
    finite_weights = all(bool(torch.isfinite(p.full_tensor() if hasattr(p, "full_tensor") else p).all())
                         for p in kb.model.parameters() if p.requires_grad)
    rec["finite"] = all(finite) and all(math.isfinite(x) for x in losses + norms) and finite_weights
    try:
        rec["plan_memory_per_gpu_gib"] = plan_memory_gib(S)  # kimi-k3 shapes at this row length, W = 1
    except Exception as exc:  # noqa: BLE001 - a figure for comparison, not the check
        rec["plan_memory_per_gpu_gib"] = f"unavailable: {type(exc).__name__}: {exc}"
    rec["ok"] = rec["finite"]
    return rec


class DictStore:
    """A store with only `get` (the feature client's other path: one host copy out of its buffer into a slot)."""

    def __init__(self):
        self.objects = {}

    def get(self, key):
        return memoryview(self.objects[key]), None


def section_store_step(args, device, info) -> dict:
    """One step of grad_accum micro-batches through `RemoteFeatures` against the same rows resident on the device."""
    from types import SimpleNamespace

    from regen.train.features import client as client_mod
    from regen.train.features.client import RemoteFeatures
    from regen.train.features.contract import FeatureSpec, encode, make_header

    kb = K3Bench(args, device, info)
    cfg, S, A = kb.cfg, args.tokens, args.grad_accum
    spec = FeatureSpec("regen/gpu-check", tuple(cfg.target_layer_ids), "prefix", "bfloat16", kb.Ht,
                       cfg.target_num_hidden_layers, "gpu-check")
    store, resident, mbs = DictStore(), Resident(), []
    for i in range(A):
        mb, (taps, last) = kb.row(S, 10 + i)
        b = mb[0]
        resident.feats[b["key"]] = (taps, last)
        h = make_header(spec, epoch=0, index=10 + i, attempt=0, sample_ids=[f"gpu-check-{i}"],
                        input_ids=b["input_ids"].cpu(), attention_mask=b["attention_mask"].cpu(),
                        producer={"id": "gpu-check", "engine": "synthetic"}, stream_reading="gpu-check")
        parts, _ = encode(h, taps.cpu(), last.cpu())
        store.objects[str(b["key"])] = b"".join(bytes(p) for p in parts)
        mbs.append(mb)
    kb.step(resident, mbs)  # warm-up: the optimizer's state exists before either timed step
    resident_s, _ = kb.step(resident, mbs)

    def post(url, path, body, timeout_s=None):
        if path == "/wait":
            key = str((body["epoch"], body["index"]))
            return {"status": "ready", "key": key, "nbytes": len(store.objects[key])}
        return {}

    real_post, client_mod.post = client_mod.post, post
    try:
        remote = RemoteFeatures("http://gpu-check", store, spec, SimpleNamespace(device=device), device)
        kb.sync()
        t = time.perf_counter()
        remote.fetch([SimpleNamespace(epoch=b["key"][0], index=b["key"][1], input_ids=b["input_ids"].cpu(),
                                      sample_ids=["x"], attention_mask=b["attention_mask"].cpu()) for b, _, _ in mbs])
        fetch_s = time.perf_counter() - t
        step_s, r = kb.step(remote, mbs)
        stats = dict(remote.staging.stats)
        remote.close()
        # the same step read ahead (train.producers.read_ahead 2): the reader thread reads while micro-batches compute
        ahead = RemoteFeatures("http://gpu-check", store, spec, SimpleNamespace(device=device), device, read_ahead=2)
        kb.sync()
        t = time.perf_counter()
        ahead.submit([SimpleNamespace(epoch=b["key"][0], index=b["key"][1], input_ids=b["input_ids"].cpu(),
                                      sample_ids=["x"], attention_mask=b["attention_mask"].cpu()) for b, _, _ in mbs])
        kb.step(ahead, mbs)
        overlap_s = time.perf_counter() - t  # from the submit to the step's end: the reads inside it
        ahead_stats = {"stall_s": round(ahead.stats["stall_s"], 3), "host_slots": len(ahead.staging.host),
                       "resident_max": ahead.staging.stats["resident_max"]}
        ahead.close()
    finally:
        client_mod.post = real_post
    obj_bytes = len(next(iter(store.objects.values())))
    return {"section": "store_step", "device": str(device), "tokens": S, "grad_accum": A,
            "object_gib": round(obj_bytes / GiB, 3), "resident_step_s": round(resident_s, 3),
            "store_fetch_s": round(fetch_s, 3), "store_step_s": round(step_s, 3),
            "store_total_over_resident": round((fetch_s + step_s) / resident_s, 3),
            "store_read_ahead_step_s": round(overlap_s, 3),
            "store_read_ahead_over_resident": round(overlap_s / resident_s, 3), "store_read_ahead": ahead_stats,
            "resident_max": stats.get("resident_max"), "pinned_bytes": stats.get("pinned_bytes"),
            "pinned_gib_per_object": round((stats.get("pinned_bytes") or 0) / GiB / A, 3), "staging": stats,
            "finite": bool(r["finite"]), "ok": bool(r["finite"]) and stats.get("resident_max", 0) <= 2}


def section_attention(args, device) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from regen.train.loss import create_block_attention_mask, sample_anchors

    cpu = device.type != "cuda"
    cfg = k3_config(args, cpu)
    nh, dqk = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    dv, K, N = cfg.v_head_dim, cfg.block_size, cfg.num_anchors
    scale = dqk ** -0.5
    out = {"section": "attention", "device": str(device), "heads": nh, "d_qk": dqk, "d_v": dv, "queries": N * K}
    reps = 1 if args.quick else 3
    ok = True
    lengths = [args.tokens, nan_condition_length(args.tokens, N, K)]
    for S in dict.fromkeys(lengths):
        L = S + N * K
        g = torch.Generator().manual_seed(S)
        lm = torch.zeros(1, S, dtype=torch.long)
        lm[:, S // 4:] = 1
        anchors, keep = sample_anchors(lm, N, g)
        anchors, keep = anchors.to(device), keep.to(device)
        dense = create_block_attention_mask(anchors, keep, S, K)[:, None]
        gd = torch.Generator(device=device).manual_seed(S)
        q, k, v = (torch.randn(1, nh, n, d, generator=gd, device=device, dtype=torch.bfloat16)
                   for n, d in ((N * K, dqk), (L, dqk), (L, dv)))
        dout = torch.randn(1, nh, N * K, dv, generator=gd, device=device, dtype=torch.bfloat16)

        def sdpa(backend):
            def fn(q, k, v):
                if cpu:
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale)
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale)
            return fn

        def flex():
            from regen.train.attention import attend, dspark_block_mask

            bm = dspark_block_mask(anchors, keep, S, K)
            return lambda q, k, v: attend(q, k, v, bm, scale)

        results, ref = {}, None
        for name, make in (("efficient", lambda: sdpa(SDPBackend.EFFICIENT_ATTENTION)),
                           ("cudnn", lambda: sdpa(SDPBackend.CUDNN_ATTENTION)), ("flex", flex)):
            if cpu and name != "efficient":
                continue  # on CPU: the code path of the dense mask only (no cuDNN, no flex backward)
            if name == "flex" and S != lengths[0]:
                continue  # flex compiles per key length: timed at the first length only
            try:
                fn = make()
                best, t_first = math.inf, None
                for rep in range(reps + 1):
                    qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
                    if not cpu:
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    o = fn(qq, kk, vv)
                    o.backward(dout)
                    if not cpu:
                        torch.cuda.synchronize()
                    dt = time.perf_counter() - t
                    t_first = dt if t_first is None else t_first
                    best = dt if rep else best  # the first call compiles or picks a kernel: untimed
                grads = (o.detach(), qq.grad, kk.grad, vv.grad)
                rec = {"ms": round(best * 1e3, 2), "first_call_s": round(t_first, 2),
                       "finite": all(bool(torch.isfinite(x).all()) for x in grads)}
                if ref is None:
                    ref = grads
                else:
                    rec["max_abs_diff"] = {n: round(float((a.float() - b.float()).abs().max()), 5)
                                           for n, a, b in zip(("out", "dq", "dk", "dv"), grads, ref)}
                ok &= rec["finite"] if name == "efficient" else True  # the pinned backend must hold
                results[name] = rec
            except Exception as exc:  # noqa: BLE001 - a backend that cannot run is a finding, not a stop
                results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
                ok &= name != "efficient"
        out[f"S={S} L={L} (L%128={L % 128})"] = results
        del q, k, v, dout  # (the mask is rebound by the next length)
    out["ok"] = ok
    return out


def section_h2d(args, device) -> dict:
    import torch

    from regen.train.features.staging import Staging

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
        rec["clone_then_pageable_gib_s"] = timed(
            lambda: torch.frombuffer(view, dtype=torch.bfloat16, count=n).clone().to(device))
        pinned = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
        dst = torch.empty(n, dtype=torch.bfloat16, device=device)
        rec["pinned_h2d_only_gib_s"] = timed(lambda: dst.copy_(pinned, non_blocking=True))
    staging.close()
    rec["ok"] = True
    return rec


def section_train(args, device) -> dict:
    steps = 3 if args.quick else 20
    cmd = [sys.executable, str(ROOT / "bench" / "train.py"), "--quick", "--steps", str(steps),
           "--set", f"train.device={device.type}", "--set", "train.lr=3e-3"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.train_timeout_s)
    except subprocess.TimeoutExpired:
        return {"section": "train", "ok": False, "error": f"bench/train.py ran past {args.train_timeout_s:.0f} s"}
    rec = {"section": "train", "device": device.type, "steps": steps, "seconds": round(time.perf_counter() - t0, 1),
           "returncode": proc.returncode}
    if proc.returncode != 0:
        return rec | {"ok": False, "error": (proc.stderr or proc.stdout)[-2000:]}
    out = json.loads(proc.stdout[proc.stdout.index("{"):])
    rec |= {k: out[k] for k in ("loss_first", "loss_last", "train_tokens_per_s", "device")}
    rec["ok"] = bool(out["loss_last"] < out["loss_first"]) and math.isfinite(out["loss_last"])
    return rec


def parse(argv=None):
    p = argparse.ArgumentParser(prog="bench/gpu_check.py", description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="run every section on CPU at toy shapes (code paths only)")
    p.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    p.add_argument("--only", action="append", choices=SECTIONS, help="run only these sections (repeatable)")
    p.add_argument("--tokens", type=int, default=None, help="row length (GPU default 32768, CPU 256)")
    p.add_argument("--anchors", type=int, default=None, help="num_anchors (GPU default 512, CPU 16)")
    p.add_argument("--k3-steps", type=int, default=None, help="timed k3_step steps (default 4, --quick 2)")
    p.add_argument("--grad-accum", type=int, default=3, help="micro-batches of the store_step step (default 3)")
    p.add_argument("--attention", choices=("sdpa", "flex"), default="sdpa", help="train.attention of k3_step")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak for MFU")
    p.add_argument("--train-timeout-s", type=float, default=150.0)
    args = p.parse_args(argv)
    for name in ("tokens", "anchors", "k3_steps", "grad_accum"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {v}")
    return args


def guarded(name, fn, *a) -> dict:
    """A section's record, or its error and traceback: one failing section does not hide the others."""
    try:
        return fn(*a)
    except Exception as exc:  # noqa: BLE001 - reported as the section's result
        return {"section": name, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:2000]}",
                "traceback": traceback.format_exc()[-3000:]}


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    if args.cpu and args.attention == "flex":
        print("--attention flex needs CUDA for training (no flex backward on CPU)", file=sys.stderr)
        return 2
    cpu = args.cpu
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    results = [section_imports(args, device)]
    emit(results[0])
    if not cpu and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device visible to torch {torch.__version__} (built with CUDA "
              f"{torch.version.cuda}): this check measures a GPU and has measured nothing. Run it on the GPU machine "
              "(bash bench/gpu_check.sh), or pass --cpu to check the code paths at toy shapes.", file=sys.stderr)
        return NO_CUDA_EXIT
    args.tokens = args.tokens or (256 if cpu else 32768)
    args.anchors = args.anchors or (16 if cpu else 512)
    args.k3_steps = args.k3_steps or (2 if args.quick else 4)
    sections = [s for s in SECTIONS if s in (args.only or SECTIONS)]
    print(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}), device {device}"
          + (f" {torch.cuda.get_device_name()}" if not cpu else "") + f", sections {sections}", file=sys.stderr)
    if results[0]["missing"]:
        print(f"gpu_check: missing modules {sorted(results[0]['missing'])}: the sections that need them fail",
              file=sys.stderr)
    from regen.train.parallel import destroy_distributed, init_distributed

    for name in sections:
        if name in ("k3_step", "store_step"):
            def run(name=name):
                info = init_distributed(device.type)
                try:
                    return (section_k3_step if name == "k3_step" else section_store_step)(args, device, info)
                finally:
                    destroy_distributed()
            rec = guarded(name, run)
        else:
            rec = guarded(name, {"attention": section_attention, "h2d": section_h2d, "train": section_train}[name],
                          args, device)
        results.append(rec)
        emit(rec)
        import gc

        gc.collect()
        if not cpu:
            torch.cuda.empty_cache()
    ok = all(r.get("ok") for r in results)
    emit({"summary": {r["section"]: r.get("ok") for r in results}, "ok": ok, "device": str(device),
          "torch": torch.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime())})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
