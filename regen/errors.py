"""User-facing errors: each names the input, the row or field, and the fix. The CLI prints them without a traceback."""


class InputError(ValueError):
    """Bad user input (a file, a row, a flag). The message names the input, the row or field, and what to do.
    `exit_status`: the CLI's exit status for it (`exit_code`)."""

    exit_status = 2


def exit_code(main, prog: str) -> int:
    """`main()`'s exit status (None -> 0); an InputError prints as `<prog>: error: <message>` on stderr, without a
    traceback, and gives its class's `exit_status`: 2 (argparse's status for a usage error) unless a subclass says
    otherwise (`regen.train.guard.NonFiniteStep`: 3). Other exceptions propagate."""
    import sys

    try:
        return int(main() or 0)
    except InputError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return int(getattr(exc, "exit_status", 2))
