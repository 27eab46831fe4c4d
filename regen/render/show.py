"""`regen show-render`: render one conversation from stdin with the profile's renderer and print what a training
row would hold.

stdin: `{"messages": [...], "tools": [...], "kwargs": {...}}` (`kwargs`: the target template's keyword
arguments, for Kimi-K3 `thinking`, `thinking_effort`, `add_generation_prompt`, `tool_choice`, `response_format`;
they override the profile's `render.template_kwargs`).
stdout: JSON `{"text", "ids", "loss_mask"}` (`ids`: int token ids, `loss_mask`: 0/1 per id, every assistant
turn supervised); `--pretty`: the text with supervised spans between ⟦ ⟧ (green on a terminal) and a summary;
`--tokens`: one line per token (position, id, mask, text).

Kimi-K3 without a real tokenizer (`--tokenizer DIR` or `render.tokenizer`) uses the project's TEST vocabulary
and says so on stderr: control ids are Kimi's, text ids are not.
"""
from __future__ import annotations

import json
import sys

from regen.errors import InputError

TEST_VOCAB_NOTE = ("regen show-render: using the project's TEST vocabulary (data/tokenizers/kimi-k3-test): control "
                   "ids are Kimi-K3's, text ids are NOT; pass --tokenizer DIR (a Kimi-K3 checkpoint directory) for real ids")


def add_arguments(parser) -> None:
    from regen.config import add_profile_arguments

    add_profile_arguments(parser, run_required=False)
    parser.add_argument("--tokenizer", help="tokenizer directory (overrides render.tokenizer)")
    parser.add_argument("--pretty", action="store_true", help="show the text with supervised spans marked ⟦ ⟧")
    parser.add_argument("--tokens", action="store_true", help="show one line per token: position, id, mask, text")


def read_request(stream) -> tuple[list, list | None, dict]:
    """Parse the stdin JSON -> (messages, tools, kwargs). Raises InputError naming the field and the fix."""
    try:
        payload = json.load(stream)
    except json.JSONDecodeError as exc:
        raise InputError(f"stdin is not JSON ({exc}); give {{\"messages\": [...], \"tools\": [...], \"kwargs\": {{}}}}") from None
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
