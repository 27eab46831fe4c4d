"""The `regen` command line: one subcommand per stage, each implemented by its stage module.

Each stage module exposes `add_arguments(parser)` and `main(args) -> int`; only the module of the chosen
command is imported, so `regen query` never pays for importing torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from regen.errors import exit_code

# command -> (module, one-line help). A literal registry, in pipeline order.
COMMANDS: dict[str, tuple[str, str]] = {
    "select": ("regen.select.stage", "select a deduplicated, filtered prompt mix into runs/<name>/prompts/"),
    "serve-target": ("regen.target.server", "serve the embedded target model on loopback (OpenAI-compatible)"),
    "generate": ("regen.generate.stage", "regenerate every prompt with the target into generations/"),
    "render": ("regen.render.stage", "render generations into assistant-masked token shards"),
    "show-render": ("regen.render.show", "render one conversation from stdin and print text, ids, loss mask"),
    "export": ("regen.render.export", "copy shards or conversations to a local path or fsspec URI"),
    "train": ("regen.train.loop", "train a DSpark draft on the shards with online target hidden states"),
    "features": ("regen.train.features.cli", "feature producers, a store node, a pool's status (train.features: "
                 "producers)"),
    "eval": ("regen.train.eval_cli", "measure a draft's acc_len against the target"),
    "export-draft": ("regen.serve.engines.cli", "a trained draft in a serving engine's layout, with its launch "
                     "(TokenSpeed, vLLM, SGLang, llama.cpp)"),
    "engine-eval": ("regen.serve.engines.spec_eval", "serve the trained draft through llama.cpp beside the embedded "
                    "target and read its acceptance from the engine's counters (the round trip)"),
    "rehearse": ("regen.report.rehearse", "one training step of a profile at its real size on fake tensors: memory "
                 "per rank against the plan, host syncs, collectives, device placement"),
    "plan": ("regen.report.plan", "a dry run: requests, tokens, server-hours, shard bytes, GPU memory of a profile"),
    "run": ("regen.pipeline", "the main job: every stage of a profile in order, resumable"),
    "query": ("regen.report.query", "run DuckDB SQL over the run's views (prompts, rejected, generations, ...)"),
    "report": ("regen.report.html", "write an HTML report with plots for a run"),
    "config": ("regen.config.reference", "print a profile with its defaults filled in, or (--markdown) the "
               "configuration reference docs/configuration.md"),
}


def command_parser(name: str) -> argparse.ArgumentParser:
    """The argument parser of `regen <name>` (imports that command's module only). Raises KeyError for a name
    that is not in COMMANDS. tests/docs/test_docs.py parses the documentation's command lines with it."""
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"regen {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    return parser


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
    args = command_parser(name).parse_args(argv[1:])
    return exit_code(lambda: module.main(args), f"regen {name}")


if __name__ == "__main__":
    sys.exit(main())
