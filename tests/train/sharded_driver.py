"""Sharded (DCP) resume across world sizes: helpers, and the torchrun side of tests/train/test_gpu_paths.py.

    torchrun --nproc_per_node 2 sharded_driver.py save OUT    # step, save OUT/dcp, rank 0 writes OUT/ref.pt
    torchrun --nproc_per_node 2 sharded_driver.py load IN OUT  # load IN, rank 0 writes OUT (the full state)
    torchrun --nproc_per_node 2 sharded_driver.py poison OUT    # a NaN in rank 1's shard only, then
                                                                # save_checkpoint(OUT): each rank writes its error
"""
from __future__ import annotations

import sys

import torch


def build(seed: int, info):
    from regen.train.draft_config import DSparkConfig
    from regen.train.model import DSparkDraft
    from regen.train.parallel import shard_model
    from regen.train.step import make_objective

    torch.manual_seed(seed)
    cfg = DSparkConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=8,
                       qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, vocab_size=128, target_hidden_size=32,
                       target_num_hidden_layers=6, target_layer_ids=(1, 3), fc_norm=True, mask_token_id=100,
                       markov_rank=4, eos_token_id=(2,), pad_token_id=None, num_anchors=4, num_hidden_layers=2)
    draft = DSparkDraft(cfg)
    model = shard_model(make_objective(draft), info, blocks=draft.layers)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def fake_step(model, opt, seed: int) -> None:
    """Gradients from a seeded generator (the same full gradient at any world size), then one AdamW step."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        full = torch.randn(p.shape, generator=g)
        if hasattr(p, "full_tensor"):
            from torch.distributed.tensor import distribute_tensor

            p.grad = distribute_tensor(full, p.device_mesh, p.placements)
        else:
            p.grad = full
    opt.step()
    opt.zero_grad(set_to_none=True)


def full_state(model, opt) -> dict:
    from regen.train.parallel import full_model_state, full_optim_state

    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    weights = {k: v.clone() for k, v in full_model_state(model).items() if k not in frozen}
    optim = full_optim_state(model, opt)
    moments = {f"{k}/{m}": v.clone() for k, s in optim.get("state", {}).items() for m, v in s.items()
               if isinstance(v, torch.Tensor)}
    return {"weights": weights, "moments": moments}


def poison_and_save(out: str, info) -> None:
    from pathlib import Path

    from regen.errors import InputError
    from regen.train.checkpoint import save_checkpoint

    class Feed:
        def state_dict(self):
            return {}

    model, opt = build(0, info)
    fake_step(model, opt, 1)
    if info.rank == 1:  # the first moment with a non-empty shard on rank 1
        for p in model.parameters():
            if p.requires_grad and opt.state[p]["exp_avg"].to_local().numel():
                opt.state[p]["exp_avg"].to_local().view(-1)[0] = float("nan")
                break
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    try:
        save_checkpoint(Path(out), 1, model, opt, sched, Feed(), training={})
        msg = "written"
    except InputError as exc:  # CheckpointError on the rank that found it, InputError naming it on the others
        msg = f"{type(exc).__name__}: {exc}"
    Path(out, f"rank{info.rank}.txt").write_text(msg)


def main(argv: list[str]) -> None:
    from regen.train.parallel import destroy_distributed, init_distributed
    from regen.train.sharded_state import load_sharded, save_sharded

    info = init_distributed("cpu")
    if argv[0] == "save":
        model, opt = build(0, info)
        fake_step(model, opt, 1)
        save_sharded(f"{argv[1]}/dcp", model, opt)
        ref = full_state(model, opt)
        if info.is_main:
            torch.save(ref, f"{argv[1]}/ref.pt")
    elif argv[0] == "poison":
        poison_and_save(argv[1], info)
    else:
        model, opt = build(7, info)  # another init: everything must come from the checkpoint
        load_sharded(argv[1], model, opt)
        got = full_state(model, opt)
        if info.is_main:
            torch.save(got, argv[2])
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
