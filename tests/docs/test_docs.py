"""The documentation stays true: README.md and docs/*.md against the code they describe.

- every command line that runs the CLI parses with the CLI's own argument parser (nothing is run);
- every `section.key` profile key they name exists in the typed configs (`regen.config.Profile`);
- every relative link resolves, anchor included, and none leaves the repository (`../shared` is not in a clone);
- every error class, status, stop reason, flag, reject filter and reason code the code can write, and every
  exception class it defines, has a row on docs/errors.md;
- docs/configuration.md is what `regen config --markdown` writes today; README.md stays within 4,500 characters (about 600 words).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import shlex
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
README_LIMIT = 4_500

FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
SHELL = ("bash", "sh", "shell", "console")
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---------------------------------------------------------------------------------------------------------------
# command lines


def code_blocks(text: str) -> list[str]:
    """The shell code blocks (```bash, ```sh, ...) of a page; command lines belong in those."""
    return [body for lang, body in FENCE.findall(text) if lang.strip() in SHELL]


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return FENCE.sub("", text)


def shell_lines(block: str) -> list[str]:
    """A code block's logical lines: `\\` continuations joined, comments kept for shlex to drop."""
    out, cur = [], ""
    for line in block.splitlines():
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    if cur:
        out.append(cur)
    return [line for line in out if line.strip()]


def unplaceholder(line: str) -> str:
    """`<name>` -> `NAME`; optional parts `[--flag VALUE]` keep their contents (brackets at word edges only, so
    JSON such as '["timeout"]' stays as written)."""
    line = re.sub(r"<([A-Za-z][\w -]*)>", lambda m: m.group(1).replace(" ", "_").upper(), line)
    line = re.sub(r"(^|(?<=\s))\[+(?=-)", "", line)
    return re.sub(r"(?<=\S)\]+(?=\s|$)", "", line)


def segments(line: str) -> list[list[str]]:
    """Shell words of each simple command of `line` (split at `&&`, `||`, `;`, `|`, `&`), comments dropped,
    leading `VAR=value` assignments dropped."""
    lexer = shlex.shlex(unplaceholder(line), posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words, out = list(lexer), [[]]
    redirect = False
    for w in words:
        if redirect:  # the file of a redirection
            redirect = False
        elif w in ("&&", "||", ";", "|", "&"):
            out.append([])
        elif w in (">", ">>", "<", ">&"):
            redirect = True
            if out[-1] and out[-1][-1].isdigit():  # 2> file
                out[-1].pop()
        else:
            out[-1].append(w)
    cmds = []
    for cmd in out:
        while cmd and re.fullmatch(r"[A-Za-z_]\w*=.*", cmd[0]):
            cmd = cmd[1:]
        if cmd:
            cmds.append(cmd)
    return cmds


def _train_parser():
    from regen.train.loop import script_parser

    return script_parser()


def _prepare_model_parser():
    from regen.target.prepare_model import build_parser

    return build_parser()


def _no_arguments(prog: str):
    return lambda: argparse.ArgumentParser(prog=prog)


# `python -m MODULE` entries the docs may name -> their own parser (regen.cli's subcommands are resolved below)
MODULE_PARSERS = {
    "regen.train": _train_parser,
    "regen.target.prepare_model": _prepare_model_parser,
    "regen.train.model": _no_arguments("python -m regen.train.model"),
}


def cli_invocation(cmd: list[str]) -> tuple[str, list[str]] | None:
    """(what, argv) when the words run the CLI: `regen ...`, `.venv/bin/regen ...`, `python -m regen... ...`,
    `torchrun ... -m regen.train -- ...`; None for any other command."""
    head = Path(cmd[0]).name
    if head == "regen":
        return "regen", cmd[1:]
    if re.fullmatch(r"python3?(\.\d+)?", head):
        args = [a for a in cmd[1:] if a not in ("-P", "-u", "-B")]
        if len(args) >= 2 and args[0] == "-m" and args[1].split(".")[0] == "regen":
            return args[1], args[2:]
        return None
    if head == "torchrun":
        return "torchrun", cmd[1:]
    return None


PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*(?:[=:][A-Z][A-Z0-9_]*)?")  # N, DIR, NAME=DIR, HOST:PORT, from <name>


def strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser` and its subparsers without prefix abbreviations: a page must spell every option in full."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                strict(sub)
    return parser


def fill_placeholders(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """A placeholder (`N`, `P`, `<name>`) given to a typed option stands for a valid value of that type."""
    actions = {o: a for a in parser._actions for o in a.option_strings}
    for sub in (a for a in parser._actions if isinstance(a, argparse._SubParsersAction)):
        for sp in sub.choices.values():
            actions.update({o: a for a in sp._actions for o in a.option_strings})
    out = list(argv)
    for i in range(1, len(out)):
        action = actions.get(out[i - 1])
        if action is None or not PLACEHOLDER.fullmatch(out[i]):
            continue
        if action.choices:
            out[i] = str(next(iter(action.choices)))
        elif action.type in (int, float):
            out[i] = "1"
    return out


def parse_error(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """argparse's error message for `argv` (placeholders filled in), or None when it parses."""
    parser = strict(parser)
    argv = fill_placeholders(parser, argv)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as exc:
        return err.getvalue().strip().splitlines()[-1] if exc.code else None
    return None


def check_invocation(what: str, argv: list[str]) -> str | None:
    """None when the invocation parses with its own parser, else why not."""
    from regen.cli import COMMANDS, command_parser

    if what in ("regen", "regen.cli"):
        if not argv or argv[0] not in COMMANDS:
            return f"unknown command {argv[:1]}; known: {sorted(COMMANDS)}"
        return parse_error(command_parser(argv[0]), argv[1:])
    if what == "torchrun":
        from torch.distributed.run import get_args_parser

        targs = get_args_parser().parse_args(argv)
        if not targs.module or targs.training_script != "regen.train":
            return "torchrun must run `-m regen.train`"
        rest = list(targs.training_script_args)
        return parse_error(_train_parser(), rest[1:] if rest[:1] == ["--"] else rest)
    if what not in MODULE_PARSERS:
        return f"`python -m {what}`: no parser known for this module (add it to MODULE_PARSERS)"
    return parse_error(MODULE_PARSERS[what](), argv)


def option_strings(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[set[str], str | None]:
    """The option strings of the (sub)parser `argv` selects, and an error for an unknown subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            words = [a for a in argv if not a.startswith("-")]
            if not words:
                return set(), None
            if words[0] not in action.choices:
                return set(), f"unknown action {words[0]!r}; known: {sorted(action.choices)}"
            return option_strings(action.choices[words[0]], argv[argv.index(words[0]) + 1:])
    return {o for a in parser._actions for o in a.option_strings}, None


def check_mention(argv: list[str]) -> str | None:
    """A `regen X --flag ...` mentioned in prose: X is a command and every --flag is one of its options."""
    from regen.cli import COMMANDS, command_parser

    if not argv or argv[0] not in COMMANDS:
        return f"unknown command {argv[:1]}; known: {sorted(COMMANDS)}"
    options, err = option_strings(command_parser(argv[0]), argv[1:])
    if err:
        return err
    unknown = [a.split("=")[0] for a in argv[1:] if a.startswith("--") and a.split("=")[0] not in options]
    return f"unknown options {unknown}" if unknown else None


def command_lines() -> list[tuple[str, str, bool]]:
    """(page, command line, strict) of every CLI command line: every line of a code block (strict: must parse),
    inline code spans that start with `.venv/bin/regen`, `python -m regen` or `torchrun` (strict), and inline
    `regen X ...` mentions (command and options must exist)."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for block in code_blocks(text):
            for line in shell_lines(block):
                found.append((rel(page), line, True))
        for span in INLINE.findall(prose(text)):
            s = span.strip()
            if re.match(r"(\.venv/bin/regen|(\.venv/bin/)?python3? (-P )?-m regen|torchrun) ", s):
                found.append((rel(page), s, True))
            elif re.match(r"regen [a-z]", s):
                found.append((rel(page), s, False))
    return found


@pytest.mark.integration
def test_docs_name_command_lines():
    lines = command_lines()
    strict = [line for _, line, s in lines if s and any(cli_invocation(c) for c in segments(line))]
    assert len(strict) >= 50, f"only {len(strict)} CLI command lines found: the extraction is broken"


@pytest.mark.integration
@pytest.mark.parametrize("page", [rel(p) for p in PAGES])
def test_every_command_line_parses(page):
    problems = []
    for where, line, strict in command_lines():
        if where != page:
            continue
        try:
            cmds = segments(line)
        except ValueError as exc:  # unbalanced quotes
            problems.append(f"{line}\n    {exc}")
            continue
        for cmd in cmds:
            inv = cli_invocation(cmd)
            if inv is None:
                continue
            why = check_invocation(*inv) if strict else check_mention(inv[1])
            if why:
                problems.append(f"{line}\n    {why}")
    assert not problems, f"{page}: command lines the CLI does not parse:\n  " + "\n  ".join(problems)


@pytest.mark.integration
def test_command_lines_stand_in_shell_blocks():
    """A command line in a block without a shell language would escape the parse check."""
    hidden = [f"{rel(page)}: {line.strip()}" for page in PAGES
              for lang, body in FENCE.findall(page.read_text(encoding="utf-8")) if lang.strip() not in SHELL
              for line in body.splitlines() if re.match(r"\s*(\.venv/bin/regen|regen|torchrun|python3? -m regen) ", line)]
    assert not hidden, "command lines in a block that is not ```bash:\n  " + "\n  ".join(hidden)


@pytest.mark.integration
def test_a_wrong_command_line_is_caught():
    assert check_invocation("regen", ["run", "--profile", "local"])  # --run is required
    assert check_invocation("regen", ["generate", "--run", "r", "--retry"])  # not an option
    assert check_invocation("regen", ["nosuch"])
    assert check_invocation("torchrun", ["--nproc_per_node", "2", "-m", "regen.train", "--", "--run", "r", "--x"])
    assert check_mention(["features", "produce", "--dispatch", "URL"])
    assert check_invocation("regen", ["features", "produce", "--dispatcher", "http://h:7600"]) is None
    assert check_invocation("torchrun", ["--nproc_per_node", "8", "-m", "regen.train", "--", "--profile", "kimi-k3",
                                         "--run", "runs/k3", "--follow"]) is None


# ---------------------------------------------------------------------------------------------------------------
# profile keys

SECTIONS = ("select", "serve", "generate", "render", "train", "plan")
KEY = re.compile(r"(?<![\w./\-$:{\[])(" + "|".join(SECTIONS) + r")((?:\.[A-Za-z_]\w*)+)")
NOT_KEYS = {"md", "py", "json", "jsonl", "yaml", "yml", "html", "sql", "parquet", "safetensors", "gguf", "txt"}


def key_problem(dotted: str) -> str | None:
    """None when `dotted` names a profile field (a dict field's keys are free, `generate.policies.X` must be a
    quality class), else why not."""
    from pydantic import BaseModel

    from regen.config import Profile
    from regen.config.generate import DEFAULT_POLICIES

    model: type[BaseModel] | None = Profile
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if model is None:
            return f"{'.'.join(parts[:i])} is not a section"
        if part not in model.model_fields:
            return f"{'.'.join(parts[:i + 1])} is not a field (known: {sorted(model.model_fields)})"
        tp = model.model_fields[part].annotation
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            model = tp
        elif origin is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            model = args[0]
        elif origin is dict or tp is dict:
            rest = parts[i + 1:]
            if dotted.startswith("generate.policies.") and rest and rest[0] not in DEFAULT_POLICIES:
                return f"{rest[0]} is not a quality class (known: {sorted(DEFAULT_POLICIES)})"
            return None
        else:
            model = None
    return None


def profile_keys_named() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        for m in KEY.finditer(page.read_text(encoding="utf-8")):
            dotted = m.group(1) + m.group(2)
            if dotted.rsplit(".", 1)[-1] in NOT_KEYS:
                continue
            out.append((rel(page), dotted))
    return out


def test_docs_name_profile_keys():
    assert len({k for _, k in profile_keys_named()}) >= 80


@pytest.mark.parametrize("page", [rel(p) for p in PAGES])
def test_every_profile_key_exists(page):
    bad = sorted({f"{k}: {key_problem(k)}" for where, k in profile_keys_named() if where == page and key_problem(k)})
    assert not bad, f"{page} names profile keys that the configs do not have:\n  " + "\n  ".join(bad)


def test_a_wrong_profile_key_is_caught():
    assert key_problem("generate.max_token")
    assert key_problem("generate.policies.truncate")
    assert key_problem("train.lr.value")
    assert key_problem("train.producers.store.master") is None
    assert key_problem("select.mix.general") is None


# ---------------------------------------------------------------------------------------------------------------
# links


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces -> `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if not m:
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def link_problems(page: Path) -> list[str]:
    problems = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if "shared" in Path(path).parts or not dest.is_relative_to(ROOT):
            problems.append(f"{target}: points outside the repository (a user's clone has no ../shared)")
        elif not dest.exists():
            problems.append(f"{target}: {dest} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading with anchor #{anchor} in {rel(dest)}")
    return problems


@pytest.mark.parametrize("page", [rel(p) for p in PAGES])
def test_every_relative_link_resolves(page):
    problems = link_problems(ROOT / page)
    assert not problems, f"{page}: broken links:\n  " + "\n  ".join(problems)


def test_readme_maps_every_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(readme) if not re.match(r"[a-z]+:", t)}
    missing = [rel(p) for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"README.md links to none of {missing}"


def test_readme_is_short():
    size = len((ROOT / "README.md").read_text(encoding="utf-8"))
    assert size <= README_LIMIT, f"README.md is {size} characters (at most {README_LIMIT}): move detail into docs/"


# ---------------------------------------------------------------------------------------------------------------
# errors


def written_codes() -> dict[str, tuple[str, ...]]:
    """What the code can write into a run's rows and rejects, from its own constants."""
    from filters.response import RESPONSE_FILTERS
    from regen.generate.checks import END_MARKER_STRIPPED, FATAL, PERMANENT, QUALITY_CLASSES, TRANSIENT
    from regen.generate.conversation import STOP_REASONS
    from regen.render.kimi_k3.messages import RENDER_REASONS
    from regen.render.rows import MESSAGE_CODES
    from regen.render.rows import REJECT_FILTERS as RENDER_FILTERS
    from regen.select.batches import REJECT_FILTERS as SELECT_FILTERS
    from schemas.generation import STATUSES

    return {
        "generations.status": STATUSES,
        "generations.error_class (transport)": TRANSIENT + PERMANENT + FATAL,
        "generations.error_class (quality)": QUALITY_CLASSES,
        "generations.stop_reason": STOP_REASONS,
        "generations.flags": (END_MARKER_STRIPPED,),
        "rejected/select filter": SELECT_FILTERS,
        "rejected/render filter (response filters)": tuple(RESPONSE_FILTERS),
        "rejected/render filter (render)": RENDER_FILTERS,
        "rejected/render reason codes": MESSAGE_CODES + RENDER_REASONS,
    }


def exception_classes() -> list[str]:
    """Every exception class defined in the product's packages (by `ast`: a class whose base is an exception)."""
    classes: dict[str, list[str]] = {}
    for pkg in ("schemas", "filters", "regen", "flows"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef):
                    classes[node.name] = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")
                                          for b in node.bases]
    exc = {"Exception", "ValueError", "RuntimeError", "KeyError", "OSError", "TypeError"}
    grew = True
    while grew:
        new = {n for n, bases in classes.items() if n not in exc and any(b in exc for b in bases)}
        grew = bool(new)
        exc |= new
    return sorted(n for n in exc if n in classes)


def error_rows() -> set[str]:
    """The backticked names in the first cell of every table row of docs/errors.md."""
    names = set()
    for line in (DOCS / "errors.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("| "):
            names |= set(re.findall(r"`([^`]+)`", line.split(" | ")[0]))
    return names


def test_errors_page_has_every_code_the_code_writes():
    rows = error_rows()
    missing = [f"{kind}: {code}" for kind, codes in written_codes().items() for code in codes if code not in rows]
    assert not missing, ("docs/errors.md has no table row (first cell `name`) for:\n  " + "\n  ".join(missing))


def test_errors_page_has_every_exception_class():
    classes = exception_classes()
    assert {"InputError", "ProfileError", "RequestFailure", "Reject"} <= set(classes)
    missing = [c for c in classes if c not in error_rows()]
    assert not missing, f"docs/errors.md has no table row for the exception classes {missing}"


# ---------------------------------------------------------------------------------------------------------------
# the configuration reference


def test_configuration_page_is_generated_from_the_code():
    from regen.config.reference import markdown, page_path

    want, have = markdown(), page_path().read_text(encoding="utf-8")
    if have != want:
        diff = [f"page: {a!r}\ncode: {b!r}" for a, b in zip(have.splitlines(), want.splitlines()) if a != b][:3]
        pytest.fail("docs/configuration.md differs from `regen config --markdown`; regenerate it with "
                    "`.venv/bin/regen config --markdown > docs/configuration.md`. First differences:\n"
                    + "\n".join(diff or ["(one is a prefix of the other)"]))


def test_configuration_page_lists_every_environment_variable_and_profile():
    from regen.config.reference import bundled_profiles, environment_variables

    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    for var in ["KIMI_MTP_DATASET", "KIMI_K3_TOKENIZER", "KIMI_K3_MODEL", "REGEN_ENDPOINTS", "MOONCAKE_MASTER",
                *environment_variables()]:
        assert f"| `{var}` |" in page, var
    header = next(line for line in page.splitlines() if line.startswith("| key | type | default |"))
    for name in bundled_profiles():
        assert f" {name} |" in header, name
