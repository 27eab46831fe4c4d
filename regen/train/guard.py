"""Guards of the training loop: a non-finite step stops every rank before the optimizer touches the weights, and a
loss far above its recent level is logged as a divergence warning.

A NaN or inf loss or gradient norm is not cleaned by gradient clipping (the clip coefficient is NaN too) and AdamW
spreads it into every weight at the next `optimizer.step()` (pocket-tts #262, habitat-lab #2226). `train_step`
checks the step's loss and global gradient norm on every rank, agrees on the verdict with one all-reduce of a flag,
and skips `optimizer.step()` when any rank saw a non-finite value; the loop then raises `NonFiniteStep` naming the
step, the micro-batches' sample ids and the last good checkpoint (exit status 3). Checkpoints refuse non-finite
tensors (`nonfinite_tensors`), so a diverged run never writes, keeps or serves NaN weights.
"""
from __future__ import annotations

import logging
import statistics
from collections import deque
from pathlib import Path

from regen.errors import InputError

log = logging.getLogger(__name__)


class NonFiniteStep(InputError):
    """A training step produced a non-finite loss or gradient norm; the weights were not updated. Exit status 3."""

    exit_status = 3


def nonfinite_tensors(tensors: dict) -> list[str]:
    """Sorted names of the floating-point tensors of `tensors` ({name: torch.Tensor}, any nesting of dicts and
    lists of tensors, such as an optimizer state) that hold a NaN or an inf."""
    import torch

    bad: list[str] = []

    def walk(name: str, v) -> None:
        if isinstance(v, torch.Tensor):
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                bad.append(name)
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(f"{name}.{k}" if name else str(k), x)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{name}[{i}]", x)

    walk("", tensors)
    return sorted(bad)


def describe(names: list[str], limit: int = 6) -> str:
    """`a, b, c ...`: at most `limit` names of a list."""
    return ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")


def nonfinite_step_error(step: int, local: dict, gathered: list, last_good) -> NonFiniteStep:
    """The error of a non-finite step `step` (1-based, the one that was not applied). `gathered`: every rank's
    {"loss_finite": bool, "grad_norm": float, "sample_ids": [[ids of micro-batch i]], "bad_microbatches": [i],
    "feature_breaches": [the contract error of each micro-batch whose feature values were not finite]}."""
    parts = []
    for rank, g in enumerate(gathered):
        bad = g["bad_microbatches"] or list(range(len(g["sample_ids"])))
        ids = [sid for i in bad for sid in g["sample_ids"][i]]
        parts.append(f"rank {rank}: loss {'finite' if g['loss_finite'] else 'non-finite'} in micro-batch(es) "
                     f"{bad}, rows {describe(ids, 8)}")
        parts += [f"rank {rank}: {msg}" for msg in g.get("feature_breaches") or []]
    where = (f"the last good checkpoint is {last_good}: rerun to resume from it with a lower train.lr (resume accepts "
             "no lr change: train into a new --out with --init-from it), or drop the rows above"
             if last_good else "no checkpoint was written before it: lower train.lr (or raise train.warmup_frac) "
             "and rerun, or drop the rows above")
    return NonFiniteStep(f"step {step}: non-finite loss or gradient norm (grad norm {local['grad_norm']}); the "
                         f"optimizer step was not applied and the run stopped: {'; '.join(parts)}; {where}")


class DivergenceMonitor:
    """Warns when a logged loss exceeds `factor` x the median of the last `window` logged losses (at least
    `min_history` of them). Pure bookkeeping: the caller logs the returned message."""

    def __init__(self, window: int = 20, factor: float = 4.0, min_history: int = 5):
        self.window, self.factor, self.min_history = window, factor, min_history
        self.losses: deque[float] = deque(maxlen=window)
        self.warnings: list[dict] = []

    def observe(self, step: int, loss: float) -> str | None:
        """Record `loss` at `step`; the warning text when it is a divergence, else None."""
        msg = None
        if len(self.losses) >= self.min_history:
            med = statistics.median(self.losses)
            if med > 0 and loss > self.factor * med:
                self.warnings.append({"step": step, "loss": loss, "median": med})
                msg = (f"divergence warning: step {step} loss {loss:.4g} is {loss / med:.1f}x the median {med:.4g} "
                       f"of the last {len(self.losses)} logged steps; lower train.lr if it persists")
        self.losses.append(loss)
        return msg


def raise_nonfinite(step: int, m: dict, batch_step, last_good, info, train_dir: Path) -> None:
    """Raise `NonFiniteStep` for step `step` on every rank (collective: each rank's rows are gathered so the
    message names them all); the reason also goes to `<train_dir>/stopped.json` (rank 0; the next run of the
    directory removes it when it starts)."""

    mine = {"loss_finite": m.get("loss_finite", not m["bad_microbatches"]), "grad_norm": float(m["grad_norm"]),
            "sample_ids": [list(mb.sample_ids) for mb in batch_step.microbatches],
            "bad_microbatches": m["bad_microbatches"], "feature_breaches": m.get("feature_breaches") or []}
    gathered = [mine]
    if info.world_size > 1:
        from regen.train.collectives import control_all_gather_object

        gathered = [None] * info.world_size
        control_all_gather_object(gathered, mine)
    err = nonfinite_step_error(step, mine, gathered, last_good)
    if info.is_main:
        from schemas.io import write_json_atomic

        log.error("%s", err)
        write_json_atomic({"reason": "non_finite_step", "step": step, "ranks": gathered,
                           "last_good_checkpoint": str(last_good) if last_good else None, "message": str(err)},
                          train_dir / "stopped.json")
    raise err


def take_train_lease(train_dir: Path, info):
    """Rank 0 takes `<train_dir>/.lease-train.json` (`regen.rundir.Lease`); every rank raises LeaseHeld when another
    trainer holds it. Returns the Lease on rank 0, None elsewhere."""
    from regen.rundir import Lease
    from regen.train.parallel import raise_if_any_rank_failed

    lease, error = None, None
    if info.is_main:
        try:
            lease = Lease(train_dir, "train").acquire()
        except InputError as exc:
            error = exc
    raise_if_any_rank_failed(error)
    return lease
