"""Evaluation during training: a cheap held-out estimate of acc_len every `train.eval_every`
steps, the best checkpoint kept beside the latest, the curve in `<train>/periodic_eval.jsonl`.

The estimate, labelled as one everywhere it is written (`METHOD`): on up to `train.eval_rows` held-out rows of the
shards (the prompts `regen.train.heldout.is_heldout` keeps out of training, the ones `regen eval` measures), the
target runs once over the row as rendered (prompt + the recorded answer: the target's own regenerated answer) and
the draft proposes a block at every position of the answer (`regen.train.eval.proposal_table`); the rounds are
replayed (`regen.train.eval.replay_rounds`) against the row's recorded next tokens instead of the target's greedy
decode. So it costs one target forward per row and no generation, and it follows the full measurement's direction
(a draft that matches the target's answers better is accepted longer) without being it: `regen eval` measures
acc_len against the target's own decode after training. Its figures per row: acc_len per round (Σ τ / rounds over
all rows) and per request (the mean of each row's), per-position accept rates.

Best checkpoint: when the estimate (per round) beats every earlier one, `<train>/best/` is replaced by the draft
at that step (`config.json` + `model.safetensors`, servable; `best.json` says its step, estimate and method), so
`best/` and the latest step folder stand side by side. Needs the target's features in the trainer
(`train.features: in_process`): with producers the held-out rows are not produced, so the estimate is skipped with
that reason, logged at the start and kept in the summary (`eval_during_training.skipped`); training is the same.
No held-out row at all is an InputError at the start (raise train.heldout_fraction or set train.eval_every: 0).
Every rank computes the same estimate (the FSDP collectives stay in step); rank 0 writes.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from regen.errors import InputError
from regen.train.tracking import Tracker

log = logging.getLogger(__name__)

METHOD = ("estimate: teacher-forced replay on held-out rows' recorded answers (rounds verified against the "
          "recorded next tokens, not the target's greedy decode; one target forward per row)")
CURVE = "periodic_eval.jsonl"
BEST = "best"


def heldout_rows(run, heldout, num_rows: int, max_len: int) -> list[dict]:
    """Up to `num_rows` held-out shard rows (one per prompt, ordered by hash): {prompt_id, input_ids (first
    `max_len`), first: the first supervised position}. `heldout`: a `regen.train.heldout.HeldoutSplit` or a
    fraction (the sha256 bucket alone)."""
    import hashlib

    import pyarrow.parquet as pq

    from regen.train.heldout import as_split

    split = as_split(heldout)

    manifest = run.manifest(run.shards) or {}
    seen: dict[str, dict] = {}
    for entry in manifest.get("shards", []):
        t = pq.read_table(Path(run.shards) / entry["path"], columns=["prompt_id", "input_ids", "loss_spans"])
        for row in t.to_pylist():
            pid = row["prompt_id"]
            if pid in seen or not row["loss_spans"] or not split(pid):
                continue
            first = row["loss_spans"][0]["start"]
            if 0 < first < min(len(row["input_ids"]), max_len) - 1:
                seen[pid] = {"prompt_id": pid, "input_ids": row["input_ids"][:max_len], "first": first}
    order = sorted(seen, key=lambda p: hashlib.sha256(p.encode()).hexdigest())
    return [seen[p] for p in order[:num_rows]]


class PeriodicEval:
    """The estimate every `cfg.eval_every` steps and the best checkpoint (module docstring).

    `maybe(step, model, final=False)` runs it when due (every eval_every steps and, with `final`, at the last
    step), appends the curve and keeps the best; returns the record or None. `summary()`: {curve, best, method}.
    """

    def __init__(self, cfg, run, train_dir: Path, target, *, is_main: bool, tracker=None):
        self.every, self.keep_best = cfg.eval_every, cfg.keep_best
        self.train_dir, self.target, self.is_main, self.tracker = Path(train_dir), target, is_main, tracker
        self.rows = []
        self.curve: list[dict] = []
        self.best: dict | None = None
        self.skipped: str | None = None
        if self.every <= 0:
            return
        if cfg.features != "in_process":
            self.skipped = (f"train.eval_every={cfg.eval_every} needs the target's features in the trainer "
                            f"(train.features: in_process; it is {cfg.features!r}: the producers make no features "
                            "of held-out rows): no estimate during training; measure with `regen eval` after it")
            self.every = 0
            if is_main:
                log.warning("%s", self.skipped)
            return
        from regen.train.heldout import heldout_split

        self.rows = heldout_rows(run, heldout_split(run, cfg.heldout_fraction, cfg.heldout_per_cell), cfg.eval_rows,
                                 cfg.max_len)
        if not self.rows:
            raise InputError(f"train.eval_every={cfg.eval_every}: no held-out rows in {run.shards} at "
                             f"train.heldout_fraction={cfg.heldout_fraction}; raise it or set train.eval_every: 0")
        old = self.train_dir / CURVE
        if old.exists():  # a resumed run keeps its curve and its best
            self.curve = [json.loads(x) for x in old.read_text(encoding="utf-8").splitlines() if x.strip()]
            best = self.train_dir / BEST / "best.json"
            self.best = json.loads(best.read_text()) if best.exists() else None

    def due(self, step: int, final: bool = False) -> bool:
        return self.every > 0 and (step % self.every == 0 or final) and not any(c["step"] == step for c in self.curve)

    def maybe(self, step: int, model, final: bool = False) -> dict | None:
        if not self.due(step, final):
            return None
        t0 = time.perf_counter()
        rec = {"step": step, **self.estimate(model), "eval_every": self.every, "num_rows": len(self.rows),
               "method": METHOD}
        rec["seconds"] = round(time.perf_counter() - t0, 3)  # the estimate's wall time: its share of training
        self.curve.append(rec)
        improved = self.best is None or rec["acc_len_estimate"] > self.best["acc_len_estimate"]
        if improved and self.keep_best:
            self._save_best(model, rec)  # collective: every rank
        if self.is_main:
            with open(self.train_dir / CURVE, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
            if self.tracker is not None:
                self.tracker.log_eval(step, {k: v for k, v in rec.items() if k.startswith("acc_len")},
                                      "eval_during_training")
        if improved:
            self.best = {k: rec[k] for k in ("step", "acc_len_estimate", "acc_len_estimate_per_request", "method")}
        return rec

    def estimate(self, model) -> dict:
        """{acc_len_estimate (per round), acc_len_estimate_per_request, accept_rate: [...]} over the rows."""
        import torch

        from regen.train.eval import proposal_table, replay_rounds

        draft = getattr(model, "draft", model)
        block = draft.config.block_size
        rounds_of = []
        was_training = draft.training
        draft.eval()
        unshard = getattr(model, "unshard", None)  # FSDP2: the root's own parameters, gathered for the proposals
        if unshard is not None:
            unshard()
        try:
            with torch.no_grad():
                for row in self.rows:
                    ids = list(row["input_ids"])
                    x = torch.tensor([ids], device=self.target.device)
                    taps, _ = self.target.features(x, torch.ones_like(x))
                    dev = next(draft.parameters()).device
                    first = row["first"]  # the answer's first token: the prefill's token in `regen eval`
                    table = proposal_table(draft, taps[0].to(dev), ids, first)
                    known = ids[1:] + [-1]  # the recorded next token after each position
                    rounds_of.append(replay_rounds(lambda pos, t=table, f=first: t[pos - f], ids, known, first,
                                                   max_new_tokens=len(ids), block_size=block, stop_ids=[]))
        finally:
            if unshard is not None:
                model.reshard()
            draft.train(was_training)
        rounds = [r for rs in rounds_of for r in rs]
        per_req = [sum(r.tau for r in rs) / len(rs) for rs in rounds_of if rs]
        rates = []
        for k in range(block):
            proposed = sum(1 for r in rounds if r.proposed > k)
            rates.append(round(sum(1 for r in rounds if r.accepted > k) / proposed, 6) if proposed else None)
        return {"acc_len_estimate": round(sum(r.tau for r in rounds) / len(rounds), 6) if rounds else 0.0,
                "acc_len_estimate_per_request": round(sum(per_req) / len(per_req), 6) if per_req else 0.0,
                "num_rounds": len(rounds), "accept_rate": rates}

    def _save_best(self, model, rec: dict) -> None:
        """Replace `<train>/best/` by the draft now (collective; rank 0 writes, tmp folder then rename)."""
        import torch.distributed as dist
        from safetensors.torch import save_file

        from regen.train.checkpoint import _draft_of, servable_weights
        from regen.train.model import CONFIG_NAME, WEIGHTS_NAME
        from schemas.io import write_json_atomic

        draft, _ = _draft_of(model)
        state = servable_weights(model)  # the step folders' own export: the frozen target tensors never gathered
        if self.is_main:
            tmp, final = self.train_dir / f".tmp-{BEST}", self.train_dir / BEST
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / WEIGHTS_NAME),
                      metadata={"format": "pt"})
            write_json_atomic(draft.config.to_dict(), tmp / CONFIG_NAME)
            write_json_atomic({k: rec[k] for k in ("step", "acc_len_estimate", "acc_len_estimate_per_request",
                                                   "num_rows", "method")}, tmp / "best.json")
            old = self.train_dir / f".old-{BEST}"
            shutil.rmtree(old, ignore_errors=True)
            if final.exists():
                final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        if dist.is_initialized():
            from regen.train.collectives import control_barrier

            control_barrier()

    def summary(self) -> dict:
        """What the training summary carries: the curve's (step, estimate) points, the best, the method."""
        if self.skipped:
            return {"skipped": self.skipped}
        if self.every <= 0:
            return {}
        return {"eval_every": self.every, "method": METHOD, "best": self.best,
                "best_dir": str(self.train_dir / BEST) if self.best and self.keep_best else None,
                "curve": [{"step": c["step"], "acc_len_estimate": c["acc_len_estimate"],
                           "acc_len_estimate_per_request": c["acc_len_estimate_per_request"]} for c in self.curve]}


class TrainHooks:
    """What `regen.train.trainer.Trainer` calls besides training: the trackers (`regen.train.tracking.Tracker`), the progress
    line and the evaluation during training with the best checkpoint (`PeriodicEval`).

    `log(rec)` per logged step; `after_step(step, model, final=False)` after every step (collective: every rank
    calls it, the estimate runs on all of them); `close(summary)` -> the keys the training summary adds
    (`eval_during_training`, `tracking`)."""

    def __init__(self, cfg, run, train_dir: Path, target, info, total_steps: int, start_step: int):
        self.tracker = Tracker(cfg, train_dir, run, is_main=info.is_main, total_steps=total_steps,
                               start_step=start_step)
        self.periodic = PeriodicEval(cfg, run, train_dir, target, is_main=info.is_main, tracker=self.tracker)
        self.train_dir = Path(train_dir)

    def log(self, rec: dict) -> None:
        self.tracker.log(rec)

    def after_step(self, step: int, model, final: bool = False) -> None:
        self.periodic.maybe(step, model, final=final)
        self.tracker.progress(step, force=final)

    def close(self, summary: dict) -> dict:
        during = self.periodic.summary()
        best = (during.get("best") or {}) if during else {}
        final = {k: summary.get(k) for k in ("loss_last", "tau_probabilistic_last", "tokens_per_s", "steps")}
        if best:
            final["acc_len_estimate_best"] = best["acc_len_estimate"]
            final["acc_len_estimate_best_step"] = best["step"]
        self.tracker.close({k: v for k, v in final.items() if v is not None})
        out = {"tracking": {"backends": self.tracker.names,
                            "tensorboard": str(self.train_dir / "tensorboard") if self.tracker.tb else None}}
        if during:
            out["eval_during_training"] = during
        return out
