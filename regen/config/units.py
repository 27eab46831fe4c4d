"""Sizes written with units in profiles and on the command line: `512MiB`, `64GiB`, `2.5e9`, `1000000`."""
from __future__ import annotations

import re

from regen.errors import InputError

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(value) -> int:
    """Bytes of `value`: an int, or a string with an optional binary (KiB..TiB) or decimal (kB..TB) unit.
    Raises InputError naming the value."""
    if isinstance(value, bool):
        raise InputError(f"{value!r} is not a size")
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise InputError(f"{value!r} is not a size: write e.g. 512MiB, 64GiB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
