"""User-facing errors: each names the input, the row or field, and the fix. The CLI prints them without a traceback."""


class InputError(ValueError):
    """Bad user input (a file, a row, a flag). The message names the input, the row or field, and what to do."""
