"""Helpers shared by the selection tests."""
from regen.config.select import SelectConfig, SourceConfig
from regen.select.sources import iter_raw_batches, make_drafts, shape_of, source_files


def perturb(text: str, n: int, rng) -> str:
    """`text` with `n` characters replaced by random lowercase letters (a planted near duplicate)."""
    chars = list(text)
    for _ in range(n):
        i = rng.randrange(len(chars))
        chars[i] = rng.choice("abcdefghijklmnopqrstuvwxyz")
    return "".join(chars)


def drafts_of(path, **src_kw) -> list:
    """Every draft (or parse reject) of one source file, through the stage's own reading path (shape from the
    first batch, as `regen select` does)."""
    src = SourceConfig(name="t", path=str(path), **src_kw)
    cfg = SelectConfig(sources=[src])
    out = []
    for fpath, kind in source_files(src):
        shape = fmap = None
        for sfile, start, rows in iter_raw_batches(fpath, kind, 1000, src.fields):
            if shape is None:
                shape, fmap = shape_of(sfile, rows, src.fields)
            out.extend(make_drafts(src, cfg, sfile, start, rows, shape, fmap, {}))
    return out
