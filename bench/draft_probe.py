"""What a trained draft uses: its backbone and context features, or only the Markov head's bigram?

    .venv/bin/python bench/draft_probe.py --run runs/local                        # the main job's draft
    .venv/bin/python bench/draft_probe.py --run runs/local --draft DIR --split train --rows 40

acc_len tells how long the accepted prefix is, not why. This probe reads the draft on rendered rows of the run,
teacher-forced (the spec §5 training pass: blocks `[x_a, MASK…]` at every anchor a with a supervised next
token, the Markov head fed the row's own previous token), and reports per block slot k = 1…K the share of
slots whose top-1 token equals the target's greedy token at that position (what greedy verification accepts,
spec §7) for:

- `draft`: the draft as served (U_k + W2·W1[x_(k-1)], spec §3);
- `backbone`: U_k alone (the Markov bias left out);
- `markov`: W2·W1[x_(k-1)] alone: a low-rank bigram of the previous token;
- `no_context`: the whole draft with its context masked out of attention: each block sees only its own slots,
  none of the target's tap features (what the context adds).

and, for slot 1's queries, the attention mass by distance d = a − j to context position j (summed over heads'
mean, each layer), the mass on the block's own slots, and the uniform mass 1/(visible positions), averaged over
blocks. A draft whose slot-1 attention is flat and whose `draft` barely beats `markov` has learned a bigram, not
to read the target's features (docs/benchmarks.md: the training budget of the local profile).

Rows: `<run>/shards` cut as the trainer cuts them (`train.max_len`, `train.truncate`), the held-out prompts of
`train.heldout_fraction` (`--split heldout`, the prompts `regen eval` measures) or the training ones. Writes the
figures to `--out` (default `<draft>/probe-<split>.json`).
"""
from __future__ import annotations

import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
import _preamble  # noqa: E402, F401 - bench/ off sys.path, the repository root first, HF offline

import argparse
import contextlib
import dataclasses
from pathlib import Path

VARIANTS = ("draft", "backbone", "markov", "no_context")
NEAR = 8  # distances 1…NEAR reported one by one, the rest summed


def probe_rows(run, cfg, split: str, limit: int) -> list[dict]:
    """Rows of `run.shards` exactly as the trainer's feed (`regen.train.feed.ShardFeed`) takes them, in manifest
    order: {input_ids int list, loss_mask bool list}, cut to `train.max_len` on the `train.truncate` side, short
    rows dropped, shard checksums checked; the held-out prompts of `train.heldout_fraction` and
    `train.heldout_per_cell` (`regen.train.heldout.heldout_split`) for `split="heldout"`, the training ones
    otherwise; at most `limit`.
    Raises InputError for a missing manifest, a changed shard, or `--split heldout` with nothing held out."""
    from regen.errors import InputError
    from regen.train.feed import FeedConfig, ShardFeed
    from regen.train.heldout import heldout_split

    frac = cfg.heldout_fraction
    if split == "heldout" and not frac > 0:
        raise InputError("train.heldout_fraction is 0: no prompt is held out; use --split train or "
                         "--set train.heldout_fraction=0.15 (the prompts the draft did not train on)")
    # one row per micro-batch, no shuffle, no length bucketing: the rows in manifest order, unpadded
    fc = dataclasses.replace(FeedConfig.from_train(cfg), max_batch=1, shuffle_buffer=1, bucket_window=1)
    held = heldout_split(run, frac, cfg.heldout_per_cell)
    skip = (lambda pid: not held(pid)) if split == "heldout" else held  # skip(pid) True: the row is left out
    out = []
    for step in ShardFeed(run.shards, fc, heldout=skip).steps(num_epochs=1):
        for mb in step.microbatches:
            out.append({"input_ids": mb.input_ids[0].tolist(), "loss_mask": mb.loss_mask[0].tolist()})
            if len(out) >= limit:
                return out
    return out


@contextlib.contextmanager
def recorded_attention(store: list):
    """Within the block, the draft's attention (`regen.train.attention`) runs as an explicit softmax whose
    probabilities float32[B, heads, Q, S+Q] are appended to `store`, one entry per layer call; same outputs."""
    import torch

    from regen.train import attention, layers

    original, original_attention = layers.F, attention.F  # the draft's layers call SDPA through regen.train.attention

    def explicit(q, k, v, attn_mask=None, scale=None, **other):
        if any(other.values()):  # is_causal, dropout_p, enable_gqa: not what the draft's layers use
            raise NotImplementedError(f"recorded_attention: unsupported arguments {sorted(other)}")
        scores = (q.float() @ k.float().transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        p = scores.softmax(-1)
        store.append(p)
        return (p @ v.float()).to(v.dtype)

    class Patched:
        def __getattr__(self, name):
            return explicit if name == "scaled_dot_product_attention" else getattr(torch.nn.functional, name)

    layers.F = attention.F = Patched()
    try:
        yield store
    finally:
        layers.F, attention.F = original, original_attention


def probe(draft, target, rows: list[dict], chunk: int = 64) -> dict:
    """Per-slot top-1 agreement with the target's greedy token for each of `VARIANTS`, and slot-1 attention
    mass by distance (see the module docstring). Returns {"slots": {variant: [K floats]}, "num_slots": [K],
    "attention": {"layers": [{"distance": {"1": m, …, f">{NEAR}": m}, "own_block": m, "uniform": m}]},
    "num_rows", "num_blocks"}."""
    import torch

    from regen.train.loss import evaluation_mask, sample_anchors, slot_positions

    K = draft.config.block_size
    hits = {v: torch.zeros(K, dtype=torch.float64) for v in VARIANTS}
    count = torch.zeros(K, dtype=torch.float64)
    att_sum: list[dict] = []
    blocks = rows_probed = 0
    for row in rows:
        ids = torch.tensor([row["input_ids"]], dtype=torch.long)
        lm = torch.tensor([row["loss_mask"]], dtype=torch.bool)
        S = ids.shape[1]
        anchors, keep = sample_anchors(lm, S)  # every valid anchor (spec §5), ascending
        if not keep.any():
            continue
        N = anchors.shape[1]
        taps, last = target.features(ids, torch.ones_like(ids))
        greedy = target.logits(last).argmax(-1)[0]  # greedy token after each position
        # blocks never see each other (spec §2 training mask): chunks of anchors give the same figures while the
        # recorded [heads, chunk·K, S + chunk·K] probabilities stay bounded on long rows
        hs, h0s = [], []
        for c in range(0, N, chunk):
            a_c, k_c = anchors[:, c:c + chunk], keep[:, c:c + chunk]
            store: list = []
            with torch.no_grad(), recorded_attention(store):
                hs.append(draft(taps, ids, a_c, k_c)[0])  # [n, K, H]
            with torch.no_grad():  # an all-False attention mask hides every context position (spec §2)
                h0s.append(draft(taps, ids, a_c, k_c, None, torch.zeros_like(ids, dtype=torch.bool))[0])
            _add_slot1_attention(att_sum, store, a_c[0], S, K)
        h, h0 = torch.cat(hs), torch.cat(h0s)
        pos = slot_positions(anchors, K)[0]  # [N, K]: slot k's previous-token position a+k
        supervised = evaluation_mask(anchors, keep, lm, K)[0].bool()  # a contiguous supervised prefix (spec §5)
        prev = ids[0, pos.clamp(max=S - 1)]
        want = greedy[pos.clamp(max=S - 1)]
        with torch.no_grad():
            preds = {
                "draft": draft.corrected_logits(h, prev),
                "backbone": draft.base_logits(h),
                "markov": draft.markov_bias(prev) if draft.markov_head is not None else None,
                "no_context": draft.corrected_logits(h0, prev),
            }
        for name, logits in preds.items():
            if logits is None:
                continue
            hit = (draft.to_target_ids(logits.argmax(-1)) == want) & supervised
            hits[name] += hit.double().sum(0)
        count += supervised.double().sum(0)
        blocks += N
        rows_probed += 1
    if not blocks:
        from regen.errors import InputError

        raise InputError("no row with a supervised anchor among the probed rows: render more data or use --split train")
    slots = {v: [float(x) for x in (hits[v] / count.clamp(min=1))] for v in VARIANTS}
    if draft.markov_head is None:
        slots["markov"] = None
    layers_out = [{"distance": {**{str(i + 1): float(a["distance"][i]) / blocks for i in range(NEAR)},
                                f">{NEAR}": float(a["distance"][NEAR]) / blocks},
                   "own_block": a["own_block"] / blocks, "uniform": a["uniform"] / blocks} for a in att_sum]
    return {"slots": slots, "num_slots": [int(x) for x in count], "attention": {"layers": layers_out},
            "num_rows": rows_probed, "num_blocks": blocks}


def _add_slot1_attention(att_sum: list[dict], store: list, anchors_N, S: int, K: int) -> None:
    """Add slot 1's attention mass of one pass (`store`: per layer [1, heads, N·K, S + N·K] for `anchors_N`) to
    `att_sum` (per layer: mass by distance a − j for 1…NEAR and beyond, own-block mass, uniform 1/(a + K))."""
    import torch

    for li, p in enumerate(store):
        slot1 = p[0, :, ::K].mean(0)  # [N, S + N·K], mean over heads
        while len(att_sum) <= li:
            att_sum.append({"distance": torch.zeros(NEAR + 1, dtype=torch.float64), "own_block": 0.0, "uniform": 0.0})
        acc = att_sum[li]
        for n, a in enumerate(anchors_N.tolist()):
            ctx = slot1[n, :a]  # visible context: positions < a (spec §2 training mask)
            d = a - torch.arange(a)
            acc["distance"][:NEAR] += torch.stack([ctx[d == i].sum() for i in range(1, NEAR + 1)]).double()
            acc["distance"][NEAR] += float(ctx[d > NEAR].sum())
            acc["own_block"] += float(slot1[n, S + n * K: S + (n + 1) * K].sum())
            acc["uniform"] += 1.0 / (a + K)


def format_report(out: dict) -> str:
    K = len(out["num_slots"])
    lines = [f"top-1 = target's greedy token, teacher-forced, {out['num_rows']} rows, {out['num_blocks']} blocks",
             f"{'slot':<12}" + "".join(f"{k + 1:>7}" for k in range(K))]
    for v in VARIANTS:
        vals = out["slots"][v]
        lines.append(f"{v:<12}" + ("".join(f"{x:7.3f}" for x in vals) if vals else "   (no Markov head)"))
    d1, m1, n1 = out["slots"]["draft"][0], (out["slots"]["markov"] or [None])[0], out["slots"]["no_context"][0]
    ratios = [f"draft / draft with context masked out {d1 / n1:.2f}x" if n1 else "context masked out: 0"]
    if m1:
        ratios.insert(0, f"draft / Markov bigram {d1 / m1:.2f}x")
    lines.append("slot 1: " + ", ".join(ratios) + " (the baselines, measured in the same pass)")
    for li, layer in enumerate(out["attention"]["layers"]):
        d = layer["distance"]
        lines.append(f"layer {li} slot-1 attention: own block {layer['own_block']:.3f}; by distance "
                     + " ".join(f"{k}:{v:.3f}" for k, v in d.items())
                     + f"; uniform per position {layer['uniform']:.4f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import torch
    from transformers import AutoConfig

    from regen.config import load_profile, resolve_path
    from regen.errors import InputError
    from regen.rundir import RunDir
    from regen.train.checkpoint import find_draft
    from regen.train.draft_config import build_draft_config
    from regen.train.model import load_draft
    from regen.train.target import TargetContract, TargetFeatures
    from schemas.io import write_json_atomic

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a run directory with shards, e.g. runs/local")
    p.add_argument("--profile", default="local")
    p.add_argument("--draft", default=None, help="checkpoint folder or a folder with latest.json (default <run>/train)")
    p.add_argument("--split", choices=("heldout", "train"), default="heldout")
    p.add_argument("--rows", type=int, default=40, help="rows probed (default 40)")
    p.add_argument("--out", default=None, help="JSON output (default <draft>/probe-<split>.json)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)

    profile = load_profile(args.profile, dict(kv.split("=", 1) for kv in args.overrides))
    cfg = profile.train
    run = RunDir.at(args.run)
    draft_dir = find_draft(args.draft or run.train)
    target_path = resolve_path(cfg.target)
    if not (Path(target_path) / "config.json").exists():
        raise InputError(f"train.target={cfg.target!r}: no config.json in {target_path} (run `bash scripts/setup.sh`)")
    draft_cfg = build_draft_config(cfg, AutoConfig.from_pretrained(str(target_path), local_files_only=True))
    target = TargetFeatures.from_pretrained(target_path, TargetContract.from_draft_config(draft_cfg),
                                            dtype=torch.float32)
    draft = load_draft(draft_dir, target.model).float().eval()
    target.contract.check(dataclasses.asdict(draft.config), str(draft_dir / "config.json"))
    rows = probe_rows(run, cfg, args.split, args.rows)
    out = {"draft": str(draft_dir), "split": args.split, **probe(draft, target, rows, chunk=max(1, cfg.num_anchors))}
    write_json_atomic(out, Path(args.out) if args.out else draft_dir / f"probe-{args.split}.json")
    print(format_report(out))
    return 0


if __name__ == "__main__":
    from regen.errors import exit_code

    sys.exit(exit_code(main, "bench/draft_probe.py"))
