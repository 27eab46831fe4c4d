"""The llama.cpp round trip's fc_norm draft (the helpers and the overfit shards: test_spec_roundtrip.py): regen
refuses to export fc_norm for llama.cpp, and a forced export without the norms is served far below regen's
acceptance. A module of its own so that on two test workers its draft trains beside the gqa one."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_spec_roundtrip import (
    NEW_TOKENS,
    SERVE_GGUF,
    engine_run,
    local_target,
    overfit,
    pytestmark,
    train,
    write_broken,
)

from regen.config import load_profile
from regen.serve.engines import export_draft
from regen.serve.engines.draft import load_draft_checkpoint
from regen.serve.engines.spec_eval import regen_side, summarize_engine

__all__ = ["overfit", "pytestmark"]  # the shared module fixture and marks, used here by name


@pytest.fixture(scope="module")
def fcnorm_step(overfit) -> Path:
    """The last step folder of the same overfit draft with fc_norm=True, trained once."""
    run, _, root = overfit
    return load_draft_checkpoint(train(root, run, "fcnorm", fc_norm=True)).path



def test_an_fc_norm_draft_with_its_norms_dropped_is_caught(overfit, fcnorm_step):
    """regen refuses to export fc_norm for llama.cpp; forced, the served acceptance falls far below regen's."""
    from regen.serve.engines.draft import EngineRefused

    run, prompts, root = overfit
    step = fcnorm_step
    with pytest.raises(EngineRefused, match="llama.cpp: fc_norm=True"):
        export_draft(step, "llama.cpp", root / "refused", target_gguf=SERVE_GGUF(), target_path=str(local_target()))
    ours = regen_side(load_profile("local").train.model_copy(update={"target": str(local_target())}), prompts,
                      step, NEW_TOKENS)
    dropped = summarize_engine(engine_run(write_broken(step, root / "dropped", drop_fc_norm=True), prompts, root,
                                          "dropped"), 7)
    print("ROUNDTRIP fc_norm dropped " + json.dumps({"engine": dropped, "regen": ours["engine_budget_rule"]}))
    assert ours["engine_budget_rule"]["acc_len"] > 2.5
    assert dropped["acc_len"] < ours["engine_budget_rule"]["acc_len"] - 0.5, (dropped, ours)
