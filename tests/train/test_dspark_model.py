"""The DSpark draft: config round trip, Markov correction at inference, checkpoints, full-size meta build."""
from __future__ import annotations

import pytest
import torch

from regen.train.model import (
    DSparkConfig,
    DSparkDraft,
    build_meta,
    count_parameters,
    kimi_k3_config,
    load_draft,
    rope_inv_freq,
    save_draft,
    softmax_scale,
)


def tiny_cfg(**kw) -> DSparkConfig:
    base = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=512, target_hidden_size=64,
                target_num_hidden_layers=6, target_layer_ids=(0, 2, 4), mask_token_id=511, markov_rank=16,
                num_hidden_layers=2, num_anchors=8, eos_token_id=(1,), pad_token_id=0, block_size=7,
                num_key_value_heads=2, head_dim=16)
    base.update(kw)
    return DSparkConfig(**base)


def test_config_json_round_trip_has_serving_fields():
    cfg = tiny_cfg(fc_norm=True, aux_hidden_stream="attn_res")
    d = cfg.to_dict()
    for k in ("block_size", "num_hidden_layers", "target_layer_ids", "target_hidden_size", "target_num_hidden_layers",
              "mask_token_id", "markov_rank", "markov_head_type", "enable_confidence_head",
              "confidence_head_with_markov", "fc_norm", "aux_hidden_stream", "rope_parameters", "vocab_size",
              "eos_token_id", "kv_lora_rank", "qk_rope_head_dim", "num_target_layers"):
        assert k in d, k
    assert d["num_target_layers"] == 3  # K3 meaning: number of taps
    assert DSparkConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="last layer"):
        tiny_cfg(target_layer_ids=(0, 5))
    with pytest.raises(ValueError, match="ascending"):
        tiny_cfg(target_layer_ids=(2, 0))
    with pytest.raises(ValueError, match="unknown"):
        DSparkConfig.from_dict({**d, "bogus": 1})


def test_k3_yarn_softmax_scale_and_rope():
    cfg = kimi_k3_config()
    m = 1 + 0.1 * torch.log(torch.tensor(32.0)).item()
    assert softmax_scale(cfg, 192) == pytest.approx(m * m / 192**0.5)
    inv, mscale = rope_inv_freq(64, cfg.rope_parameters)
    assert mscale == pytest.approx(1.0) and inv.shape == (32,)
    assert inv[0] == pytest.approx(1.0)  # high-frequency dims are extrapolated unchanged
    assert inv[-1] == pytest.approx(1.0 / 50000 ** (62 / 64) / 32, rel=1e-4)  # low-frequency dims interpolated


def test_full_size_k3_draft_on_meta_device():
    """Inferact layout (no fc_norm): 68 serving tensors, 3,562,312,961 parameters without embed_tokens
    (lm_head 1,174,405,120 + markov 83,886,080 + confidence 7,425 + backbone/context 2,304,014,336)."""
    m = build_meta(kimi_k3_config(fc_norm=False, aux_hidden_stream="prefix", target_layer_ids=(2, 23, 47, 71, 89)))
    assert all(p.is_meta for p in m.parameters())
    c = count_parameters(m)
    assert c["num_tensors"] - 1 == 68
    assert c["serving_without_embed"] == 3_562_312_961
    assert c["embed_tokens"] == c["lm_head"] == 163840 * 7168
    assert c["markov_head"] == 2 * 163840 * 256 and c["confidence_head"] == 7168 + 256 + 1
    from regen.train.model import k3_param_report

    rep = k3_param_report()["params"]
    assert rep["num_serving_tensors"] == 68 and rep["serving_without_embed"] == 3_562_312_961
    # TorchSpec layout adds fc_norm: 5 x 7168 more
    c2 = count_parameters(build_meta(kimi_k3_config()))
    assert c2["total"] - c["total"] == 5 * 7168


def markov_chain_draft(cfg):
    """A draft whose base logits are zero and whose Markov bias sends token t to t+1 (t < rank)."""
    d = DSparkDraft(cfg)
    r = cfg.markov_rank
    with torch.no_grad():
        d.lm_head.weight.zero_()
        d.markov_head.markov_w1.weight.zero_()
        d.markov_head.markov_w1.weight[:r, :r] = torch.eye(r)
        d.markov_head.markov_w2.weight.zero_()
        for t in range(r - 1):
            d.markov_head.markov_w2.weight[t + 1, t] = 10.0
    return d


def test_inference_applies_markov_correction_slot_by_slot_on_sampled_tokens():
    d = markov_chain_draft(tiny_cfg())
    taps = torch.randn(5, 3 * 64)
    tokens, conf = d.propose(taps, anchor_token=3, anchor_pos=5)
    assert tokens.tolist() == [4, 5, 6, 7, 8, 9, 10]  # each slot conditioned on the previous sampled token
    assert conf.shape == (7,) and ((conf > 0) & (conf < 1)).all()
    # teacher forcing: the bias follows the given previous tokens, not the model's own samples
    h = torch.zeros(7, 64)
    prev = torch.tensor([3, 9, 1, 1, 0, 12, 5])
    assert d.corrected_logits(h, prev).argmax(-1).tolist() == [4, 10, 2, 2, 1, 13, 6]
    # rank 0: DFlash-like, no bias; base logits alone
    d0 = DSparkDraft(tiny_cfg(markov_rank=0))
    assert d0.markov_head is None
    torch.testing.assert_close(d0.corrected_logits(h, prev), d0.base_logits(h))


def test_sampling_at_temperature_is_seeded():
    d = DSparkDraft(tiny_cfg())
    taps = torch.randn(6, 3 * 64)
    a = d.propose(taps, 7, 6, temperature=1.0, generator=torch.Generator().manual_seed(1))[0]
    b = d.propose(taps, 7, 6, temperature=1.0, generator=torch.Generator().manual_seed(1))[0]
    assert a.tolist() == b.tolist()


@pytest.mark.parametrize("attention_type", ["mla", "gqa"])
def test_forward_block_matches_single_block_proposal(attention_type):
    """The training pass (mask, N blocks) and the inference pass (one block, context < a) agree."""
    torch.manual_seed(0)
    d = DSparkDraft(tiny_cfg(attention_type=attention_type, fc_norm=True))
    S = 20
    ids = torch.randint(2, 500, (1, S))
    taps = torch.randn(1, S, 3 * 64)
    anchors = torch.tensor([[3, 9, 14]])
    keep = torch.tensor([[True, True, False]])
    h = d(taps, ids, anchors, keep)
    assert h.shape == (1, 3, 7, 64) and torch.isfinite(h).all()
    for n, a in enumerate([3, 9]):
        ctx = d.context(taps[:, :a])
        blk = torch.full((1, 7), 511)
        blk[0, 0] = ids[0, a]
        one = d.backbone(ctx, blk, torch.arange(a)[None], (a + torch.arange(7))[None], None)
        torch.testing.assert_close(h[0, n], one[0], atol=1e-5, rtol=1e-4)


def test_from_target_copies_frozen_embeddings_and_checkpoint_round_trip(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    target = Qwen3ForCausalLM(Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512))
    d = DSparkDraft.from_target(target, tiny_cfg())
    torch.testing.assert_close(d.embed_tokens.weight, target.model.embed_tokens.weight)
    assert not d.embed_tokens.weight.requires_grad and not d.lm_head.weight.requires_grad
    assert all(p.requires_grad for n, p in d.named_parameters() if not n.startswith(("embed", "lm_head")))
    save_draft(d, tmp_path / "ckpt")
    back = load_draft(tmp_path / "ckpt", target_model=target)
    for (n, a), (_, b) in zip(d.state_dict().items(), back.state_dict().items()):
        torch.testing.assert_close(a, b, msg=n)
    with pytest.raises(ValueError, match="missing"):
        load_draft(tmp_path / "ckpt")  # frozen weights were not saved and no target is given
    with pytest.raises(ValueError, match="hidden_size"):
        DSparkDraft.from_target(target, tiny_cfg(hidden_size=32, target_hidden_size=64))


def test_batched_proposals_equal_one_block_proposals():
    torch.manual_seed(0)
    d = DSparkDraft(tiny_cfg(fc_norm=True))
    S = 16
    ids = torch.randint(2, 500, (1, S))
    taps = torch.randn(1, S, 3 * 64)
    anchors = torch.tensor([[1, 4, 9, 15]])
    tok, conf = d.propose_batch(taps, ids, anchors)
    assert tok.shape == (1, 4, 7) and conf.shape == (1, 4, 7)
    for n, a in enumerate(anchors[0].tolist()):
        t1, c1 = d.propose(taps[0, :a], int(ids[0, a]), a)
        assert tok[0, n].tolist() == t1.tolist()
        torch.testing.assert_close(conf[0, n], c1, atol=1e-5, rtol=1e-4)


def _rope_interleaved_reference(x, cos, sin):
    """DeepSeek-V3 `apply_rotary_emb`: pairs (2i, 2i+1) as complex numbers times e^{iθ} (MLA, spec §2 table)."""
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(z * torch.complex(cos, sin)).flatten(-2)


def _rope_half_reference(x, cos, sin):
    """HF Llama/Qwen3 `apply_rotary_pos_emb`: x·cos + rotate_half(x)·sin, cos/sin repeated over both halves."""
    c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    half = x.shape[-1] // 2
    rotate_half = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * c + rotate_half * s


@pytest.mark.parametrize("attention_type,layout", [("mla", "interleaved"), ("gqa", "half")])
def test_rope_layout_per_attention_type(attention_type, layout, monkeypatch):
    """MLA rotates interleaved pairs, GQA half-split pairs (the reference's Qwen3 draft): pinned through the
    attention module's real forward by swapping `apply_rope` for each explicit reference formula."""
    import regen.train.layers as layers

    cfg = tiny_cfg(attention_type=attention_type)
    assert cfg.rope_interleave is (layout == "interleaved")
    assert cfg.to_dict()["rope_interleave"] is cfg.rope_interleave  # stated explicitly in config.json
    x = torch.randn(2, 3, 8)
    cos, sin = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    ref = {"interleaved": _rope_interleaved_reference, "half": _rope_half_reference}
    torch.testing.assert_close(layers.apply_rope(x, cos, sin, cfg.rope_interleave), ref[layout](x, cos, sin))
    other = ref["half" if layout == "interleaved" else "interleaved"]
    assert not torch.allclose(layers.apply_rope(x, cos, sin, cfg.rope_interleave), other(x, cos, sin))

    torch.manual_seed(0)
    d = DSparkDraft(cfg).eval()
    taps, ids = torch.randn(1, 10, 3 * 64), torch.randint(2, 500, (1, 10))
    anchors, keep = torch.tensor([[3, 6]]), torch.ones(1, 2, dtype=torch.bool)
    with torch.no_grad():
        got = d(taps, ids, anchors, keep)
        for formula, same in ((ref[layout], True), (other, False)):
            monkeypatch.setattr(layers, "apply_rope", lambda x, c, s, interleave, f=formula: f(x, c, s))
            want = d(taps, ids, anchors, keep)
            assert torch.allclose(got, want, atol=1e-5) is same, formula.__name__
            monkeypatch.undo()


def test_old_checkpoints_keep_their_stated_layout_and_theta_is_explicit():
    d = tiny_cfg(attention_type="gqa").to_dict()
    old_gqa = {**d, "rope_interleave": True}  # a GQA checkpoint written before the rotary fix states interleaved
    assert DSparkConfig.from_dict(old_gqa).rope_interleave is True
    mla = tiny_cfg().to_dict()
    assert mla["rope_interleave"] is True and DSparkConfig.from_dict(mla).rope_interleave is True
    no_field = {k: v for k, v in d.items() if k != "rope_interleave"}  # unstated: the attention type's convention
    assert DSparkConfig.from_dict(no_field).rope_interleave is False
    assert kimi_k3_config().to_dict()["rope_theta"] == 50000.0 == kimi_k3_config().rope_theta
    assert d["rope_theta"] == d["rope_parameters"]["rope_theta"]
    with pytest.raises(ValueError, match="two RoPE bases"):
        DSparkConfig.from_dict({**d, "rope_theta": 1e6})
    for params in ({"rope_type": "default"}, {"rope_type": "yarn", "factor": 32.0}, {"rope_theta": 0}):
        with pytest.raises(ValueError, match="rope_theta"):
            tiny_cfg(rope_parameters=params)


def test_profile_rope_theta_reaches_the_draft_config():
    from types import SimpleNamespace

    from regen.config.train import TrainConfig
    from regen.train.draft_config import build_draft_config

    tc = SimpleNamespace(hidden_size=64, num_hidden_layers=6, vocab_size=512, intermediate_size=128,
                         max_position_embeddings=512, eos_token_id=1, pad_token_id=0, rms_norm_eps=1e-6,
                         model_type="qwen3")
    base = dict(target_layer_ids=[0, 2, 4], num_draft_layers=1, markov_rank=8)
    assert build_draft_config(TrainConfig(**base), tc).rope_theta == 10000.0  # the small preset's
    assert build_draft_config(TrainConfig(**base, rope_theta=1e6), tc).rope_theta == 1e6
    k3 = dict(base, draft_preset="kimi-k3", num_draft_layers=1, mask_token_id=511)
    assert build_draft_config(TrainConfig(**k3), tc).rope_parameters["rope_type"] == "yarn"
    assert build_draft_config(TrainConfig(**k3), tc).rope_theta == 50000.0


def test_gqa_key_value_heads_must_divide_the_query_heads():
    """nkv > nh (or not a divisor) gave empty keys and values and an attention of zeros, silently: refused; the small
    config picks a divisor."""
    from types import SimpleNamespace

    from regen.train.draft_config import small_config_for_target

    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny_cfg(attention_type="gqa", num_attention_heads=4, num_key_value_heads=8)
    tc = SimpleNamespace(hidden_size=160, num_hidden_layers=4, vocab_size=512, eos_token_id=2, intermediate_size=320)
    cfg = small_config_for_target(tc, target_layer_ids=(0, 1, 2), attention_type="gqa")
    assert cfg.num_attention_heads == 5 and cfg.num_key_value_heads == 1
