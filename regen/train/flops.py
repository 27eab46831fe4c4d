"""FLOPs of one training row of the DSpark draft, forward + backward, counted part by part from its shapes.

Legend (as `regen.train.memory`): S context tokens of the row, N anchors x K block size -> Q = N·K block queries,
L = S + Q keys, H draft hidden, Ht target hidden, T taps, nh heads, d_qk = d_nope + d_rope and d_v the MLA head
dims (GQA: head_dim, nkv key/value heads), r_q / r_kv the MLA LoRA ranks, I the MLP width, Vd the output
vocabulary, r the Markov rank, M supervised slots, U rows of p_t (distinct positions per loss chunk).

A matmul [m, k] x [k, n] is 2·m·k·n FLOPs, the convention of `torch.utils.flop_counter.FlopCounterMode`;
norms, RoPE, softmax and other elementwise work are not counted. Every trainable matmul costs its forward, the
weight gradient (the same FLOPs) and, where its input needs a gradient, the input gradient (the same again): x3,
except where said. Parts (`regen.train.model.DSparkDraft`, `regen.train.layers`, `regen.train.fused_loss`):

* context: `context_proj` over the S context tokens, 2·S·T·Ht·H; x3 with `fc_norm` (its input is the trainable
  fc_norm's output), x2 without (the taps are features: no input gradient).
* kv, every layer over all L = S + Q positions (each layer projects the context again): MLA `kv_a_proj_with_mqa`
  2·L·H·(r_kv + d_rope) and `kv_b_proj` 2·L·r_kv·nh·(d_nope + d_v); GQA k and v 2·2·L·H·nkv·head_dim; x3.
* block, every layer over the Q block tokens: the query projection (MLA q_a 2·Q·H·r_q + q_b 2·Q·r_q·nh·d_qk, or
  q_proj 2·Q·H·nh·d_qk), o_proj 2·Q·nh·d_v·H, the SwiGLU MLP 3·2·Q·H·I; x3.
* attention, every layer: forward 2·nh·Q·L·(d_qk + d_v), dense (the SDPA path computes every masked score; flex
  skips empty tiles, so this is its upper bound). Backward, `attention_backward`: "fused" (the memory-efficient,
  flash, cuDNN and flex kernels recompute the scores: 2·nh·Q·L·(3·d_qk + 2·d_v), FlopCounterMode's formula for
  them), "math" (the CPU math path keeps the probabilities: 2x forward).
* loss, the fused vocabulary loss (the trainer's path): all of its matmuls run in the forward, the backward only
  scales the gradients it made: logits 2·M·H·Vd, ∂h 2·M·Vd·H, p_t 2·U·H·Vd, and with a Markov head e·W2ᵀ, ∂e and
  ∂W2 3·2·M·r·Vd; plus the confidence head's Linear(H + r, 1) over M slots, x3.

`row_flops` gives them for one row; the planner's figures (`plan_flops`) apply it to the plan's mean row. Held
equal to FlopCounterMode over the trainer's objective, part by part (tests/train/test_flops.py: real tensors at
small shapes, the meta device at the kimi-k3 shape).
"""
from __future__ import annotations

PARTS = ("context", "kv", "block", "attention", "loss")
ATTENTION_BACKWARD = ("fused", "math")


def row_flops(cfg, *, tokens: int, num_anchors: int | None = None, supervised_slots: int | None = None,
              pt_rows: int | None = None, attention_backward: str = "fused") -> dict:
    """FLOPs (forward + backward) of one row of `tokens` context tokens with `num_anchors` blocks (default
    cfg.num_anchors), by part: {context, kv, block, attention, loss, total} (ints; see the module docstring).

    supervised_slots: M slots in the vocabulary loss (default every slot, N·K: an upper bound); pt_rows: U rows of
    the target's p_t it computes (default M: every slot at its own position; fewer where blocks overlap within a
    loss chunk, `pt_rows_of`). attention_backward: "fused" (the CUDA kernels) or "math". Raises ValueError for an
    unknown attention_backward or a negative count."""
    passes = row_flops_by_pass(cfg, tokens=tokens, num_anchors=num_anchors, supervised_slots=supervised_slots,
                               pt_rows=pt_rows, attention_backward=attention_backward)
    return {k: passes["forward"][k] + passes["backward"][k] for k in (*PARTS, "total")}


def row_flops_by_pass(cfg, *, tokens: int, num_anchors: int | None = None, supervised_slots: int | None = None,
                      pt_rows: int | None = None, attention_backward: str = "fused") -> dict:
    """`row_flops` split by pass: {"forward": {part: FLOPs, total}, "backward": {...}} (same arguments). The fused
    loss does all its matmuls in the forward: its backward holds only the confidence head's gradients."""
    if attention_backward not in ATTENTION_BACKWARD:
        raise ValueError(f"attention_backward {attention_backward!r}: use one of {ATTENTION_BACKWARD}")
    S, N = int(tokens), cfg.num_anchors if num_anchors is None else int(num_anchors)
    Q = N * cfg.block_size
    M = Q if supervised_slots is None else int(supervised_slots)
    U = M if pt_rows is None else int(pt_rows)
    if min(S, N, M, U) < 0:
        raise ValueError(f"negative count: tokens={S}, num_anchors={N}, supervised_slots={M}, pt_rows={U}")
    L, H, nh, layers = S + Q, cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers
    T, Ht, Vd, r = len(cfg.target_layer_ids), cfg.target_hidden_size, cfg.output_vocab_size, max(0, cfg.markov_rank)
    if cfg.attention_type == "mla":
        d_qk, d_v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
        kv = 2 * L * H * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + 2 * L * cfg.kv_lora_rank * nh * (
            cfg.qk_nope_head_dim + d_v)
        q = (2 * Q * H * cfg.q_lora_rank + 2 * Q * cfg.q_lora_rank * nh * d_qk if cfg.q_lora_rank
             else 2 * Q * H * nh * d_qk)
    else:
        d_qk = d_v = cfg.head_dim
        kv = 2 * 2 * L * H * cfg.num_key_value_heads * cfg.head_dim
        q = 2 * Q * H * nh * cfg.head_dim
    block = q + 2 * Q * nh * d_v * H + 3 * 2 * Q * H * cfg.intermediate_size
    attn = 2 * nh * Q * L * (d_qk + d_v)
    attn_bwd = 2 * nh * Q * L * (3 * d_qk + 2 * d_v) if attention_backward == "fused" else 2 * attn
    context = 2 * S * T * Ht * H
    conf = 2 * M * (H + (r if cfg.confidence_head_with_markov else 0)) if cfg.enable_confidence_head else 0
    loss = 2 * 2 * M * H * Vd + 2 * U * H * Vd + 3 * 2 * M * r * Vd + conf
    fwd = {"context": context, "kv": layers * kv, "block": layers * block, "attention": layers * attn, "loss": loss}
    bwd = {"context": context * (2 if cfg.fc_norm else 1), "kv": 2 * layers * kv, "block": 2 * layers * block,
           "attention": layers * attn_bwd, "loss": 2 * conf}
    return {"forward": fwd | {"total": sum(fwd.values())}, "backward": bwd | {"total": sum(bwd.values())}}


def pt_rows_of(keys_sorted, chunk: int) -> int:
    """U for `row_flops`: the distinct positions per chunk of `chunk` consecutive slots, summed (the fused loss
    computes p_t once per distinct position of a chunk). keys_sorted: the supervised slots' (row, position) keys
    in the order the loss takes them (sorted); any sequence of ints."""
    keys = list(keys_sorted)
    return sum(len(set(keys[i:i + chunk])) for i in range(0, len(keys), chunk))


def six_p_d(p_trainable: int, tokens: float) -> float:
    """The rule of thumb 6·P·D (Kaplan et al. 2020, §2.1): every token through every trainable parameter. For the
    DSpark draft it sends the S context tokens through the block-side layers only Q tokens pass: 2-2.5x too high."""
    return 6.0 * p_trainable * tokens


def plan_flops(cfg, *, rows: float, tokens_per_row: float, supervised_per_row: float, epochs: int,
               p_trainable: int, max_tokens: int) -> dict:
    """`regen plan`'s training FLOPs: rows x epochs x `row_flops` of the mean row (S = the mean tokens per row,
    N = min(num_anchors, supervised tokens per row), every slot supervised). `row_flops` is affine in S at a fixed
    N, so the mean row gives the sum over rows exactly where rows have N anchors; rows with fewer supervised tokens
    (fewer anchors) and chunk overlaps of p_t make it an upper bound. Returns {flops, per_row (by part), row_shape,
    per_max_row (by part, at S = max_tokens with N anchors), six_p_d (the old estimate), formula}."""
    S = max(0.0, float(tokens_per_row))
    N = int(min(cfg.num_anchors, max(1.0, supervised_per_row)))
    lo, hi = row_flops(cfg, tokens=0, num_anchors=N), row_flops(cfg, tokens=1, num_anchors=N)
    per_row = {k: lo[k] + (hi[k] - lo[k]) * S for k in lo}  # affine in S: exact at a fractional mean
    total = per_row["total"] * rows * epochs
    return {
        "flops": total, "per_row": per_row, "row_shape": {"tokens": round(S, 1), "num_anchors": N,
                                                          "block_size": cfg.block_size},
        "per_max_row": row_flops(cfg, tokens=max_tokens, num_anchors=cfg.num_anchors),
        "six_p_d": six_p_d(p_trainable, rows * S * epochs),
        "formula": (f"{rows:,.0f} rows x {epochs} epoch(s) x {per_row['total'] / 1e12:,.2f} TFLOP per row (S = "
                    f"{S:,.0f} mean tokens, N = {N} anchors x K = {cfg.block_size}; counted per part: "
                    + ", ".join(f"{k} {per_row[k] / 1e12:,.2f}" for k in PARTS)
                    + "; regen/train/flops.py)"),
    }


def training_figures(cfg, a: dict, *, rows: float, shard_tokens: float, supervised: float, epochs: int,
                     p_trainable: int, max_len: int, max_tokens: int, producers: bool) -> dict:
    """`regen plan`'s training FLOPs, time and MFU figures (keys of its `draft` section): `plan_flops` of the plan's
    rows (mean tokens per row = shard tokens / rows, cut at max_len; N from the supervised tokens per row), the
    target's forward 2·N_active·D beside it (on the producers' GPUs with `producers`, else on the trainer's), time =
    FLOPs / (W x gpu_peak_tflops x mfu), and the seconds per row that time implies beside the plan's assumed
    `trainer_seconds_per_row` (the MFU that assumption would mean). `a`: the plan's assumptions."""
    mean = min(shard_tokens / rows, max_len) if rows else 0.0
    f = plan_flops(cfg, rows=rows, tokens_per_row=mean, supervised_per_row=supervised / rows if rows else 0.0,
                   epochs=epochs, p_trainable=p_trainable, max_tokens=max_tokens)
    D, n_target, W = rows * mean * epochs, a["target_active_params"], a["world_size"]
    target = 2 * n_target * D
    flops = f["flops"] + (0.0 if producers else target)
    peak = a["gpu_peak_tflops"] * 1e12
    row_s = f["per_row"]["total"] / (peak * a["mfu"])
    assumed = a.get("trainer_seconds_per_row") or 0.0
    where = (f" (the target's forward, 2 x {n_target:,.0f} x {D:,.0f} = {target:.3e}, runs on the producers' GPUs)"
             if producers else f" + the target's forward 2 x {n_target:,.0f} x {D:,.0f}"
             + ("" if n_target else " (not counted: plan.target_active_params is 0)"))
    return {
        "training_tokens": int(D), "epochs": epochs, "training_flops": flops, "flops_formula": f["formula"] + where,
        "flops_per_row_tflop": {k: round(v / 1e12, 2) for k, v in f["per_row"].items()}, "row_shape": f["row_shape"],
        "flops_per_max_row_tflop": {k: round(v / 1e12, 2) for k, v in f["per_max_row"].items()},
        "six_p_d_flops": f["six_p_d"], "producer_flops": target if producers else 0.0,
        "training_hours": round(flops / (W * peak * a["mfu"]) / 3600, 2),
        "time_formula": f"FLOPs / ({W} x {a['gpu_peak_tflops']} TFLOPS x {a['mfu']} MFU)",
        "trainer_seconds_per_row": {"at_mfu": round(row_s, 4), "assumed": assumed,
                                    "mfu_of_assumed": round(f["per_row"]["total"] / (assumed * peak), 4)
                                    if assumed else None},
    }
