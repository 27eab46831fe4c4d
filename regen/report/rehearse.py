"""`regen rehearse`: one optimizer step of a profile's training job at its real size on stand-in tensors, set
beside `regen plan`'s memory per GPU.

    regen rehearse --profile kimi-k3 [--world-size W] [--json] [--set train.attention=flex]

The passes are `regen.train.rehearse` (what runs, on which tensors, what it cannot see); the watching is
`regen.train.rehearse_modes`. This module sizes the step from the profile (as `regen plan` does), compares the
rehearsed peak of rank 0 with the plan's terms (`regen.report.plan.draft_plan` -> `regen.train.memory`) and prints the
report in 80 columns, or `--json`. Exit status 1 (RehearsalError) when a host tensor met a device one.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter

from regen.train.rehearse import fake_world, flex_on_stand_ins, memory_pass, placement_pass

GiB = 1024 ** 3
# plan terms -> the tracker's kinds that hold the same bytes
GROUPS = (
    ("parameters", ("weights", "unsharded_params"),
     ("Sharded Param", "Unsharded Param", "All Gather", "Buffer", "Frozen (replicated)")),
    ("gradients", ("gradients",), ("Sharded Grad", "Unsharded Grad", "Reduce Scatter")),
    ("optimizer", ("optimizer",), ("OptState",)),
    ("activations+features+loss", ("features", "activations", "loss"), ("Activation", "Temp", "Inputs")),
)


class RehearsalError(RuntimeError):
    """The rehearsal found a host tensor meeting a device one (the report names each)."""


def shapes(profile, world_size: int | None = None) -> dict:
    """The step the rehearsal runs: tokens, grad_accum, world size, attention, compute dtype (see module doc)."""
    from regen.report.plan import assumptions

    t = profile.train
    a = assumptions(profile, {"world_size": world_size})
    return {"tokens": int(t.max_tokens), "grad_accum": int(t.grad_accum), "world_size": int(a["world_size"]),
            "attention": t.attention, "dtype": "float32" if t.dtype == "float32" else "bfloat16",
            "features": t.features}


def _draft_config(profile):
    from regen.errors import InputError
    from regen.report.plan import target_config
    from regen.train.draft_config import build_draft_config

    tc, source = target_config(profile)
    if tc is None:
        raise InputError(f"regen rehearse: {source}; set train.target to a directory with config.json or use "
                         "train.draft_preset=kimi-k3")
    return build_draft_config(profile.train, tc), tc


def plan_memory(profile, world_size: int) -> dict:
    """`regen plan`'s memory per GPU for this profile, bytes by term (`regen.report.plan.draft_plan`)."""
    from regen.report.plan import assumptions, draft_plan

    d = draft_plan(profile, assumptions(profile, {"world_size": world_size}), 0.0)
    return {k: int(round(v * GiB)) for k, v in d["memory_per_gpu_gib"].items()}


def _summarise(events, grad_accum: int, group_names: dict, steps: int = 1) -> dict:
    syncs = [e for e in events if e.kind == "sync"]
    per_mb = Counter((e.op, e.where) for e in syncs if e.phase.startswith("micro-batch"))
    other = Counter((e.phase, e.op, e.where) for e in syncs if not e.phase.startswith("micro-batch"))
    mb_syncs = [{"op": op, "where": w, "per_micro_batch": n / grad_accum,
                 "part": "features" if "/features/" in w else "loss+step"} for (op, w), n in per_mb.most_common()]
    loss_step = sum(s["per_micro_batch"] for s in mb_syncs if s["part"] == "loss+step")
    coll = Counter()
    for e in events:
        if e.kind == "collective":
            d = dict(x.split("=", 1) for x in e.detail.split())
            g = group_names.get(d.get("group"), d.get("group"))
            coll[(e.op, g, d.get("devices"), e.phase.split(" ")[0])] += 1 / steps
    placement = Counter((e.op, e.where, e.detail) for e in events if e.kind == "placement")
    return {
        "syncs_per_micro_batch": mb_syncs,
        "syncs_loss_and_step_per_micro_batch": loss_step,
        "syncs_features_per_micro_batch": sum(s["per_micro_batch"] for s in mb_syncs if s["part"] == "features"),
        "syncs_outside_micro_batches": [{"phase": p, "op": op, "where": w, "count": n}
                                        for (p, op, w), n in other.most_common()],
        "collectives": [{"op": op, "group": g, "devices": d, "phase": ph, "count": n}
                        for (op, g, d, ph), n in coll.most_common()],
        "placement_errors": [{"op": op, "where": w, "detail": d, "count": n} for (op, w, d), n in placement.items()],
    }


def rehearse(profile, *, world_size: int | None = None, placement: bool = True) -> dict:
    """Both passes for `profile` (a loaded `Profile`); returns the report `main` prints (see the module docstring).
    Raises InputError when the draft's shape is unknown (no target config and not the kimi-k3 preset)."""
    import time

    import torch

    from regen.errors import InputError

    shape = shapes(profile, world_size)
    if shape["attention"] not in ("sdpa", "flex"):
        raise InputError(f"train.attention={shape['attention']!r}: allowed values are sdpa, flex")
    cfg, tc = _draft_config(profile)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with fake_world(shape["world_size"]), flex_on_stand_ins():
        mem = memory_pass(profile, cfg, tc, shape)
        t1 = time.perf_counter()
        place = placement_pass(profile, cfg, tc, shape) if placement else {"events": [], "finite": True}
    t2 = time.perf_counter()
    plan = plan_memory(profile, shape["world_size"])
    rows = []
    for name, terms, kinds in GROUPS:
        r, p = sum(mem["peak"].get(k, 0) for k in kinds), sum(plan.get(t, 0) for t in terms)
        rows.append({"group": name, "rehearsed": r, "plan": p, "ratio": p / r if r else None,
                     "kinds": {k: mem["peak"].get(k, 0) for k in kinds}, "terms": {t: plan.get(t, 0) for t in terms}})
    total_r, total_p = sum(mem["peak"].values()), plan.get("total", 0)
    collectives = _summarise(mem["events"], shape["grad_accum"], mem["group_names"], steps=2)["collectives"]
    report = {
        "profile": profile.name, "shape": shape,
        "draft": {"layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "num_anchors": cfg.num_anchors,
                  "block_size": cfg.block_size, "output_vocab": cfg.draft_vocab_size or cfg.vocab_size},
        "memory": {"peak_by_kind": mem["peak"], "groups": rows, "rehearsed_total": total_r, "plan_total": total_p,
                   "ratio": total_p / total_r if total_r else None, "plan_terms": plan},
        "optimizer_stepped": mem["finite"] and mem["optimizer_states"] > 0,
        "collectives": collectives,
        **{k: v for k, v in _summarise(place["events"], shape["grad_accum"], {}).items() if k != "collectives"},
        "seconds": {"memory_pass": round(t1 - t0, 1), "placement_pass": round(t2 - t1, 1)},
    }
    report["ok"] = not report["placement_errors"]
    return report


def _gib(b) -> str:
    return f"{b / GiB:8.2f}"


def print_report(r: dict) -> None:
    """The report in 80 columns."""
    s = r["shape"]
    print(f"regen rehearse --profile {r['profile']}: one optimizer step on stand-in tensors")
    print(f"  rows of {s['tokens']:,} tokens x grad_accum {s['grad_accum']} on {s['world_size']} ranks, "
          f"{r['draft']['layers']} layers x {r['draft']['hidden_size']}, N={r['draft']['num_anchors']}, "
          f"{s['attention']}, {s['dtype']}, features {s['features']}")
    print(f"\nmemory per rank at the step's peak (GiB; fake tensors, FSDP2 over {s['world_size']} fake ranks)")
    print(f"  {'kind':<28}{'rehearsed':>10}{'plan':>10}{'plan/reh':>10}   plan terms")
    for g in r["memory"]["groups"]:
        ratio = f"{g['ratio']:10.2f}" if g["ratio"] is not None else f"{'-':>10}"
        print(f"  {g['group']:<28}{_gib(g['rehearsed']):>10}{_gib(g['plan']):>10}{ratio}   "
              + ", ".join(g["terms"]))
        for k, v in g["kinds"].items():
            if v:
                print(f"    {k:<26}{_gib(v):>10}")
    m = r["memory"]
    print(f"  {'total':<28}{_gib(m['rehearsed_total']):>10}{_gib(m['plan_total']):>10}"
          f"{m['ratio'] if m['ratio'] is None else format(m['ratio'], '10.2f')}")
    print(f"\nhost syncs per micro-batch (meta device for the GPU): loss+step "
          f"{r['syncs_loss_and_step_per_micro_batch']:g}, features {r['syncs_features_per_micro_batch']:g}")
    for x in r["syncs_per_micro_batch"]:
        print(f"  {x['per_micro_batch']:5g} x {x['op'][:22]:<22} {x['where'][:46]}")
    if r["syncs_outside_micro_batches"]:
        print("host syncs of the step outside its micro-batches")
        for x in r["syncs_outside_micro_batches"]:
            print(f"  {x['count']:5d} x {x['op'][:22]:<22} {x['where'][:38]} ({x['phase']})")
    print("\ncollectives per step (memory pass, rank 0; the checkpoint's gathers once)")
    for c in r["collectives"]:
        print(f"  {c['count']:5g} x {c['op'].removeprefix('c10d.')[:22]:<22} {c['group'][:20]:<20} "
              f"{c['devices'][:14]:<14} {c['phase']}")
    print("\ndevice placement (meta device for the GPU): " + ("no host tensor met a device one" if r["ok"] else
                                                           "FAILED"))
    for p in r["placement_errors"]:
        print(f"  {p['count']:3d} x {p['op'][:20]} at {p['where'][:48]}\n        {p['detail'][:70]}")
    print(f"\n({r['seconds']['memory_pass']} s memory pass, {r['seconds']['placement_pass']} s placement pass)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from regen.config import add_profile_arguments

    add_profile_arguments(parser, run_required=False)
    parser.add_argument("--world-size", type=int, default=None, help="fake ranks (default plan.world_size)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-placement", action="store_true", help="skip the placement and sync pass")


def main(args) -> int:
    from regen.config import load_profile

    profile = load_profile(args.profile, args.overrides)
    r = rehearse(profile, world_size=args.world_size, placement=not args.no_placement)
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        print_report(r)
    if not r["ok"]:
        raise RehearsalError(f"{len(r['placement_errors'])} place(s) where a host tensor meets a device one "
                             "(listed above): move the host tensor to the training device where it is made")
    return 0
