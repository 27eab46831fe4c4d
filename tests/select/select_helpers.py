"""Helpers shared by the selection tests."""


def perturb(text: str, n: int, rng) -> str:
    """`text` with `n` characters replaced by random lowercase letters (a planted near duplicate)."""
    chars = list(text)
    for _ in range(n):
        i = rng.randrange(len(chars))
        chars[i] = rng.choice("abcdefghijklmnopqrstuvwxyz")
    return "".join(chars)
