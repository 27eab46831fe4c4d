"""What each engine's launch says about drafting and verifying at T > 0 (`launch["verification"]`), checked against
the names in the engines' own released code (vLLM 0.32 in .venv-vllm, SGLang 0.5.23 and TokenSpeed 0.1.1 in
.engines/): a renamed key, flag or environment variable fails here. The code is read with `ast`, not imported, so
these checks take milliseconds."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from regen.serve.engines import ENGINES, sglang, tokenspeed, vllm
from regen.train.model import kimi_k3_config
from regen.train.verification import DRAFT_SAMPLE_METHODS, REJECTION_SAMPLE_METHODS, parse_methods

ROOT = Path(__file__).resolve().parents[2]


def engine_source(engine: str, rel: str) -> str:
    """The text of one file of an engine's installed code (skips, saying how to install it, when missing)."""
    if engine == "vllm":
        hits = sorted((ROOT / ".venv-vllm" / "lib").glob(f"python*/site-packages/vllm/{rel}"))
        if not hits:
            pytest.skip("vLLM's CPU venv .venv-vllm is missing (REGEN_VLLM=1 bash scripts/setup.sh builds it)")
        return hits[0].read_text()
    path = ROOT / ".engines" / engine / engine / rel
    if not path.is_file():
        pytest.skip(f".engines/{engine} is missing: bash scripts/setup.sh installs the {engine} wheel there")
    return path.read_text()


def literal_args(source: str, name: str) -> tuple[str, ...]:
    """The string arguments of a module-level `name = Literal[...]`."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return tuple(ast.literal_eval(e) for e in node.value.slice.elts)
    raise AssertionError(f"{name} = Literal[...] not found: the engine renamed it")


def class_fields(source: str, cls: str) -> dict[str, str]:
    """{field: annotation source} of the annotated attributes of class `cls`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {n.target.id: ast.unparse(n.annotation) for n in node.body
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    raise AssertionError(f"class {cls} not found")


CFG = kimi_k3_config(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                     q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                     vocab_size=1000, target_hidden_size=256, target_num_hidden_layers=8,
                     target_layer_ids=(1, 3, 5, 6), mask_token_id=997, markov_rank=16, eos_token_id=(2,))


def test_every_launch_names_regen_evals_methods_and_the_flags_that_predict_it():
    for name, mod in ENGINES.items():
        v = mod.launch(CFG)["verification"]
        for endpoint in v["endpoints"].values():
            assert endpoint["draft_sample_method"] in DRAFT_SAMPLE_METHODS, name
            assert endpoint["rejection_sample_method"] in REJECTION_SAMPLE_METHODS, name
        flags = v["regen_eval"]
        pairs = parse_methods(flags[flags.index("--draft-sample-method") + 1],
                              flags[flags.index("--rejection-sample-method") + 1])
        assert {(e["draft_sample_method"], e["rejection_sample_method"]) for e in v["endpoints"].values()} <= set(pairs)
        from regen.cli import command_parser

        command_parser("eval").parse_args(["--run", "runs/x", *flags[2:]])  # regen eval takes the flags as written


def test_vllm_speculative_config_keys_and_values_are_vllms_own():
    src = engine_source("vllm", "config/speculative.py")
    assert literal_args(src, "DraftSampleMethod") == vllm.DRAFT_SAMPLE_METHODS
    assert literal_args(src, "RejectionSampleMethod") == vllm.REJECTION_SAMPLE_METHODS
    fields = class_fields(src, "SpeculativeConfig")
    assert fields["draft_sample_method"] == "DraftSampleMethod"
    assert fields["rejection_sample_method"] == "RejectionSampleMethod"
    rec = vllm.launch(CFG)
    spec = rec["speculative_config"]
    assert (spec["draft_sample_method"], spec["rejection_sample_method"]) == ("probabilistic", "block")  # the card's
    assert set(spec) <= set(fields), set(spec) - set(fields)  # every key is a SpeculativeConfig field
    greedy = rec["verification"]["endpoints"]["greedy"]["speculative_config"]
    assert (greedy["draft_sample_method"], greedy["rejection_sample_method"]) == ("greedy", "block")
    assert '"rejection_sample_method":"block"' in " ".join(rec["command"])


def test_sglang_block_flag_and_greedy_draft_environment_are_sglangs_own():
    src = engine_source("sglang", "srt/arg_groups/fields/spec.py")
    field = sglang.BLOCK_FLAG.removeprefix("--").replace("-", "_")
    assert f"    {field}: A[" in src, f"{field} is no longer a field of SGLang's speculative arguments"
    assert sglang.BLOCK_FLAG in engine_source("sglang", "srt/arg_groups/speculative_hook.py")
    assert "DSPARK" in engine_source("sglang", "srt/arg_groups/speculative_hook.py").split(
        "if cfg.speculative_use_block_verification:")[1][:300]  # DSpark is among the block-verified algorithms
    assert f"    {sglang.GREEDY_DRAFT_ENV} = EnvBool(False)" in engine_source("sglang", "srt/environ.py")
    assert f"envs.{sglang.GREEDY_DRAFT_ENV}.get()" in engine_source(
        "sglang", "srt/speculative/dspark_components/dspark_worker_v2.py")
    rec = sglang.launch(CFG)
    assert sglang.BLOCK_FLAG in rec["command"]
    assert rec["verification"]["endpoints"]["greedy"]["env"] == {sglang.GREEDY_DRAFT_ENV: "1"}


def test_tokenspeed_drafts_dspark_greedily_and_has_no_block_verification():
    geometry = engine_source("tokenspeed", "runtime/utils/spec_block_geometry.py")
    assert "DSPARK" in literal_tuple(geometry, "BLOCK_SPEC_ALGORITHMS")
    args = engine_source("tokenspeed", "runtime/utils/server_args.py")
    validate = args.split("def _validate_speculative_sampling")[1]
    assert "if self.speculative_algorithm in BLOCK_SPEC_ALGORITHMS:" in validate
    assert "block_verification" not in args and "rejection_sample_method" not in args
    ep = tokenspeed.launch(CFG)["verification"]["endpoints"]
    assert [(e["draft_sample_method"], e["rejection_sample_method"]) for e in ep.values()] == [("greedy", "standard")]


def literal_tuple(source: str, name: str) -> tuple:
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found")
