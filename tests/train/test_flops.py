"""The training FLOPs counted per part (`regen.train.flops`) against PyTorch's own counter
(`torch.utils.flop_counter.FlopCounterMode`) over the trainer's objective (`regen.train.step.make_objective`, the
module `train_step` calls): forward and backward of real tensors at small shapes, of meta tensors at the kimi-k3
shape (nothing allocated)."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from regen.train.draft_config import DSparkConfig
from regen.train.flops import PARTS, plan_flops, pt_rows_of, row_flops, row_flops_by_pass
from regen.train.loss import decay_weights, evaluation_mask, sample_anchors, slot_layout, slot_positions
from regen.train.model import DSparkDraft
from regen.train.step import make_objective

KV = {"kv_a_proj_with_mqa", "kv_b_proj", "k_proj", "v_proj"}
BLOCK = {"q_a_proj", "q_b_proj", "q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _toy(**over) -> DSparkConfig:
    base = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=512, target_hidden_size=48,
                target_num_hidden_layers=12, target_layer_ids=(1, 3, 5, 7, 9), fc_norm=True,
                aux_hidden_stream="attn_res", mask_token_id=500, markov_rank=8, eos_token_id=(2,), pad_token_id=None,
                num_anchors=16, num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    base |= over
    base["target_hidden_size"] = base["hidden_size"]  # the last hidden state goes through the draft's lm_head
    return DSparkConfig(**base)


def _parts(counts: dict) -> dict:
    """FlopCounterMode's per-module counts of the objective's FORWARD -> the parts of `regen.train.flops` (a forward
    attributes each op to the module that ran it; its backward attribution is not reliable, so backward is
    compared in total)."""
    tot = {m: sum(v.values()) for m, v in counts.items()}
    leaf = lambda m: m.rsplit(".", 1)[-1]  # noqa: E731
    out = {"context": tot.get("Objective.draft.context_proj", 0),
           "kv": sum(v for m, v in tot.items() if leaf(m) in KV),
           "block": sum(v for m, v in tot.items() if leaf(m) in BLOCK)}
    attn = [m for m in tot if leaf(m) == "self_attn"]
    out["attention"] = sum(tot[m] for m in attn) - out["kv"] - sum(
        v for m, v in tot.items() if leaf(m) in BLOCK - {"o_proj", "gate_proj", "up_proj", "down_proj"})
    out["attention"] -= sum(v for m, v in tot.items() if leaf(m) == "o_proj")
    draft_side = tot["Objective.draft"] - tot.get("Objective.draft.confidence_head", 0)
    out["loss"] = tot["Global"] - draft_side
    out["total"] = tot["Global"]
    return out


def _row(cfg, S, seed, *, device="cpu", loss_from=0, anchors=None):
    ids = torch.randint(3, cfg.vocab_size - 16, (1, S), generator=torch.Generator().manual_seed(seed))
    lm = torch.ones(1, S, dtype=torch.long)
    lm[:, :loss_from] = 0
    if anchors is None:
        anchors, keep = sample_anchors(lm, cfg.num_anchors, torch.Generator().manual_seed(seed))
    else:
        keep = torch.ones_like(anchors, dtype=torch.bool)
    T, Ht = len(cfg.target_layer_ids), cfg.target_hidden_size
    # the loss's slot layout planned on the host, as the trainer's prepare_microbatch does (no device read after it)
    layout = slot_layout(anchors, keep, lm, cfg.block_size, cfg.loss_decay_gamma, input_ids=ids)
    batch = {"input_ids": ids, "loss_mask": lm, "attention_mask": torch.ones(1, S, dtype=torch.bool),
             "slot_layout": layout}
    if device == "cpu":
        feats = (torch.randn(1, S, T * Ht), torch.randn(1, S, Ht))
    else:  # made where they are: a 64K row's taps are 9 GB in float32
        batch = {k: v.to(device) for k, v in batch.items()}  # (SlotLayout.to moves its tensors)
        feats = (torch.empty(1, S, T * Ht, device=device), torch.empty(1, S, Ht, device=device))
    return batch, feats, anchors.to(device), keep.to(device)


def _loss_rows(cfg, batch, anchors, keep):
    """(M supervised slots, U p_t rows) of this micro-batch as `dspark_loss` and the fused loss take them."""
    K, S = cfg.block_size, batch["input_ids"].shape[1]
    w = evaluation_mask(anchors, keep, batch["loss_mask"], K) * decay_weights(K, cfg.loss_decay_gamma)
    sel = w.flatten() > 0
    key = slot_positions(anchors, K).clamp(max=S - 1).flatten()[sel]
    chunk = max(1, (1 << 25) // cfg.output_vocab_size)
    return int(sel.sum()), pt_rows_of(sorted(key.tolist()), chunk)


def _cpu_flash(q, k, v, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(q, k, v)


def _cpu_flash_backward(grad_out, q, k, v, *args, out_shape=None, **kwargs):
    return sdpa_backward_flop_count(grad_out, q, k, v)


# FlopCounterMode has no formula for the CPU flash kernel that SDPA takes when d_qk == d_v (the GQA draft): the same
# as the CUDA flash kernel's (its backward recomputes the scores)
CPU_FLASH = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward}


def _count(objective, batch, feats, anchors, keep):
    """FlopCounterMode over the objective's forward (by module) and forward + backward (total), as `train_step`
    runs it (a known denominator: metrics stay on the device)."""
    with FlopCounterMode(display=False, custom_mapping=CPU_FLASH) as fwd:
        loss, _ = objective(batch, feats, anchors, keep, denominator=1.0)
    parts = _parts(fwd.get_flop_counts())
    with FlopCounterMode(display=False, custom_mapping=CPU_FLASH) as both:
        loss.backward()
    return parts, fwd.get_total_flops() + both.get_total_flops()


@pytest.mark.parametrize("shape", [
    dict(S=96, over={}, loss_from=10, kernel="math"),  # dense anchors: blocks share p_t positions
    dict(S=160, over=dict(fc_norm=False, q_lora_rank=0, markov_rank=0, num_hidden_layers=1), loss_from=0,
         kernel="math"),
    # d_qk == d_v: SDPA takes the CPU flash kernel, whose backward recomputes the scores as the CUDA kernels do
    dict(S=128, over=dict(attention_type="gqa", num_key_value_heads=2, head_dim=16, enable_confidence_head=False),
         loss_from=30, kernel="fused"),
    # several loss chunks (2^25 // 131,072 = 256 slots each) and a longer row
    dict(S=1024, over=dict(vocab_size=131072, mask_token_id=131000, num_anchors=64, hidden_size=96,
                           intermediate_size=192), loss_from=200, kernel="math"),
], ids=["small-mla", "small-no-fc-norm", "small-gqa", "medium-chunked"])
def test_the_count_equals_pytorchs_flop_counter_over_the_trainers_objective(shape):
    """Real CPU tensors through the objective `train_step` calls, the fused loss included: each part's forward
    within 5% of FlopCounterMode's (in fact exact), and forward + backward in total (the CPU attention: the math
    path, attention_backward="math", or the CPU flash kernel, "fused")."""
    torch.manual_seed(0)
    cfg = _toy(**shape["over"])
    objective = make_objective(DSparkDraft(cfg))
    batch, feats, anchors, keep = _row(cfg, shape["S"], 1, loss_from=shape["loss_from"])
    M, U = _loss_rows(cfg, batch, anchors, keep)
    assert 0 < M and (U < M if shape["S"] == 96 else U <= M)
    measured, total = _count(objective, batch, feats, anchors, keep)
    want = row_flops_by_pass(cfg, tokens=shape["S"], num_anchors=anchors.shape[1], supervised_slots=M, pt_rows=U,
                             attention_backward=shape["kernel"])
    for part in (*PARTS, "total"):
        assert want["forward"][part] == pytest.approx(measured[part], rel=0.05), part
    counted = row_flops(cfg, tokens=shape["S"], num_anchors=anchors.shape[1], supervised_slots=M, pt_rows=U,
                        attention_backward=shape["kernel"])
    assert counted["total"] == pytest.approx(total, rel=0.05)
    assert counted["total"] == want["forward"]["total"] + want["backward"]["total"] == total  # exact, here


@contextlib.contextmanager
def _meta_data_dependent_ops():
    """On the meta device `nonzero` (boolean indexing) and `unique` have no kernel (their output size depends on
    values). For a row whose every slot is supervised and whose slots sit at distinct positions, their results
    have known sizes: every element selected, every key distinct. Used only with such rows."""
    import torch.fx.experimental._config as fx_config

    lib = torch.library.Library("aten", "IMPL")

    def unique2(x, sorted=True, return_inverse=False, return_counts=False):
        flat = x.flatten()
        return (torch.empty_like(flat), torch.empty(x.shape, dtype=torch.long, device=x.device),
                torch.empty(flat.shape if return_counts else (0,), dtype=torch.long, device=x.device))

    lib.impl("_unique2", unique2, "Meta")
    old = fx_config.meta_nonzero_assume_all_nonzero
    fx_config.meta_nonzero_assume_all_nonzero = True
    try:
        yield
    finally:
        fx_config.meta_nonzero_assume_all_nonzero = old
        lib._destroy()


def _efficient_sdpa(q, k, v, attn_mask=None, scale=None):
    """What SDPA pinned to memory-efficient attention runs on CUDA, on meta tensors: the bool mask as an additive
    bias, then `aten._scaled_dot_product_efficient_attention` (its backward recomputes the scores)."""
    bias = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).expand(q.shape[0], q.shape[1], q.shape[2],
                                                                              k.shape[2])
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, scale=scale)[0]


@pytest.mark.parametrize("tokens", [32768, 65536])
def test_the_kimi_k3_row_is_counted_on_the_meta_device(tokens, monkeypatch):
    """The kimi-k3 draft as `regen plan` builds it (5 MLA layers at 7,168, fc_norm, 5 taps, V 163,840), on the meta
    device, one row of 32K / 64K tokens with 512 anchors (every slot supervised, blocks 64 tokens apart: distinct
    p_t positions), through the trainer's objective: each part's forward and the forward + backward within 5% of
    FlopCounterMode, with the memory-efficient kernel CUDA runs (its backward recomputes the scores) and with the
    CPU's math attention. 229 TFLOP at 32K (the static review's estimate: about 226; 6·P·D says 470) and 378 at
    64K (6·P·D: 939)."""
    from regen.config import load_profile
    from regen.report.plan import target_config
    from regen.train import attention as attention_mod
    from regen.train.draft_config import build_draft_config
    from regen.train.model import build_meta

    profile = load_profile("kimi-k3")
    cfg = build_draft_config(profile.train, target_config(profile)[0])
    objective = make_objective(build_meta(cfg))
    N = cfg.num_anchors
    anchors = (torch.arange(N) * (tokens // N))[None]
    batch, feats, anchors, keep = _row(cfg, tokens, 0, device="meta", anchors=anchors)
    results = {}
    for kernel in ("math", "fused"):
        if kernel == "fused":
            monkeypatch.setattr(attention_mod.F, "scaled_dot_product_attention", _efficient_sdpa)
        with _meta_data_dependent_ops():
            measured, total = _count(objective, batch, feats, anchors, keep)
        want = row_flops_by_pass(cfg, tokens=tokens, attention_backward=kernel)
        for part in (*PARTS, "total"):
            assert want["forward"][part] == pytest.approx(measured[part], rel=0.05), (kernel, part)
        counted = row_flops(cfg, tokens=tokens, attention_backward=kernel)
        assert counted["total"] == pytest.approx(total, rel=0.05), kernel
        results[kernel] = counted
    fused = results["fused"]
    p_train = sum(p.numel() for p in objective.parameters() if p.requires_grad)
    six = 6 * p_train * tokens
    if tokens == 32768:  # the static review's count: context 51, K/V 14, block 43, attention 93, loss 26 = 226
        assert [round(fused[k] / 1e12) for k in PARTS] == [51, 14, 43, 96, 26] and round(fused["total"] / 1e12) == 229
        assert six / 1e12 == pytest.approx(470, abs=2) and 2.0 < six / fused["total"] < 2.5
    else:
        assert fused["total"] / 1e12 == pytest.approx(373, abs=10) and six / 1e12 == pytest.approx(939, abs=3)


def test_plan_flops_is_the_sum_over_rows_of_the_mean_row():
    """`plan_flops`: rows x epochs x the mean row, which is exact for rows of N anchors (the count is affine in S);
    N follows the supervised tokens per row."""
    cfg = _toy()
    f = plan_flops(cfg, rows=10, tokens_per_row=100.5, supervised_per_row=40, epochs=3, p_trainable=1000,
                   max_tokens=256)
    rows = [row_flops(cfg, tokens=S)["total"] for S in (100, 101)]
    assert f["flops"] == pytest.approx(10 * 3 * sum(rows) / 2) and f["row_shape"]["num_anchors"] == 16
    assert plan_flops(cfg, rows=1, tokens_per_row=50, supervised_per_row=5, epochs=1, p_trainable=1,
                      max_tokens=64)["row_shape"]["num_anchors"] == 5
    assert f["six_p_d"] == 6 * 1000 * 10 * 100.5 * 3 and "per row" in f["formula"]
    with pytest.raises(ValueError, match="attention_backward"):
        row_flops(cfg, tokens=10, attention_backward="dense")
