"""Online target features on tiny random HF models built from config (nothing downloads)."""
from __future__ import annotations

import pytest
import torch

from regen.train.target import (
    ContractError,
    TargetContract,
    TargetFeatures,
    declared_contract,
    default_target_layer_ids,
    validate_layer_ids,
)


def tiny_qwen3(num_layers=4, seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=512)
    return Qwen3ForCausalLM(cfg).eval()


def tiny_gemma3(num_layers=4, seed=0):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)
    return Gemma3ForCausalLM(cfg).eval()


def test_default_tap_rule_matches_spec_examples():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # DS Qwen3-4B taps
    assert default_target_layer_ids(40, 5) == [1, 10, 19, 28, 37]  # DS Qwen3-14B taps
    assert default_target_layer_ids(18, 1) == [9]


def test_last_layer_tap_is_refused_and_ids_must_ascend():
    with pytest.raises(ContractError, match="last layer"):
        validate_layer_ids([0, 3], 4)
    with pytest.raises(ContractError, match="ascending"):
        validate_layer_ids([2, 1], 4)
    assert validate_layer_ids([-1, 0, 2], 4) == (-1, 0, 2)


@pytest.mark.parametrize("make", [tiny_qwen3, tiny_gemma3])
def test_prefix_taps_equal_hf_hidden_states_and_last_hidden_is_final_normed(make):
    model = make()
    tf = TargetFeatures(model, TargetContract((-1, 0, 2)))
    ids = torch.randint(0, 512, (2, 11))
    am = torch.ones_like(ids)
    taps, last = tf.features(ids, am)
    assert taps.shape == (2, 11, 3 * 64) and last.shape == (2, 11, 64)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=am, output_hidden_states=True)
    hs = ref.hidden_states  # hs[L+1] = output of layer L; hs[0] = embeddings; hs[-1] final-normed
    want = torch.cat([hs[0], hs[1], hs[3]], dim=-1)
    torch.testing.assert_close(taps, want)
    torch.testing.assert_close(last, hs[-1])
    torch.testing.assert_close(tf.logits(last), ref.logits.float())
    assert tf.contract.target_num_hidden_layers == 4 and tf.contract.target_hidden_size == 64


def test_attn_res_stream_is_after_next_layers_attention_residual():
    model = tiny_qwen3()
    tf = TargetFeatures(model, TargetContract((1,), aux_hidden_stream="attn_res"))
    ids = torch.randint(0, 512, (1, 9))
    taps, _ = tf.features(ids)
    with torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        layer = model.model.layers[2]
        pos = torch.arange(9)[None]
        pe = model.model.rotary_emb(hs[2], pos)
        attn, _ = layer.self_attn(layer.input_layernorm(hs[2]), position_embeddings=pe, attention_mask=None)
        want = hs[2] + attn  # layer 2's residual after attention, before post_attention_layernorm
    # causal mask: HF builds it internally; our manual call used no mask, so compare only position 0
    torch.testing.assert_close(taps[:, 0], want[:, 0])
    assert not torch.allclose(taps, hs[2])  # a different stream than prefix


def test_contract_mismatch_names_the_source_and_fields():
    c = TargetContract((0, 2), "prefix")
    c.check({"target_layer_ids": [0, 2], "aux_hidden_stream": "prefix"}, "shards manifest")
    c.check({}, "shards manifest")  # nothing declared: nothing to check
    with pytest.raises(ContractError, match="shards manifest.*target_layer_ids"):
        c.check({"contract": {"target_layer_ids": [0, 1]}}, "shards manifest")
    with pytest.raises(ContractError, match="aux_hidden_stream"):
        c.check({"aux_hidden_stream": "attn_res"}, "checkpoint config.json")
    assert declared_contract({"dflash_config": {"target_layer_ids": [1]}}) == {"target_layer_ids": [1]}


def test_contract_against_model_shape():
    model = tiny_qwen3()
    with pytest.raises(ContractError, match="target_num_hidden_layers=36"):
        TargetFeatures(model, TargetContract((0, 1), target_num_hidden_layers=36))
    with pytest.raises(ContractError, match="last layer"):
        TargetFeatures(model, TargetContract((0, 3)))


def test_from_pretrained_loads_a_local_directory(tmp_path):
    model = tiny_qwen3()
    model.save_pretrained(tmp_path / "m")
    tf = TargetFeatures.from_pretrained(tmp_path / "m", TargetContract((0, 2)))
    ids = torch.randint(0, 512, (1, 5))
    torch.testing.assert_close(tf.features(ids)[1], TargetFeatures(model, TargetContract((0, 2))).features(ids)[1])
    from regen.errors import InputError

    with pytest.raises(InputError, match="config.json"):
        TargetFeatures.from_pretrained(tmp_path / "missing", TargetContract((0,)))
