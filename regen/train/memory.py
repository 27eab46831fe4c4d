"""Memory of one training step of the DSpark draft per GPU, term by term (`regen plan`'s figure).

Legend: S tokens per micro-batch (context), N anchors x K block size -> Q = N·K block queries, L = S + Q keys,
H draft hidden, Ht target hidden, T taps, nh heads, d_qk = d_nope + d_rope, d_v, r_q / r_kv the MLA LoRA ranks,
I the MLP width, Vd output vocabulary, r the Markov rank, c compute bytes (2 for bf16), W ranks, P parameters.

`activation_bytes` counts what autograd keeps for backward in the draft's forward (`DSparkDraft.forward` with
`regen.train.layers`), read off the code and checked against the saved tensors measured on CPU
(tests/train/test_gpu_paths.py: exact for the MLA draft at toy sizes, attention on the math path there):

* context, once: fc_norm outputs and the context_proj input, 2·T·S·Ht·c; context_norm S·H·(4 + c) + 4·S.
* per layer: the [ctx; block] input of kv_a_proj L·H·c; kv_a_layernorm L·r_kv·(4 + 2c) + 4L; the rotary key
  tables L·d_rope·c; over the Q block tokens: two RMSNorms 2·(Q·H·(4 + c) + 4Q) (the first layer's input norm
  only Q·H·c: its input needs no gradient), q_a_proj and MLP inputs 2·Q·H·c, q_a_layernorm Q·r_q·(4 + 2c) + 4Q,
  rotary query tables Q·d_rope·c, o_proj input Q·nh·d_v·c, MLP 4·Q·I·c; and the attention:
  - `efficient` (CUDA, pinned): q nh·Q·d_qk·c, k nh·L·d_qk·c, the kv_b output that v views L·nh·(d_nope + d_v)·c,
    output nh·Q·d_v·c, logsumexp nh·Q·4, the additive mask Q·L·c (per layer; PyTorch converts the bool mask);
  - `math` (CPU): fp32 copies of q, kᵀ, v (nh·(Q + L)·d_qk·4 + nh·L·d_v·4) and the probabilities nh·Q·L·4
    (this is also what a fallback to the math kernel would hold on a GPU: 33 GB per layer at 32K rows).
* final_norm Q·H·(4 + c) + 4Q.

The fused vocabulary loss keeps fp32 gradients g_h Q·H·4, g_e Q·r·4, g_w2 Vd·r·4 (`regen.train.fused_loss`,
upper bound: every slot supervised) and a chunk's transients, `LOSS_CHUNK_BUFFERS` (5) fp32 buffers of a chunk's
[slots, Vd] logits at its peak: the logits, p, the gathered p_t, p - p_t and one temporary of the gradient's
arithmetic (the rehearsal's fake-tensor peak, regen.train.rehearse; p_t itself is computed once per distinct
position, a contiguous range of about slots/K rows).
Features: with producers (`train.features: producers`) at most `DEVICE_RESIDENT_OBJECTS` (2) objects are on the
device (the micro-batch computing and the next one's copy; `regen.train.features.staging`); the objects read
ahead (`train.producers.read_ahead` of them on a GPU, or a step's grad_accum when it is 0) wait in pinned host slots, counted
apart as host memory (`host_memory_bytes`: the slots, exact, and the
store's segment and transfer buffer; `tray_host_check` against a GB200 tray). In process: the one
micro-batch's features the target just computed.
Not counted: the CUDA context, NCCL and cuBLAS workspaces, allocator fragmentation with varying row lengths
(a few GB), the target's own memory when it runs in process.
"""
from __future__ import annotations

LOSS_CHUNK_LOGITS = 1 << 25  # regen.train.fused_loss's default chunk: about 2**25 logits
LOSS_CHUNK_BUFFERS = 5  # chunk-sized fp32 buffers alive at the fused loss's peak (module docstring)


def activation_bytes(cfg, S: int, *, c: int = 2, attention: str = "efficient") -> dict:
    """Saved-for-backward bytes of the draft's forward on one row of S tokens: {context, layers, final_norm,
    attention, total}; `attention` "efficient" | "math". MLA drafts exactly; GQA drafts approximately (their
    q/k/v projections in place of the MLA ones)."""
    K, N, H, L_layers = cfg.block_size, cfg.num_anchors, cfg.hidden_size, cfg.num_hidden_layers
    Q = N * K
    L = S + Q
    T, Ht, nh = len(cfg.target_layer_ids), cfg.target_hidden_size, cfg.num_attention_heads
    I = cfg.intermediate_size  # noqa: E741 - I: the MLP width, as in the formulas above
    if cfg.attention_type == "mla":
        d_qk, d_v, d_r = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim
        kv_in = L * H * c + L * cfg.kv_lora_rank * (4 + 2 * c) + 4 * L  # kv_a input, kv_a_layernorm
        q_in = Q * H * c + (Q * cfg.q_lora_rank * (4 + 2 * c) + 4 * Q if cfg.q_lora_rank else 0)
        v_store = L * nh * (cfg.qk_nope_head_dim + d_v) * c
    else:
        d_qk = d_v = d_r = cfg.head_dim
        kv_in = L * H * c + L * cfg.num_key_value_heads * cfg.head_dim * (4 + 2 * c) + 4 * L
        q_in = Q * H * c + Q * nh * cfg.head_dim * (4 + 2 * c) + 4 * Q
        v_store = L * nh * d_v * c
    norm_q = Q * H * (4 + c) + 4 * Q
    per_layer = (kv_in + L * d_r * c + 2 * norm_q + Q * H * c + q_in + Q * d_r * c + Q * nh * d_v * c
                 + 4 * Q * I * c)
    if attention == "efficient":
        attn = nh * Q * d_qk * c + nh * L * d_qk * c + v_store + nh * Q * d_v * c + nh * Q * 4 + Q * L * c
    elif attention == "math":
        attn = nh * (Q + L) * d_qk * 4 + nh * L * d_v * 4 + nh * Q * L * 4
    else:
        raise ValueError(f"attention {attention!r}: efficient or math")
    context = 2 * T * S * Ht * c + S * H * (4 + c) + 4 * S
    layers = L_layers * (per_layer + attn) - (Q * H * 4 + 4 * Q)  # layer 0's input norm: no input gradient
    final = norm_q
    return {"context": context, "layers": layers, "attention": L_layers * attn, "final_norm": final,
            "total": context + layers + final}


def step_memory_bytes(cfg, *, tokens: int, world_size: int, grad_accum: int, p_trainable: int, p_frozen: int,
                      p_layer: int, resident_feature_objects: int, feature_bytes: int = 2, c: int = 2,
                      frozen_bytes: int = 2) -> dict:
    """Peak bytes per GPU of one optimizer step, by term (see the module docstring):

    master weights 4·P_t/W; frozen embed/lm_head frozen_bytes·P_f (replicated); unsharded compute copies of the
    root group and two layers (FSDP2 prefetch) c·(P_t − n_layers·P_layer + 2·P_layer); gradients 4·P_t/W, plus
    4·P_t unsharded fp32 held through accumulation without reduce-scatter when grad_accum > 1
    (`set_requires_gradient_sync(False)`); AdamW 8·P_t/W; features resident_feature_objects x
    `feature_object_bytes` (producers: `DEVICE_RESIDENT_OBJECTS`; in process: 1); activations
    `activation_bytes(cfg, tokens)`; the fused loss's saved gradients and chunk.
    """
    W, P = world_size, p_trainable
    Q = cfg.num_anchors * cfg.block_size
    Vd = cfg.draft_vocab_size or cfg.vocab_size
    r = cfg.markov_rank
    return {
        "weights": 4 * P / W + frozen_bytes * p_frozen,
        "unsharded_params": c * (P - cfg.num_hidden_layers * p_layer + 2 * p_layer),
        "gradients": 4 * P / W + (4 * P if grad_accum > 1 else 0),
        "optimizer": 8 * P / W,
        "features": resident_feature_objects * feature_object_bytes(cfg, tokens, feature_bytes),
        "activations": activation_bytes(cfg, tokens, c=c)["total"],
        "loss": Q * cfg.hidden_size * 4 + Q * r * 4 + Vd * r * 4 + LOSS_CHUNK_BUFFERS * loss_chunk_logits(Q, Vd) * 4,
    }


def loss_chunk_logits(Q: int, Vd: int) -> int:
    """Logits of one chunk of the fused loss: min(Q, max(1, 2^25 // Vd)) slots x Vd (`regen.train.fused_loss`'s
    chunk; a micro-batch of fewer slots than a chunk makes a smaller one, as the rehearsal measures)."""
    return min(Q, max(1, LOSS_CHUNK_LOGITS // Vd)) * Vd


def feature_object_bytes(cfg, tokens: int, feature_bytes: int = 2) -> int:
    """Bytes of one micro-batch's feature object of `tokens` tokens: tokens x (T + 1) x Ht x feature_bytes
    (T taps + the last hidden state, `regen.train.features.contract`; the header's few KiB left out)."""
    return tokens * (len(cfg.target_layer_ids) + 1) * cfg.target_hidden_size * feature_bytes


def largest_object_bytes(cfg, *, tokens: int, max_batch: int = 1, feature_bytes: int = 2) -> int:
    """Bytes of the largest feature object a micro-batch of `tokens` padded tokens (at most `max_batch` rows) can
    be, header included: the fixed prefix + `header_reserve(max_batch)` + `feature_object_bytes`
    (`regen.train.features.contract.encode`; the same figure as `regen.train.features.pool.sizes_for`)."""
    from regen.train.features.contract import _PREFIX, header_reserve

    return _PREFIX.size + header_reserve(max_batch) + feature_object_bytes(cfg, tokens, feature_bytes)


def host_slots(*, grad_accum: int, read_ahead: int, gpu: bool = True) -> int:
    """Host slots of the producers' client (`regen.train.features.staging`). With a reader thread reading
    `read_ahead` objects ahead of the micro-batch computing, whatever grad_accum: on a GPU read_ahead (the next
    object's device copy is issued as soon as it is staged, and its slot is read into again once that copy is
    done), on CPU read_ahead + 1 (the slot is the object's memory until the loss releases it). With read_ahead 0:
    grad_accum (every object of a step read out of the store before its first forward)."""
    if read_ahead <= 0:
        return grad_accum
    return read_ahead if gpu else read_ahead + 1


def host_staging_bytes(cfg, *, tokens: int, grad_accum: int, max_batch: int = 1, feature_bytes: int = 2,
                       read_ahead: int = 0, gpu: bool = True) -> int:
    """Page-locked host memory per rank of the producers' client: `host_slots` reused host slots, each as large as
    the largest object it held: host_slots x `largest_object_bytes`. Exact, not a lower bound: each slot is one
    plain host allocation of the object's size registered with `cudaHostRegister`
    (`regen.train.features.staging.pin_host`), not the caching host allocator's power-of-two block."""
    return (host_slots(grad_accum=grad_accum, read_ahead=read_ahead, gpu=gpu)
            * largest_object_bytes(cfg, tokens=tokens, max_batch=max_batch, feature_bytes=feature_bytes))


# A GB200 NVL72 compute tray: 2 GB200 superchips, each 1 Grace CPU with up to 480 GB LPDDR5X and 2 Blackwell GPUs
# (NVIDIA's GB200 NVL72 specifications: "up to 480 GB LPDDR5X" per superchip, "up to 17 TB" for the rack's 36
# Grace CPUs); vendors' trays differ (an MLCommons inference v6.1 GB200 NVL72 system lists 1.87 TB per 4-GPU
# node): the plan checks against NVIDIA's 960 GB. What the plan does not count of the host (the OS, each trainer
# process: Python, CUDA context, shard tables, checkpoint staging) must fit in what is left: the plan says a tray
# holds the profile when the counted host memory is at most HOST_COUNTED_SHARE of it.
GB200_TRAY_GPUS = 4
GB200_TRAY_HOST_BYTES = 2 * 480 * 10**9
HOST_COUNTED_SHARE = 0.8


def host_memory_bytes(cfg, *, tokens: int, grad_accum: int, max_batch: int, segment_bytes: int,
                      transfer_buffer_bytes: int, feature_bytes: int = 2, read_ahead: int = 0) -> dict:
    """Host memory per rank that the producers' client allocates, by term (bytes): `feature_staging`
    (`host_staging_bytes`), `store_segment` (the memory this rank mounts into the Mooncake store,
    `train.producers.store.segment_bytes_per_rank` as `regen.train.features.pool.sizes_for` resolves it) and
    `transfer_buffer` (the store client's local buffer, `local_buffer_bytes` likewise). All three are page-locked
    and registered with the NIC."""
    return {"feature_staging": host_staging_bytes(cfg, tokens=tokens, grad_accum=grad_accum, max_batch=max_batch,
                                                  feature_bytes=feature_bytes, read_ahead=read_ahead),
            "store_segment": int(segment_bytes), "transfer_buffer": int(transfer_buffer_bytes)}


def tray_host_check(per_rank_bytes: int, *, world_size: int, gpus_per_tray: int = GB200_TRAY_GPUS,
                    tray_bytes: int = GB200_TRAY_HOST_BYTES, counted_share: float = HOST_COUNTED_SHARE) -> dict:
    """Whether one tray's host memory holds its ranks' counted host memory: {ranks, bytes (counted, the tray's
    ranks together), tray_bytes, share, holds} with ranks = min(world_size, gpus_per_tray) and holds = share <=
    counted_share (the rest is left for what is not counted; see GB200_TRAY_HOST_BYTES)."""
    ranks = max(1, min(int(world_size), gpus_per_tray))
    total = ranks * int(per_rank_bytes)
    return {"ranks": ranks, "bytes": total, "tray_bytes": tray_bytes, "share": total / tray_bytes,
            "holds": total <= counted_share * tray_bytes}


def step_memory_formulas(cfg, *, tokens: int, world_size: int, grad_accum: int, p_trainable: int, p_frozen: int,
                         p_layer: int, resident_feature_objects: int, c: int, producers: bool) -> dict[str, str]:
    """{term: its formula with this plan's numbers}, one per term of `step_memory_bytes` (same arguments; `c` the
    compute dtype's bytes, `producers` whether features come from feature producers), as `regen plan` prints them
    beside the figures."""
    T, W, Q = tokens, world_size, cfg.num_anchors * cfg.block_size
    taps, v_out = len(cfg.target_layer_ids), cfg.draft_vocab_size or cfg.vocab_size
    return {
        "weights": f"4 B x {p_trainable:,} / {W} + 2 B x {p_frozen:,} (frozen embed/lm_head, replicated)",
        "unsharded_params": f"{c} B x (root group + 2 layers of {p_layer:,}) (FSDP2 all-gathered compute copies)",
        "gradients": f"4 B x {p_trainable:,} / {W}" + (
            f" + 4 B x {p_trainable:,} (unsharded fp32, held through {grad_accum} accumulation micro-batches)"
            if grad_accum > 1 else ""),
        "optimizer": f"8 B x {p_trainable:,} / {W} (AdamW, 2 fp32 moments)",
        "features": f"{resident_feature_objects} object(s) x {T} x ({taps} + 1) x {cfg.target_hidden_size} x 2 B"
                    + (" (the micro-batch computing + the next one's copy; the objects read ahead wait in pinned "
                       "host memory)" if producers else ""),
        "activations": (f"saved for backward at S={T}, Q={Q}, L={T + Q}: context, {cfg.num_hidden_layers} layers "
                        "(incl. the context-side K/V of every layer), memory-efficient attention "
                        "(regen/train/memory.py, checked against CPU measurement)"),
        "loss": f"fused loss: {Q} x {cfg.hidden_size} x 4 B + {Q} x {cfg.markov_rank} x 4 B + {v_out} x "
                f"{cfg.markov_rank} x 4 B + a chunk's {LOSS_CHUNK_BUFFERS} x {loss_chunk_logits(Q, v_out):,} x 4 B",
    }
