"""The run summary's producers: one entry per producer ever started or registered, with its final state.

Two sources meet here (`final_producers`):

- the dispatcher's registrations (`Dispatcher.status()["producers"]`, one per `/register`): what it last heard
  from each and whether its silence passed `lease_timeout_s`. A producer re-registers after it was declared
  dead, under a new id, so one process may have several registrations;
- the local producer processes the pool started (`FeaturePool.procs`): their exit status, which the dispatcher
  cannot see. A local producer killed while it still loads the target never registers, so the dispatcher alone
  would not list it at all.

Entries are keyed by (host, pid): a process is one producer whatever its registrations. The local ones come
first in the order the pool started them, then producers started elsewhere in registration order. `state`
(`alive` is true for the first two, false for the others):

- `alive_as_last_observed` (alive): registered and not declared dead; for a local one, its process still runs;
  for one started elsewhere, the dispatcher cannot know more;
- `starting` (alive): a local process still running that never registered (loading the target);
- `finished`: a local process that exited with status 0 (told there was no more work);
- `stopped`: a local process the pool ended itself at the end of the run (it had not exited in time);
- `dead`: a local process that exited with a signal or a non-zero status, whatever the dispatcher had noticed,
  or a producer started elsewhere that the dispatcher declared dead.

Counters (`completed`, `rows`, `failed`, `busy_s`, `cpu_s`) are summed over a producer's registrations;
`registrations` lists their dispatcher ids (empty when it never registered); `observed` says the state in one
sentence with its source and times (UTC wall time, `regen.train.features.dispatcher._iso`).
"""
from __future__ import annotations

from regen.train.features.dispatcher import _iso

COUNTERS = ("completed", "rows", "failed", "busy_s", "cpu_s")


def _how(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"status {code}"


def _merge(regs: list[dict]) -> dict:
    """One producer from its registrations in order: the last one's view, the counters summed."""
    if not regs:
        return {"id": None, "registered": False, "registrations": [], "alive": False, "state": None,
                "last_seen_at": None, "silent_s": None, "observed": None, "leases": 0, "pid": None, "host": None,
                "name": None, "engine": None, **{k: 0 for k in COUNTERS}}
    out = dict(regs[-1])
    for k in COUNTERS:
        total = sum(r.get(k) or 0 for r in regs)
        out[k] = round(total, 3) if k.endswith("_s") else total
    out["registered"], out["registrations"] = True, [r["id"] for r in regs]
    return out


def _local_state(p: dict, proc: dict, host: str, seen: str) -> dict:
    """`p` (merged registrations) corrected by what the pool saw of its own process `proc` (on `host`) at wall
    time `seen`."""
    code, ended = proc.get("returncode"), proc.get("ended_by_pool")
    if not p["registered"]:
        heard = "it never registered with the dispatcher"
    elif p["state"] == "dead":  # the dispatcher noticed too: its own sentence, with when
        heard = f"the dispatcher: {p['observed']}"
    else:
        heard = f"the dispatcher last heard from it at {p['last_seen_at']}"
    out = {**p, "local": True, "name": proc.get("name") or p.get("name"), "pid": proc["pid"],
           "host": p.get("host") or host, "log": proc.get("log")}
    if code is None:
        out["process"] = f"running at {seen}"
        if not p["registered"]:
            out.update(alive=True, state="starting",
                       observed=f"starting: its process is running at {seen} but never registered with the "
                                "dispatcher (still loading the target)")
        return out
    out["process"] = f"exited with {_how(code)}, seen at {seen}"
    if ended:
        out.update(alive=False, state="stopped",
                   observed=f"stopped: the pool ended it at the end of the run ({ended}; it had not exited after "
                            f"the dispatcher said there was no more work), exit {_how(code)} seen at {seen}; {heard}")
    elif code == 0:
        out.update(alive=False, state="finished",
                   observed=f"finished: its process exited with status 0 (seen by the pool at {seen}; {heard})")
    else:
        out.update(alive=False, state="dead",
                   observed=f"dead: its process exited with {_how(code)} (seen by the pool at {seen}; {heard})")
    return out


def final_producers(registrations: list[dict], local: list[dict], *, host: str, now: float) -> list[dict]:
    """Every producer of the run, once, with its final state (see the module docstring).

    `registrations`: the dispatcher's `status()["producers"]` entries in registration order (each with `id`,
    `pid`, `host`, `alive`, `state`, `last_seen_at`, `observed` and the counters); `local`: one dict per process
    the pool started, in start order: `name`, `pid`, `log`, `returncode` (`Popen.poll()`: None while running,
    negative for a signal) and `ended_by_pool` (None, or how the pool ended it: "SIGTERM" / "SIGKILL"); `host`:
    this machine's host name (local processes registered under it); `now`: wall time (s since the epoch) of the
    observation. Returns a list of dicts, local producers first.
    """
    seen = _iso(now)
    groups: dict[tuple, list[dict]] = {}
    for r in registrations:
        key = (r.get("host"), r.get("pid")) if r.get("host") is not None and r.get("pid") is not None \
            else ("id", r["id"])
        groups.setdefault(key, []).append(r)
    out = []
    for proc in local:
        out.append(_local_state(_merge(groups.pop((host, proc["pid"]), [])), proc, host, seen))
    for regs in groups.values():
        out.append({**_merge(regs), "local": False})
    return out
