"""regen.errors.exit_code: the one place a user error becomes exit status 2 without a traceback."""
from __future__ import annotations

import pytest

from regen.errors import InputError, exit_code


def test_exit_code(capsys):
    assert exit_code(lambda: None, "prog") == 0 and exit_code(lambda: 3, "prog") == 3

    def bad():
        raise InputError("rows.jsonl row 7: no 'messages'; add it")

    assert exit_code(bad, "regen select") == 2
    assert capsys.readouterr().err == "regen select: error: rows.jsonl row 7: no 'messages'; add it\n"

    def bug():
        raise KeyError("x")

    with pytest.raises(KeyError):  # a bug keeps its traceback
        exit_code(bug, "prog")
