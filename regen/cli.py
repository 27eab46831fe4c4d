"""The `regen` command line: one subcommand per stage, each implemented by its stage module.

Each stage module exposes `add_arguments(parser)` and `main(args) -> int`; only the module of the chosen
command is imported, so `regen query` never pays for importing torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, one-line help). A literal registry, in pipeline order.
COMMANDS: dict[str, tuple[str, str]] = {
    "select": ("regen.select", "select a deduplicated, filtered prompt mix into runs/<name>/prompts/"),
    "serve-target": ("regen.serve", "serve the embedded target model on loopback (OpenAI-compatible)"),
    "generate": ("regen.generate", "regenerate every prompt with the target into generations/"),
    "render": ("regen.render", "render generations into assistant-masked token shards"),
    "show-render": ("regen.show_render", "render one conversation from stdin and print text, ids, loss mask"),
    "export": ("regen.export", "copy shards or conversations to a local path or fsspec URI"),
    "train": ("regen.train", "train a DSpark draft on the shards with online target hidden states"),
    "eval": ("regen.eval", "measure a draft's acc_len against the target"),
    "run": ("regen.pipeline", "the main job: every stage of a profile in order, resumable"),
    "query": ("regen.query", "run DuckDB SQL over the run's views (prompts, rejected, generations, ...)"),
    "report": ("regen.report", "write an HTML report with plots for a run"),
}


def add_profile_arguments(parser: argparse.ArgumentParser, run_required: bool = True) -> None:
    """The arguments every stage takes: --profile, --run and repeated --set overrides."""
    parser.add_argument("--profile", default="local", help="profile name in data/profiles/ or a .yaml path")
    parser.add_argument("--run", required=run_required, help="run directory, e.g. runs/local")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a profile field, e.g. --set select.total=300 (repeatable)",
    )


def load_profile_from_args(args):
    """(Profile, RunDir) from parsed `--profile/--run/--set` arguments."""
    from regen.config import load_profile
    from regen.rundir import RunDir

    profile = load_profile(args.profile, args.overrides)
    return profile, RunDir.at(args.run)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = argparse.ArgumentParser(prog="regen", description=__doc__.splitlines()[0])
    sub = top.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        top.parse_args(argv or ["--help"])
        return 2
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"regen {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    from regen.errors import InputError

    try:
        return int(module.main(args) or 0)
    except InputError as exc:
        print(f"regen {name}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
