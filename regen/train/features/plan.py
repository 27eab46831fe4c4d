"""`regen plan`'s training-side figures for target features: bytes, store memory, target memory per rank, and
how many producer GPUs keep the trainer GPUs busy (`train.features`, docs/train.md, "Training at scale").

Formulas (printed with the figures; `assumed` marks what no command here measured):
  feature bytes / token  = (taps + 1) x H_target x dtype bytes  (the taps and the last hidden state, per token)
  feature bytes / row    = that x tokens per row (mean: shard tokens / rows, each cut at train.max_len; max:
                           train.max_tokens, the largest micro-batch)
  store memory           = train.producers.budget_bytes (0 = 8 largest objects), in objects of a mean row
  target memory / rank   = in_process: 2 or 4 B x the target's parameters (plan.target_total_params);
                           producers: (V x H embeddings + V x H LM head unless tied + H final norm) x dtype bytes
  trainer rows/s         = world_size / plan.trainer_seconds_per_row                          (assumed)
  producer tokens/s      = trainer rows/s x mean tokens per row
  producer engines       = ceil(producer tokens/s / plan.producer_prefill_tokens_per_s)       (assumed)
  producer GPUs          = engines x plan.producer_gpus_per_engine
  target forward FLOPs   = 2 x plan.target_active_params x training tokens, on the producers' GPUs (with
                           `producers`) or the trainer's (`in_process`)
  host memory / rank     = (read_ahead, or grad_accum with read_ahead 0) exact feature slots + the store
                           segment + the store client's buffer
                           (`regen.train.memory.host_memory_bytes`), and whether a GB200 tray holds its 4 ranks
"""
from __future__ import annotations

import math

GiB = 1024 ** 3
KiB = 1024


def dtype_bytes(train) -> int:
    """Bytes per feature element: the target dtype on a GPU cluster (`auto` = bf16 on CUDA)."""
    return 4 if train.target_dtype == "float32" else 2


def checkpoint_params(path) -> int | None:
    """Parameters stored in a local safetensors checkpoint (headers only: no tensor is read), or None."""
    import json
    import struct

    from regen.errors import InputError
    from regen.train.target_head import weight_map

    try:
        files = sorted(set(weight_map(path).values()))
    except InputError:
        return None
    total = 0
    for name in files:
        with open(path / name, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                total += math.prod(v["shape"])
    return total


def feature_plan(profile, a: dict, tc, shard_rows: float, shard_tokens: float) -> dict:
    """The figures of the module docstring for `profile` (`a`: the plan's assumptions, `tc`: the target's config
    as attributes or None)."""
    t = profile.train
    if tc is None:
        return {"note": "the target's config is not readable: no feature figures"}
    H, L, V = int(tc.hidden_size), int(tc.num_hidden_layers), int(getattr(tc, "vocab_size", 0) or 0)
    taps = len(t.target_layer_ids) or 3
    eb = dtype_bytes(t)
    per_token = (taps + 1) * H * eb
    mean_tokens = min(shard_tokens / shard_rows, t.max_len) if shard_rows else 0.0
    largest = t.max_tokens * per_token
    budget = t.producers.budget_bytes or 8 * largest
    tied = bool(getattr(tc, "tie_word_embeddings", False))
    head = (V * H * (1 if tied else 2) + H) * eb
    from regen.config import resolve_path

    path = resolve_path(t.target) if t.target else None
    counted = checkpoint_params(path) if path is not None and "$" not in str(path) and path.is_dir() else None
    total_params = counted or a.get("target_total_params") or 0.0
    producers = t.features == "producers"
    in_rank = head if producers else total_params * eb
    out = {
        "features_from": t.features, "taps": taps, "target_hidden_size": H, "target_layers": L, "dtype_bytes": eb,
        "bytes_per_token": per_token, "bytes_per_token_formula": f"({taps} + 1) x {H} x {eb} B",
        "tokens_per_row_mean": round(mean_tokens, 1), "bytes_per_row_mean": round(mean_tokens * per_token),
        "largest_object_bytes": largest, "largest_object_formula": f"train.max_tokens {t.max_tokens} x {per_token:,} B",
        "store_budget_bytes": budget, "store_objects_at_budget": round(budget / (mean_tokens * per_token), 1)
        if mean_tokens else None,
        "budget_source": "train.producers.budget_bytes" if t.producers.budget_bytes else "8 x the largest object",
        "target_memory_per_rank_bytes": in_rank,
        "target_memory_formula": (f"({V:,} x {H} {'(tied)' if tied else 'x 2'} + {H}) x {eb} B: embeddings, LM head, "
                                  "final norm" if producers else
                                  f"{total_params:,.0f} target parameters x {eb} B ("
                                  + ("counted in its checkpoint)" if counted else "plan.target_total_params, assumed)"
                                     if total_params else "plan.target_total_params: not stated)")),
    }
    W = a["world_size"]
    sec_row, prefill, per_engine = (a.get("trainer_seconds_per_row") or 0.0, a.get("producer_prefill_tokens_per_s")
                                    or 0.0, a.get("producer_gpus_per_engine") or 1)
    if sec_row and prefill and mean_tokens:
        rows_s = W / sec_row
        tokens_s = rows_s * mean_tokens
        engines = max(1, math.ceil(tokens_s / prefill))
        out.update({
            "trainer_rows_per_s": round(rows_s, 3), "producer_tokens_per_s_needed": round(tokens_s),
            "producer_engines": engines, "producer_gpus": engines * per_engine,
            "feature_bytes_per_s": round(rows_s * mean_tokens * per_token),
            "balance_formula": (f"{W} trainer GPUs / {sec_row} s per row (assumed) = {rows_s:.2f} rows/s x "
                                f"{mean_tokens:,.0f} tokens = {tokens_s:,.0f} tokens/s; / {prefill:,.0f} prefill "
                                f"tokens/s per engine (assumed) = {engines} engine(s) x {per_engine} GPUs"),
        })
    else:
        out["balance_formula"] = ("not computed: plan.trainer_seconds_per_row and plan.producer_prefill_tokens_per_s "
                                  "are not stated")
    return out


def host_plan(t, cfg, W: int, producers: bool) -> dict:
    """The host memory per GPU that the producers' client allocates (`regen.train.memory.host_memory_bytes`: the
    step's feature slots, exact; the store segment and transfer buffer as `regen.train.features.pool.sizes_for`
    sizes them), its formulas, and whether a GB200 tray's host memory holds its ranks (`tray_host_check`)."""
    from regen.errors import InputError
    from regen.train.feature_cache import feature_cache_bytes
    from regen.train.features.pool import sizes_for
    from regen.train.memory import (
        HOST_COUNTED_SHARE,
        host_memory_bytes,
        host_slots,
        largest_object_bytes,
        tray_host_check,
    )

    if not producers:  # the in-process target: only the feature cache, when it is on (regen.train.feature_cache)
        cache = feature_cache_bytes(t.feature_cache_gib)
        if not cache:
            return {"host_memory_per_gpu_gib": {"total": 0.0}, "host_memory_formulas": {"total": "in process: none"}}
        return {"host_memory_per_gpu_bytes": {"feature_cache": cache, "total": cache},
                "host_memory_per_gpu_gib": {"feature_cache": round(cache / GiB, 2), "total": round(cache / GiB, 2)},
                "host_memory_formulas": {
                    "feature_cache": "train.feature_cache_gib, at most, per rank: each row's taps and last hidden "
                                     "state kept after its first forward (pageable; a row past it is not kept)",
                    "total": "in process: the feature cache only"}}
    taps, eb = len(cfg.target_layer_ids), 4 if t.target_dtype == "float32" else 2
    largest = largest_object_bytes(cfg, tokens=t.max_tokens, max_batch=t.max_batch, feature_bytes=eb)
    try:
        sizes = sizes_for(t.producers, taps, cfg.target_hidden_size, "float32" if eb == 4 else "bfloat16", W,
                          t.max_tokens, t.max_batch)
    except InputError as exc:
        return {"host_memory_per_gpu_gib": {"total": 0.0}, "host_memory_formulas": {"total": f"not computed: {exc}"}}
    ra = t.producers.read_ahead
    host = host_memory_bytes(cfg, tokens=t.max_tokens, grad_accum=t.grad_accum, max_batch=t.max_batch,
                             segment_bytes=sizes["segment_bytes_per_rank"],
                             transfer_buffer_bytes=sizes["local_buffer_bytes"], feature_bytes=eb, read_ahead=ra)
    slots = host_slots(grad_accum=t.grad_accum, read_ahead=ra)
    why = (f"train.producers.read_ahead: {ra} objects read ahead of the micro-batch computing (each slot read into "
           "again once its device copy is done)" if ra > 0 else
           "train.producers.read_ahead 0: a step's grad_accum objects, read out of the store before its first forward")
    total = sum(host.values())
    tray = tray_host_check(total, world_size=W)
    return {
        "host_memory_per_gpu_bytes": host | {"total": total},
        "host_memory_per_gpu_gib": {k: round(v / GiB, 2) for k, v in host.items()} | {"total": round(total / GiB, 2)},
        "host_memory_formulas": {
            "feature_staging": (f"{slots} slot(s) x the largest object, {largest:,} B ({t.max_tokens} x ({taps} "
                                f"+ 1) x {cfg.target_hidden_size} x {eb} B + header): {why}; each slot one exact "
                                "allocation page-locked by cudaHostRegister (pin_memory=True would round it up to a "
                                "power of two)"),
            "store_segment": ("this rank's share of train.producers.budget_bytes + one object (Mooncake segment)"
                              if t.producers.store.segment_bytes_per_rank is None
                              else "train.producers.store.segment_bytes_per_rank"),
            "transfer_buffer": ("2 x the largest object (the store client's local buffer)"
                                if not t.producers.store.local_buffer_bytes
                                else "train.producers.store.local_buffer_bytes"),
            "total": "page-locked and NIC-registered; the trainer process's own memory (Python, CUDA context, shard "
                     "tables, checkpoint staging) is not counted"},
        "host_tray": tray | {"holds_text": (
            f"{tray['ranks']} ranks x {total / GiB:,.2f} GiB = {tray['bytes'] / 1e9:,.0f} GB of a GB200 tray's "
            f"{tray['tray_bytes'] / 1e9:,.0f} GB LPDDR5X ({tray['share']:.0%}): "
            + ("holds" if tray["holds"] else "does NOT hold")
            + f" (counted memory within {HOST_COUNTED_SHARE:.0%} of the tray, the rest left for the OS and the processes)")},
    }


def rows(f: dict) -> list[list[str]]:
    """Table rows (figure, value, how) for `print_plan`."""
    if "bytes_per_token" not in f:
        return [["features", "-", f.get("note", "")]]
    out = [
        ["features from", f["features_from"], "train.features"],
        ["feature bytes / token", f"{f['bytes_per_token'] / KiB:,.1f} KiB", f["bytes_per_token_formula"]],
        ["feature bytes / row mean", f"{f['bytes_per_row_mean'] / GiB:,.3f} GiB",
         f"{f['tokens_per_row_mean']:,} tokens per row (shard tokens / rows, cut at train.max_len)"],
        ["largest feature object", f"{f['largest_object_bytes'] / GiB:,.3f} GiB", f["largest_object_formula"]],
        ["store memory (budget)", f"{f['store_budget_bytes'] / GiB:,.2f} GiB",
         f"{f['budget_source']}; about {f['store_objects_at_budget']} mean rows ahead of the trainer"],
        ["target memory / trainer rank", f"{f['target_memory_per_rank_bytes'] / GiB:,.2f} GiB",
         f["target_memory_formula"]],
    ]
    if "producer_gpus" in f:
        out += [["producer GPUs for the trainers", f"{f['producer_gpus']} ({f['producer_engines']} engines)",
                 f["balance_formula"]],
                ["feature bytes/s to the trainers", f"{f['feature_bytes_per_s'] / GiB:,.2f} GiB/s",
                 "trainer rows/s x mean row bytes"]]
    else:
        out.append(["producer GPUs", "-", f["balance_formula"]])
    return out
