"""`regen show-render`: render one conversation from stdin with the profile's renderer and print what a training
row would hold.

stdin: `{"messages": [...], "tools": [...], "kwargs": {...}}` (`kwargs`: the target template's keyword
arguments, for Kimi-K3 `thinking`, `thinking_effort`, `add_generation_prompt`, `tool_choice`, `response_format`;
they override the profile's `render.template_kwargs`).
stdout: JSON `{"text", "ids", "loss_mask"}` (`ids`: int token ids, `loss_mask`: 0/1 per id, every assistant
turn supervised); `--pretty`: the text with supervised spans between ⟦ ⟧ (green on a terminal) and a summary;
`--tokens`: one line per token (position, id, mask, text).

Input policy: stdin must be UTF-8 JSON whose strings hold characters only. Invalid UTF-8,
a lone surrogate (`"\ud800"`), a C0 control character other than tab, LF and CR, or DEL (NUL included, raw or
escaped; the select filter's rule, `filters.prompt.CONTROL_CHARS`), or nesting deeper than MAX_DEPTH levels is
an InputError naming the place (line/column, or the JSON path such as `messages[0].content`): exit 2 with a
message, never a traceback and never replacement characters.

With Kimi-K3, a conversation the reference renders but a training row must not contain (roles out of order, a tool
result without a matching call, ...) is rendered as the reference does, and each problem is reported on stderr
(`regen.render.kimi_k3.messages.row_problems`; the render stage rejects such rows with the reason).

Kimi-K3 without a real tokenizer (`--tokenizer DIR` or `render.tokenizer`) uses the project's TEST vocabulary
and says so on stderr: control ids are Kimi's, text ids are not.
"""
from __future__ import annotations

import json
import sys

from filters.prompt import CONTROL_CHARS
from regen.errors import InputError

TEST_VOCAB_NOTE = ("regen show-render: using the project's TEST vocabulary (data/tokenizers/kimi-k3-test): control "
                   "ids are Kimi-K3's, text ids are NOT; pass --tokenizer DIR (a Kimi-K3 checkpoint directory) for real ids")


def add_arguments(parser) -> None:
    from regen.config import add_profile_arguments

    add_profile_arguments(parser, run_required=False)
    parser.add_argument("--tokenizer", help="tokenizer directory (overrides render.tokenizer)")
    parser.add_argument("--pretty", action="store_true", help="show the text with supervised spans marked ⟦ ⟧")
    parser.add_argument("--tokens", action="store_true", help="show one line per token: position, id, mask, text")


MAX_DEPTH = 100  # JSON nesting levels; deeper input is refused before any recursive code sees it


def _decode_stdin(stream) -> str:
    """stdin as text: bytes decoded as strict UTF-8 (a BOM dropped). Raises InputError naming the bad byte."""
    raw = stream.buffer.read() if hasattr(stream, "buffer") else stream.read()
    if isinstance(raw, str):
        return raw
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise InputError(f"stdin is not valid UTF-8: byte 0x{raw[exc.start]:02x} at line {line}, column {col} (byte "
                         f"offset {exc.start}); re-encode the input as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)") from None


def _bad_char(text: str) -> str | None:
    """A description of the first character that is not allowed in a string, or None."""
    for i, ch in enumerate(text):
        o = ord(ch)
        if 0xD800 <= o <= 0xDFFF:
            return f"a lone surrogate \\u{o:04x} at char {i} (not a character; fix the escape or the encoding)"
        if CONTROL_CHARS.match(ch):  # the one control-character policy, shared with the select filter
            return (f"the control character U+{o:04X} at char {i} (of C0 only tab, LF and CR are allowed, and no DEL; "
                    "remove it or escape it as text)")
    return None


def check_payload(payload) -> None:
    """Refuse lone surrogates, C0 controls (but tab/LF/CR) and DEL in any string or key, and nesting deeper than MAX_DEPTH.
    Iterative, so hostile depth cannot overflow the stack. Raises InputError naming the JSON path."""
    stack = [(payload, "stdin", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise InputError(f"stdin JSON is nested deeper than {MAX_DEPTH} levels (at {path}); flatten the input")
        if isinstance(value, str):
            bad = _bad_char(value)
            if bad:
                raise InputError(f"stdin JSON {path} holds {bad}")
        elif isinstance(value, dict):
            for k, v in value.items():
                bad = _bad_char(k)
                if bad:
                    raise InputError(f"stdin JSON key {k!r} in {path} holds {bad}")
                stack.append((v, f"{path}.{k}" if path != "stdin" else k, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))


def read_request(stream) -> tuple[list, list | None, dict]:
    """Parse the stdin JSON -> (messages, tools, kwargs). Raises InputError naming the field and the fix (see the
    module's input policy)."""
    text = _decode_stdin(stream)
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"stdin is not JSON ({exc}); give {{\"messages\": [...], \"tools\": [...], \"kwargs\": {{}}}}") from None
    except RecursionError:
        raise InputError(f"stdin JSON is nested too deeply to parse (more than {MAX_DEPTH} levels are refused); "
                         "flatten the input") from None
    check_payload(payload)
    if not isinstance(payload, dict) or not isinstance(payload.get("messages"), list):
        raise InputError('stdin JSON needs a "messages" list, e.g. {"messages": [{"role": "user", "content": "Hi"}]}')
    tools, kwargs = payload.get("tools"), payload.get("kwargs") or {}
    if tools is not None and not isinstance(tools, list):
        raise InputError('stdin "tools" must be a list of OpenAI tool objects or null')
    if not isinstance(kwargs, dict):
        raise InputError('stdin "kwargs" must be an object of template keyword arguments')
    return payload["messages"], tools, kwargs


def kimi_tokenizer_dir(cfg_tokenizer: str | None, flag: str | None) -> str | None:
    """The Kimi-K3 tokenizer directory to load, or None for the test vocabulary. An explicit `--tokenizer` must
    exist (InputError otherwise); a profile value that is unset (`${VAR}` not in the environment) or missing
    falls back to the test vocabulary."""
    from regen.config import resolve_path

    if flag:
        path = resolve_path(flag)
        if not path.is_dir():
            raise InputError(f"--tokenizer {flag}: not a directory; give a Kimi-K3 checkpoint directory with "
                             "tiktoken.model and tokenizer_config.json")
        return str(path)
    path = resolve_path(cfg_tokenizer) if cfg_tokenizer else None
    if path is None or "${" in str(path) or not path.is_dir():
        return None
    return str(path)


def make_show_renderer(cfg, tokenizer_flag: str | None):
    """The renderer for `cfg` (a RenderConfig); prints the test-vocabulary note on stderr when it applies."""
    if cfg.renderer == "kimi-k3":
        from regen.render.kimi_k3.renderer import DEFAULT_MASK_POLICY, MASK_POLICIES, KimiK3Renderer

        directory = kimi_tokenizer_dir(cfg.tokenizer, tokenizer_flag)
        if directory is None:
            print(TEST_VOCAB_NOTE, file=sys.stderr)
        policy = cfg.mask_policy if cfg.mask_policy in MASK_POLICIES else DEFAULT_MASK_POLICY
        return KimiK3Renderer(directory, mask_policy=policy, template_defaults=dict(cfg.template_kwargs))
    if tokenizer_flag:
        cfg = cfg.model_copy(update={"tokenizer": tokenizer_flag})
    from regen.render.stage import make_renderer

    return make_renderer(cfg)


def token_texts(renderer, ids: list[int]) -> list[str]:
    """Per-token text (bytes of a split UTF-8 character show as U+FFFD)."""
    tok = getattr(renderer, "tokenizer", None)
    if hasattr(tok, "decode_bytes"):
        return [tok.decode_bytes([i]).decode("utf-8", errors="replace") for i in ids]
    return [renderer.decode([i]) for i in ids]


def pretty(renderer, ids: list[int], mask: list[int]) -> "object":
    """A rich Text of the rendering: supervised runs between ⟦ ⟧ in bold green, the rest plain."""
    from rich.text import Text

    out = Text()
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            chunk = _decode_run(renderer, ids[start:i])
            if mask[start]:
                out.append("⟦", style="bold magenta")
                out.append(chunk, style="bold green")
                out.append("⟧", style="bold magenta")
            else:
                out.append(chunk)
            start = i
    return out


def _decode_run(renderer, ids: list[int]) -> str:
    tok = getattr(renderer, "tokenizer", None)
    if hasattr(tok, "decode_bytes"):
        return tok.decode_bytes(ids).decode("utf-8", errors="replace")
    return renderer.decode(ids)


def main(args) -> int:
    from regen.config import load_profile

    profile = load_profile(args.profile, args.overrides)
    messages, tools, kwargs = read_request(sys.stdin)
    renderer = make_show_renderer(profile.render, args.tokenizer)
    try:
        rendered = renderer.render(messages, tools, **kwargs)
    except InputError:
        raise
    except ValueError as exc:  # RenderError and template errors: a bad conversation, not a crash
        reason = getattr(exc, "reason", type(exc).__name__)
        raise InputError(f"stdin conversation cannot be rendered ({reason}): {exc}") from None
    if renderer.name == "kimi-k3":
        from regen.render.kimi_k3.messages import row_problems

        for problem in row_problems(messages):
            print(f"regen show-render: note: rendered as the reference does, but the render stage rejects such a row "
                  f"({problem.reason}): {problem}", file=sys.stderr)
    mask = rendered.loss_mask()
    if args.tokens:
        for pos, (i, m, t) in enumerate(zip(rendered.input_ids, mask, token_texts(renderer, rendered.input_ids))):
            print(f"{pos:6d} {i:7d} {m} {json.dumps(t, ensure_ascii=False)}")
    if args.pretty:
        from rich.console import Console

        console = Console(highlight=False, soft_wrap=True)
        console.print(pretty(renderer, rendered.input_ids, mask))
        console.print(f"[dim]{len(rendered.input_ids)} tokens, {sum(mask)} supervised in "
                      f"{len(rendered.assistant_spans)} span(s) {list(rendered.assistant_spans)}; renderer "
                      f"{renderer.name} v{renderer.version}, mask policy {getattr(renderer, 'mask_policy', '?')}, "
                      f"tokenizer {renderer.tokenizer_name}[/dim]")
    if not (args.pretty or args.tokens):
        print(json.dumps({"text": rendered.text, "ids": rendered.input_ids, "loss_mask": mask}, ensure_ascii=False))
    return 0
