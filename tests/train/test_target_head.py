"""The target head a trainer rank holds with `train.features: producers`: embeddings, final norm, LM head only."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from regen.errors import InputError
from regen.train.target_head import TargetHead, target_revision, weight_map

MODELS = ["tiny", "data/models/smollm2-135m", "data/models/gemma3-270m"]


def _full(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32).eval()


@pytest.fixture
def model_path(request, tiny_target):
    from regen.config import REPO_ROOT

    p = tiny_target if request.param == "tiny" else REPO_ROOT / request.param
    if not (p / "config.json").exists():
        pytest.skip(f"{p} not prepared (bash scripts/setup.sh)")
    return p


@pytest.mark.parametrize("model_path", MODELS, indirect=True)
def test_head_equals_the_full_models_and_holds_no_decoder_layer(model_path):
    head, full = TargetHead.from_pretrained(model_path), _full(model_path)
    H = full.get_input_embeddings().weight.shape[1]
    x = torch.randn(2, 5, H) * 3
    ids = torch.randint(0, full.get_input_embeddings().weight.shape[0], (2, 5))
    with torch.no_grad():
        want_norm = full.get_decoder().norm(x)
        assert torch.equal(head.final_norm(x), want_norm)  # the target's own norm: Gemma's (1 + w), its eps
        assert torch.equal(head.model.get_input_embeddings()(ids), full.get_input_embeddings()(ids))  # Gemma's scale
        want_logits = full.lm_head(want_norm).float()
        cap = getattr(full.config.get_text_config(), "final_logit_softcapping", None)
        assert torch.equal(head.logits(want_norm), torch.tanh(want_logits / cap) * cap if cap else want_logits)
    # decoder layers never materialize: every layer parameter is on the meta device
    layers = head.model.get_decoder().layers
    assert all(p.is_meta for p in layers.parameters())
    full_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    assert head.memory_bytes < full_bytes
    tied = full.config.get_text_config().tie_word_embeddings
    assert (head.model.get_output_embeddings().weight is head.model.get_input_embeddings().weight) == tied


def test_head_by_tensor_names_uses_a_plain_rms_norm(tiny_target):
    keys = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
    head, full = TargetHead.from_pretrained(tiny_target, keys=keys), _full(tiny_target)
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(head.final_norm(x), full.get_decoder().norm(x), rtol=1e-6, atol=1e-6)
        assert torch.equal(head.model.get_output_embeddings().weight, full.lm_head.weight)


def test_sharded_checkpoints_and_missing_tensors(tiny_target, tmp_path):
    from safetensors.torch import load_file, save_file

    # rewrite the tiny target as two shards with an index, as large checkpoints are stored
    out = tmp_path / "sharded"
    shutil.copytree(tiny_target, out)
    state = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    names = sorted(state)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in parts.items():
        save_file({k: state[k] for k in keys}, str(out / fname))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in parts.items() for k in ks}}))
    assert set(weight_map(out)) == set(names)
    head = TargetHead.from_pretrained(out)
    assert torch.equal(head.model.get_output_embeddings().weight, state["lm_head.weight"])
    assert target_revision(out) != target_revision(tiny_target)

    with pytest.raises(InputError, match="no tensor 'model.norm.weight'.*train.target_head_keys"):
        _drop_and_load(out, "model.norm.weight")
    with pytest.raises(InputError, match="has no config.json"):
        TargetHead.from_pretrained(tmp_path / "nowhere")


def _drop_and_load(path, name):
    idx = json.loads((path / "model.safetensors.index.json").read_text())
    del idx["weight_map"][name]
    (path / "model.safetensors.index.json").write_text(json.dumps(idx))
    return TargetHead.from_pretrained(path)


def test_target_revision_names_the_files(tiny_target, tmp_path):
    a = target_revision(tiny_target)
    assert a == target_revision(tiny_target) and len(a) == 64
    other = tmp_path / "other"
    shutil.copytree(tiny_target, other)
    data = bytearray((other / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # the last byte of the last tensor
    (other / "model.safetensors").write_bytes(bytes(data))
    assert target_revision(other) != a
