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


class PreflightError(InputError):
    """Every problem a check found before the first request, one per line (`problems`), each naming the field and
    the fix (`regen.preflight`; the embedded target's endpoint once it is up: `regen.generate.preflight`)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"preflight found {len(problems)} problem(s); nothing was requested:\n"
                         + "\n".join(f"  - {p}" for p in problems))


class CheckReport:
    """What the stages' checks (`check(...)` beside each `run_<stage>`) passed and what they found wrong.

    `checks`: short lines of what passed; `problems`: one line each, naming the field or input and the fix. A check
    never raises for a problem: it calls `bad(line)` so that one run lists every problem at once."""

    def __init__(self) -> None:
        self.checks: list[str] = []
        self.problems: list[str] = []

    def ok(self, line: str) -> None:
        self.checks.append(line)

    def bad(self, line: str) -> None:
        self.problems.append(line)

    def to_dict(self) -> dict:
        return {"checks": self.checks, "problems": self.problems}
