"""One generation row -> one training sample (or a reject with its filter and reason). Used by `regen.render.stage`.

Per row: rebuild the conversation (`messages` + the generated assistant message), check it (roles in order,
tool results matched to calls, arguments that are JSON objects, known content parts, reasoning present when
required), render it with the target's renderer as the sample of its last turn (`render(..., last_only=True)`:
the generation prompt of `messages[:-1]` tokenized alone, then the generated answer tokenized alone), take that span
(loss on the generated turn only), then:

- server ids win (they are what the target emitted): with `completion_token_ids`, the span's tokens are replaced by them
  verbatim, minus a trailing end token the mask does not supervise (e.g. `<|end_of_msg|>`, EOS), plus the
  policy's closing markers when the server trimmed its stop sequence (Kimi-K3 `<|close|>message<|sep|>`, spec
  §5; HF: the end-of-turn token). `prompt_token_ids` are compared with the rendered prompt ids; a mismatch is
  counted by cause (server_bos, renderer_bos, tokenization = same text other ids, template = other text) and
  the row is dropped or kept with the server's prompt ids (`on_drift`).
- a truncated row (finish_reason "length") kept by a profile without the `truncated` filter keeps its closing
  markers in `input_ids` (the row stays well formed) but not under the mask: the target never emitted them.
- limits: rows over `max_tokens` are dropped or cut after the last assistant turn that fits (`overlong`); rows
  with a zero mask or fewer than `min_loss_tokens` supervised tokens are rejected.

sample_id = sha256 over the contract hash, prompt_id, input_ids (int32 little-endian) and the loss spans.
"""
from __future__ import annotations

import hashlib
import json
from array import array
from collections import Counter

from regen.render.guards import TextGuard
from schemas.messages import ROLES, message_from_arrow

assert array("i").itemsize == 4, "array('i') must be int32 for shard ids"
KIMI_TEMPLATE_KWARGS = ("thinking", "thinking_effort", "tool_choice", "response_format")


# The `filter` of every reject this module raises (the response filters, `filters.response.RESPONSE_FILTERS`, write
# the others of `rejected/render/`); each has its remedy on docs/errors.md (tests/docs/test_docs.py checks it).
REJECT_FILTERS = (
    "parse",            # a conversation unfit for a training row; the reason starts with one of MESSAGE_CODES
    "render",           # the renderer raised; the reason starts with its code (RENDER_REASONS or the error's type)
    "drift",            # rendered prompt ids differ from the server's prompt_token_ids (render.on_drift: drop)
    "over_long",        # more than render.max_tokens after rendering (and, with overlong: cut, no turn fits)
    "zero_mask",        # no supervised token in the row
    "min_loss_tokens",  # fewer supervised tokens than render.min_loss_tokens
    "text_after_end",   # text or an end-of-turn id past the end of the turn (regen.render.guards)
    "control_tokens",   # a control-token string in message text that the tokenizer would parse (guards)
)
# The code at the start of a `parse` reject's reason (`check_messages`)
MESSAGE_CODES = ("unknown_role", "unknown_content_part", "role_order", "tool_result_without_call", "bad_arguments",
                 "no_reasoning", "bad_message")


class Reject(Exception):
    """A row that is not written: `filter` (one of REJECT_FILTERS) names the check, `reason` says why (for
    rejected/render)."""

    def __init__(self, filter: str, reason: str, score: float | None = None):
        assert filter in REJECT_FILTERS, f"Reject filter {filter!r} is not in REJECT_FILTERS"
        super().__init__(f"{filter}: {reason}")
        self.filter, self.reason, self.score = filter, reason, score


def generated_message(row: dict) -> dict:
    """The assistant message the target generated for this row (content "" when null)."""
    msg = {"role": "assistant", "content": row.get("content") or ""}
    if row.get("reasoning_content") is not None:
        msg["reasoning_content"] = row["reasoning_content"]
    if row.get("tool_calls"):
        msg["tool_calls"] = [{"id": c.get("id"), "type": c.get("type") or "function",
                              "function": dict(c.get("function") or {})} for c in row["tool_calls"]]
    return msg


def conversation_of(row: dict) -> tuple[list[dict], list[dict] | None]:
    """(messages including the generated turn, tools) of a generation row. Raises Reject on unreadable tools."""
    messages = [message_from_arrow(m) for m in row.get("messages") or []]
    tools = None
    if row.get("tools"):
        try:
            tools = json.loads(row["tools"])
        except json.JSONDecodeError as exc:
            raise Reject("parse", f"tools is not JSON: {exc.msg} at char {exc.pos}") from None
        if tools is not None and not isinstance(tools, list):
            raise Reject("parse", f"tools is JSON {type(tools).__name__}, not a list")
    return messages + [generated_message(row)], tools or None


def template_kwargs_of(row: dict, defaults: dict, allowed: tuple[str, ...]) -> dict:
    """Template kwargs: profile defaults, then what the request carried (`chat_template_kwargs`, and for
    Kimi-K3 top-level `thinking`/`thinking_effort`/`tool_choice`/`response_format`, as in the request body)."""
    kwargs = dict(defaults)
    if not row.get("request_params"):
        return kwargs
    try:
        params = json.loads(row["request_params"])
    except json.JSONDecodeError:
        raise Reject("parse", "request_params is not JSON") from None
    flat = {**params, **(params.get("extra_body") or {})} if isinstance(params, dict) else {}
    if isinstance(flat.get("chat_template_kwargs"), dict):
        kwargs.update(flat["chat_template_kwargs"])
    kwargs.update({k: flat[k] for k in allowed if k in flat})
    return kwargs


def check_messages(messages: list[dict], *, part_types: list[str], require_reasoning: bool) -> None:
    """Raise Reject("parse", "<code>: messages[i]: ...") for a conversation that must not become a row.

    Codes: unknown_role, unknown_content_part, role_order, tool_result_without_call, bad_arguments, no_reasoning,
    bad_message. The last message is the generated assistant turn."""

    def bad(code: str, i: int, text: str):
        assert code in MESSAGE_CODES, code
        raise Reject("parse", f"{code}: messages[{i}]: {text}")

    open_calls: list[str | None] | None = None  # call ids of the last assistant's tool_calls awaiting results
    results = 0
    seen_non_system = False
    prev = None
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ROLES:
            bad("unknown_role", i, f"role {role!r} is not one of {list(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind not in part_types:
                    bad("unknown_content_part", i, f"content[{j}] has type {kind!r}; allowed: {part_types}")
        elif content is not None and not isinstance(content, str):
            bad("bad_message", i, f"content is a {type(content).__name__}")
        rc = m.get("reasoning_content")
        if rc is not None and not isinstance(rc, str):
            bad("bad_message", i, f"reasoning_content is a {type(rc).__name__}")
        if role == "system":
            if seen_non_system and prev == "assistant" and open_calls:
                bad("role_order", i, "system message between tool_calls and their results")
        elif role == "user":
            if open_calls and results == 0:
                bad("role_order", i, "user message right after tool_calls that have no tool results")
            seen_non_system, open_calls = True, None
        elif role == "assistant":
            if not seen_non_system or prev == "assistant":
                bad("role_order", i, "assistant message " + ("before any user message" if not seen_non_system
                                                             else "right after another assistant message"))
            if open_calls and results == 0:
                bad("role_order", i, "assistant message after tool_calls that have no tool results")
            calls = m.get("tool_calls") or []
            for j, call in enumerate(calls):
                fn = call.get("function") or {}
                if not fn.get("name"):
                    bad("bad_arguments", i, f"tool_calls[{j}] has no function name")
                args = fn.get("arguments")
                if isinstance(args, str) and args.strip():
                    try:
                        value = json.loads(args)
                    except json.JSONDecodeError as exc:
                        bad("bad_arguments", i, f"tool_calls[{j}] ({fn['name']}) arguments are not JSON: {exc.msg}")
                    if not isinstance(value, dict):
                        bad("bad_arguments", i, f"tool_calls[{j}] ({fn['name']}) arguments are JSON "
                                                f"{type(value).__name__}, not an object")
                elif args is not None and not isinstance(args, (str, dict)):
                    bad("bad_arguments", i, f"tool_calls[{j}] arguments are a {type(args).__name__}")
            open_calls = [c.get("id") for c in calls] or None
            results = 0
            seen_non_system = True
        elif role == "tool":
            if not open_calls:
                bad("tool_result_without_call", i, "tool result with no tool_calls in the last assistant message")
            cid = m.get("tool_call_id")
            if cid is not None and any(open_calls) and cid not in open_calls:
                bad("tool_result_without_call", i, f"tool_call_id {cid!r} matches none of the last assistant's "
                                                   f"calls {open_calls}")
            results += 1
            if results > len(open_calls):
                bad("tool_result_without_call", i, f"tool result #{results} for {len(open_calls)} tool_calls")
        prev = role
    last = messages[-1]
    if prev_role_before_last(messages) not in ("user", "tool"):
        bad("role_order", len(messages) - 1, "the generated turn does not follow a user or tool message")
    if require_reasoning and last.get("reasoning_content") is None:
        bad("no_reasoning", len(messages) - 1, "reasoning_content is None for the generated turn (thinking on: "
                                              "the server's reasoning was lost; check its reasoning parser)")


def prev_role_before_last(messages: list[dict]) -> str | None:
    for m in reversed(messages[:-1]):
        if m.get("role") != "system":
            return m.get("role")
    return None


def drift_cause(ours: list[int], server: list[int], decode) -> str:
    """Why rendered prompt ids differ from the server's: server_bos, renderer_bos, tokenization, template."""
    if len(server) == len(ours) + 1 and server[1:] == ours:
        return "server_bos"
    if len(ours) == len(server) + 1 and ours[1:] == server:
        return "renderer_bos"
    return "tokenization" if decode(ours) == decode(server) else "template"


def first_difference(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def with_closing(completion: list[int], closing: list[int]) -> tuple[list[int], int]:
    """`completion` ending with `closing`: the missing tail of `closing` is appended (a trimmed stop sequence).
    Returns (ids, number of ids appended)."""
    n = len(closing)
    if n == 0 or completion[-n:] == closing:
        return completion, 0
    for j in range(n - 1, 0, -1):  # completion ends with a partial closing[:j]
        if completion[-j:] == closing[:j]:
            return completion + closing[j:], n - j
    return completion + closing, n


class RowRenderer:
    """Renders generation rows into shard rows with one renderer and one render config (see module doc).

    Counters: `counts` (cut, completion_differs, closing_appended, server_ids), `drift` (rows_checked, causes)."""

    render_options = {"last_only": True}  # the sample of the last turn (see module doc)

    def __init__(self, renderer, cfg, contract_hash: str):
        self.renderer, self.cfg, self.contract_hash = renderer, cfg, contract_hash
        self.allowed_kwargs = KIMI_TEMPLATE_KWARGS if renderer.name == "kimi-k3" else ()
        # rows supervise the last turn only: an HF template need only be prefix-stable up to it
        self.closing, self.strip = self._closing_and_strip()
        self.guard = TextGuard(renderer, self.closing, self.strip | self._enders,
                               getattr(cfg, "control_tokens", "reject"))
        self.counts: Counter = Counter()
        self.drift = {"rows_checked": 0, "rows_drifted": 0, "causes": Counter()}

    def snapshot(self) -> dict:
        """A copy of the counters: {"row_counts": {...}, "drift": {rows_checked, rows_drifted, causes}}."""
        return {"row_counts": dict(self.counts),
                "drift": {"rows_checked": self.drift["rows_checked"], "rows_drifted": self.drift["rows_drifted"],
                          "causes": dict(self.drift["causes"])}}

    def _closing_and_strip(self) -> tuple[list[int], set[int]]:
        """The closing markers at the end of every generated span, and end tokens a server may append that the
        mask does not supervise. Found from a probe rendering, so they follow the renderer's mask policy."""
        r = self.renderer
        probe = r.render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                         **({"thinking": False} if r.name == "kimi-k3" else {}))
        s, e = probe.assistant_spans[-1]
        span = probe.input_ids[s:e]
        if r.name == "kimi-k3":
            tok = r.tokenizer
            close = tok.control_id("<|close|>")
            j = max(i for i, t in enumerate(span) if t == close)
            enders = {tok.control_id("<|end_of_msg|>"), tok.control_id("[EOS]")}
        else:
            tk = r.tokenizer
            special = set(tk.all_special_ids) | {i for i, t in getattr(tk, "added_tokens_decoder", {}).items()
                                                 if getattr(t, "special", False)}
            found = [i for i, t in enumerate(span) if t in special]
            j = found[-1] if found else len(span)
            enders = {tk.eos_token_id} if tk.eos_token_id is not None else set()
        closing = span[j:]
        self._enders = set(enders)
        return closing, enders - set(closing)

    def sample(self, row: dict) -> dict:
        """One shard row (SHARD_SCHEMA dict; input_ids as array("i"), int32) for a generation row. Raises Reject."""
        cfg = self.cfg
        messages, tools = conversation_of(row)
        self._guard(row, messages, tools)
        kwargs = template_kwargs_of(row, cfg.template_kwargs, self.allowed_kwargs)
        # a row generated with thinking off (a generation mode, `thinking: false`) has no reasoning to lose
        check_messages(messages, part_types=cfg.content_part_types,
                       require_reasoning=cfg.require_reasoning and kwargs.get("thinking") is not False)
        kwargs["add_generation_prompt"] = False
        rendered = self._render(messages, tools, kwargs)
        ids = rendered.input_ids
        s, e = rendered.assistant_spans[-1]
        turn = row.get("turn") if row.get("turn") is not None else sum(m["role"] == "assistant" for m in messages) - 1
        if cfg.use_server_ids and row.get("completion_token_ids") is not None:
            ids, s, e = self._server_ids(row, list(ids), s, e)
        if row.get("finish_reason") == "length" and self.closing and ids[e - len(self.closing):e] == self.closing:
            e -= len(self.closing)  # kept truncated row: the target never emitted its closing markers
            self.counts["truncated_closing_unsupervised"] += 1
        if len(ids) > cfg.max_tokens:
            if cfg.overlong == "drop":
                raise Reject("over_long", f"{len(ids)} tokens after rendering (max {cfg.max_tokens})", len(ids))
            ids, s, e, turn = self._cut(messages, tools, kwargs, len(ids))
        num_loss = e - s
        if num_loss <= 0:
            raise Reject("zero_mask", "no supervised token in the row", 0)
        if num_loss < cfg.min_loss_tokens:
            raise Reject("min_loss_tokens", f"{num_loss} supervised tokens (min {cfg.min_loss_tokens})", num_loss)
        spans = [{"start": s, "end": e}]
        h = hashlib.sha256(f"{self.contract_hash}|{row.get('prompt_id')}|{s}|{e}|".encode())
        buf = array("i", ids)  # int32 (checked at import): hashed, then handed to the shard writer as is
        h.update(buf)
        return {"sample_id": h.hexdigest(), "prompt_id": row.get("prompt_id"), "turn": turn,
                "category": row.get("category"), "language": row.get("language"), "input_ids": buf,
                "loss_spans": spans, "num_tokens": len(ids), "num_loss_tokens": num_loss}

    def _guard(self, row: dict, messages: list[dict], tools) -> None:
        """`regen.render.guards`: text past the end of the turn, control-token strings (the answer's one echoed end
        marker is stripped from `messages[-1]` and counted). Raises Reject."""
        found, stripped = self.guard.answer(messages[-1])
        self.counts["end_marker_stripped"] += stripped
        found = found or self.guard.prompt(messages[:-1], tools)
        if found is None and self.cfg.use_server_ids and row.get("completion_token_ids") is not None:
            found = self.guard.completion_ids(list(row["completion_token_ids"]))
        if found:
            raise Reject(*found)

    def _render(self, messages, tools, kwargs):
        try:
            return self.renderer.render(messages, tools, **self.render_options, **kwargs)
        except ValueError as exc:  # RenderError, InputError, TemplateNotPrefixStable are ValueErrors
            code = getattr(exc, "reason", None) or type(exc).__name__
            raise Reject("render", f"{code}: {exc}") from None

    def _server_ids(self, row, ids, s, e):
        comp = list(row["completion_token_ids"])
        while comp and comp[-1] in self.strip:
            comp.pop()
        comp, appended = with_closing(comp, self.closing)
        self.counts["server_ids"] += 1
        self.counts["closing_appended"] += bool(appended)
        if comp != ids[s:e]:
            self.counts["completion_differs"] += 1
        prompt = ids[:s]
        server_prompt = row.get("prompt_token_ids")
        if server_prompt is not None:
            server_prompt = list(server_prompt)
            self.drift["rows_checked"] += 1
            if server_prompt != prompt:
                cause = drift_cause(prompt, server_prompt, self.renderer.decode)
                self.drift["rows_drifted"] += 1
                self.drift["causes"][cause] += 1
                if self.cfg.on_drift == "drop":
                    i = first_difference(prompt, server_prompt)
                    raise Reject("drift", f"{cause}: rendered prompt ids differ from the server's prompt_token_ids "
                                          f"at position {i} ({len(prompt)} vs {len(server_prompt)} ids)")
                prompt = server_prompt
        return prompt + comp + ids[e:], len(prompt), len(prompt) + len(comp)

    def _cut(self, messages, tools, kwargs, num_tokens):
        """Longest prefix ending after an earlier assistant turn within max_tokens (loss on that turn)."""
        for k in range(len(messages) - 2, 0, -1):
            if messages[k]["role"] != "assistant":
                continue
            r = self._render(messages[:k + 1], tools, kwargs)
            if len(r.input_ids) <= self.cfg.max_tokens:
                self.counts["cut"] += 1
                s, e = r.assistant_spans[-1]
                return list(r.input_ids), s, e, sum(m["role"] == "assistant" for m in messages[:k])
        raise Reject("over_long", f"{num_tokens} tokens after rendering (max {self.cfg.max_tokens}) and no earlier "
                                  f"assistant turn fits", num_tokens)
