"""One conversation of a prompt pool row being built: call ids unique within it, every tool result linked to its call.

Used by `regen.select.shapes` for every conversation shape (ShareGPT, OpenAI messages, BFCL, Kimi markers).
Tool results link to calls by the result's own id, else by its own function name, else in order (two results in the
other order than their calls, named, answered the wrong calls before).
"""
from __future__ import annotations

import json

from regen.select import strict_json
from regen.select.errors import RowError


class Conversation:
    """Builds one conversation's messages: call ids unique within it, every tool result linked to its call.

    A *round* is one assistant message's calls. Its results are the tool turns right after it, linked by the
    result's own id where it has one (`tool_call_id`, Kimi `## Return of {id}`), else by its own function name
    (`name` of an OpenAI tool or legacy function message, or of an item of a LLaMA-Factory list), else in order;
    a single result turn holding a JSON list of exactly N results answers N parallel calls (LLaMA-Factory); a
    name that matches no pending call is a RowError. Every call
    of a round needs exactly one result before the conversation goes on (RowError otherwise); calls that end
    the conversation are the answer to regenerate and are dropped with it.
    """

    def __init__(self):
        self.messages: list[dict] = []
        self.used: set[str] = set()
        self.num_calls = 0
        self.round: list[dict] = []
        self.rename: dict[str, str] = {}  # source id -> unique id, this round
        self.answered: set[str] = set()
        self.round_at = ""

    def _unique(self, call: dict) -> dict:
        src = call.get("id")
        new = src if src and src not in self.used else None
        n = self.num_calls
        while new is None or new in self.used:
            new = f"functions.{call['function']['name']}:{n}" if src and src.startswith("functions.") else f"call_{n}"
            n += 1
        self.used.add(new)
        self.num_calls += 1
        if src:
            self.rename.setdefault(src, new)
        return {"id": new, "type": "function", "function": call["function"]}

    def _close_round(self, where: str) -> None:
        missing = [c for c in self.round if c["id"] not in self.answered]
        if missing:
            raise RowError(where, f"{len(missing)} of the {len(self.round)} tool call(s) at {self.round_at} have no "
                                  f"result before this turn (first: {missing[0]['function']['name']!r})")
        self.round, self.rename, self.answered = [], {}, set()

    def add(self, msg: dict, where: str) -> None:
        """A system, user or assistant message without calls."""
        self._close_round(where)
        self.messages.append(msg)

    def add_calls(self, calls: list[dict], where: str, msg: dict | None = None) -> None:
        """Calls of an assistant message `msg`, or (None) of a ShareGPT `function_call` turn: those join the
        assistant message just before them, else start one."""
        last = self.messages[-1] if self.messages else None
        if msg is None and last is not None and last["role"] == "assistant":
            msg = last
        else:
            self._close_round(where)
            msg = msg if msg is not None else {"role": "assistant", "content": None}
            self.messages.append(msg)
        if not msg.get("tool_calls"):
            self.round_at = where
        calls = [self._unique(c) for c in calls]
        msg.setdefault("tool_calls", []).extend(calls)
        self.round.extend(calls)

    def add_results(self, results: list[tuple[str | None, str | None, object]], where: str) -> None:
        """One block of consecutive tool turns: `[(the result's own call id or None, its own function name or None,
        content)]`, linked to the pending calls by id, else by name, else in order (`_link`)."""
        pending = [c for c in self.round if c["id"] not in self.answered]
        if not pending:
            raise RowError(where, "tool result without a preceding tool call")
        if len(results) == 1 and results[0][0] is None and len(pending) > 1:
            parts = results[0][2]
            try:
                parts = strict_json.loads(parts) if isinstance(parts, str) else parts
            except strict_json.DuplicateKey as exc:
                raise RowError(where, f"the tool results list: {exc}") from None
            except json.JSONDecodeError:
                parts = None
            if not isinstance(parts, list) or len(parts) != len(pending):
                raise RowError(where, f"{len(pending)} parallel tool calls at {self.round_at} but one result turn "
                                      f"that is not a JSON list of {len(pending)} results")
            results = [(None, _result_name(p), p) for p in parts]  # LLaMA-Factory: N results in one turn
        if len(results) != len(pending):
            raise RowError(where, f"{len(pending)} tool call(s) at {self.round_at} but {len(results)} tool result(s)")
        for (_, _, value), call in zip(results, self._link(results, pending, where)):
            self.answered.add(call["id"])
            content = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            self.messages.append({"role": "tool", "content": content, "tool_call_id": call["id"],
                                  "name": call["function"]["name"]})

    def _link(self, results, pending: list[dict], where: str) -> list[dict]:
        """The call each result answers: by the result's id; else by its function name (in order among the
        pending calls of that name); else the first call left, in order. A result whose id or name matches no
        pending call, or whose name contradicts the call its id names, raises RowError (a
        result linked by position alone would answer the wrong call)."""
        free = list(pending)
        linked: list[dict | None] = [None] * len(results)
        names = ", ".join(f"{c['function']['name']} ({c['id']})" for c in pending)
        for k, (rid, name, _) in enumerate(results):
            if rid is None:
                continue
            uid = self.rename.get(rid, rid)
            call = next((c for c in free if c["id"] == uid), None)
            if call is None:
                raise RowError(where, f"tool result for {rid!r} matches none of the pending calls "
                                      f"({', '.join(c['id'] for c in free)})")
            if name is not None and name != call["function"]["name"]:
                raise RowError(where, f"tool result for {rid!r} is named {name!r} but that call is "
                                      f"{call['function']['name']!r}")
            linked[k] = call
            free.remove(call)
        for k, (rid, name, _) in enumerate(results):
            if rid is None and name is not None:
                call = next((c for c in free if c["function"]["name"] == name), None)
                if call is None:
                    raise RowError(where, f"tool result named {name!r} matches none of the pending calls "
                                          f"{names} at {self.round_at}")
                linked[k] = call
                free.remove(call)
        for k in range(len(results)):
            if linked[k] is None:
                linked[k] = free.pop(0)
        return linked


def _result_name(part) -> str | None:
    """The function name a result of a LLaMA-Factory list carries (`{"name": ..., ...}`), or None."""
    return part["name"] if isinstance(part, dict) and isinstance(part.get("name"), str) and part["name"] else None
