"""Length bands and generation modes as dimensions of the mix: band quotas inside each
category's quota, modes in stated proportions per category x band cell, both recorded on every prompt row and
visible in the DuckDB views."""
from __future__ import annotations

import json
import random
from collections import Counter

import pyarrow as pa
import pytest

from regen.config import ProfileError, load_profile
from regen.config.select import SelectConfig, SourceConfig, band_names, band_of
from regen.errors import InputError
from regen.report.query import query
from regen.rundir import RunDir
from regen.select.mix import assign_modes, select_rows
from regen.select.stage import run_select, starved_categories, with_bands
from schemas.prompt import CATEGORIES

SHARES = {"general": 0.5, "reasoning": 0.5}


def test_band_names_and_membership():
    assert band_names([2048, 8192, 16384, 32768]) == ["0-2K", "2K-8K", "8K-16K", "16K-32K"]
    assert band_names([256, 1536]) == ["0-256", "256-1536"]
    edges = [2048, 8192]
    assert [band_of(n, edges) for n in (0, 2048, 2049, 8192, 8193)] == ["0-2K", "0-2K", "2K-8K", "2K-8K", ">8K"]
    assert band_of(10, []) is None


def _pool(n: int, seed: int = 0, long_share: float = 0.5) -> pa.Table:
    rng = random.Random(seed)
    tokens = [rng.randint(2049, 8000) if rng.random() < long_share else rng.randint(10, 2000) for _ in range(n)]
    t = pa.table({"prompt_id": [f"{i:032x}" for i in range(n)],
                  "category": [("general", "reasoning")[i % 2] for i in range(n)],
                  "language": ["en"] * n, "source": ["s"] * n, "num_prompt_tokens": tokens,
                  "length_band": [None] * n})
    return t


def test_band_quotas_within_each_category_and_shortfall_redistributed():
    cfg = SelectConfig(total=200, mix=SHARES, length_bands=[2048, 8192], band_shares=[0.25, 0.75],
                       max_prompt_tokens=8192)
    pool = with_bands(_pool(2000), cfg)
    idx, rep = select_rows(pool, cfg, seed=0)
    sel = pool.take(pa.array(idx))
    cells = Counter(zip(sel.column("category").to_pylist(), sel.column("length_band").to_pylist()))
    for c in SHARES:  # 100 per category, 25 short + 75 long
        assert cells[(c, "0-2K")] == 25 and cells[(c, "2K-8K")] == 75, cells
        assert rep["bands"][c]["2K-8K"] == {"share_requested": 0.75, "target": 75, "available":
                                            rep["bands"][c]["2K-8K"]["available"], "selected": 75}
    # a pool with few long prompts: each category's quota is still met, its long band's shortfall going to short
    scarce = with_bands(_pool(2000, long_share=0.02), cfg)
    idx, rep = select_rows(scarce, cfg, seed=0)
    sel = scarce.take(pa.array(idx))
    cells = Counter(zip(sel.column("category").to_pylist(), sel.column("length_band").to_pylist()))
    for c in SHARES:
        long_supply = rep["bands"][c]["2K-8K"]["available"]
        assert long_supply < 75 and cells[(c, "2K-8K")] == long_supply
        assert cells[(c, "0-2K")] + cells[(c, "2K-8K")] == 100
    warned = starved_categories(rep, cfg)
    assert len(warned) == 1 and "length band '2K-8K' got" in warned[0] and "select.band_shares" in warned[0]
    assert starved_categories(select_rows(pool, cfg, seed=0)[1], cfg) == []
    with pytest.raises(InputError, match="length band '2K-8K'"):
        starved_categories(rep, cfg.model_copy(update={"on_category_shortfall": "fail"}))
    # without band shares the bands are labels only: the selection is the category-only one
    labels = cfg.model_copy(update={"band_shares": []})
    a, rep_a = select_rows(pool, labels, seed=0)
    b, _ = select_rows(pool.drop(["length_band"]), SelectConfig(total=200, mix=SHARES), seed=0)
    assert a.tolist() == b.tolist() and "bands" not in rep_a


def test_modes_in_stated_proportions_per_cell():
    n = 1000
    rng = random.Random(1)
    ids = [f"{i:032x}" for i in range(n)]
    cats = [rng.choice(["general", "coding"]) for _ in range(n)]
    bands = [rng.choice(["0-2K", "2K-8K"]) for _ in range(n)]
    shares = {"think_max": 0.5, "think_low": 0.3, "no_think": 0.2}
    modes = assign_modes(ids, cats, bands, shares, seed=0)
    by_cell: dict = {}
    for c, b, m in zip(cats, bands, modes):
        by_cell.setdefault((c, b), Counter())[m] += 1
    for cell, counts in by_cell.items():
        size = sum(counts.values())
        for m, s in shares.items():
            assert abs(counts[m] - s * size) < 1, (cell, counts)  # largest remainder: within one prompt
    assert assign_modes(ids, cats, bands, shares, seed=0) == modes
    assert assign_modes(ids, cats, bands, shares, seed=1) != modes


def _write_pool(path, n=400):
    rng = random.Random(3)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            words = " ".join(f"w{rng.randrange(10**6)}" for _ in range(rng.choice([5, 5, 600])))
            f.write(json.dumps({"prompt": f"Question {i}: {words}?"}) + "\n")


def test_selection_records_band_and_mode_on_every_row_and_in_the_views(tmp_path):
    _write_pool(tmp_path / "pool.jsonl")
    cfg = SelectConfig(sources=[SourceConfig(name="p", path=str(tmp_path / "pool.jsonl"), category="general",
                                             language="en")],
                       total=120, mix={"general": 1.0}, length_bands=[256, 4096], band_shares=[0.5, 0.5],
                       modes={"a": 0.75, "b": 0.25}, max_prompt_tokens=4096, workers=1,
                       filters=["empty", "token_budget", "exact_dedup"])
    run = RunDir.at(tmp_path / "run")
    manifest = run_select(cfg, run, seed=0, progress=False)
    assert manifest["counts"]["length_band"] == {"0-256": 60, "256-4K": 60}
    assert manifest["counts"]["mode"] == {"a": 90, "b": 30}
    assert {(c["length_band"], c["mode"]): c["prompts"] for c in manifest["cells"]} == {
        ("0-256", "a"): 45, ("0-256", "b"): 15, ("256-4K", "a"): 45, ("256-4K", "b"): 15}
    rows = query(run.root, "SELECT length_band, mode, count(*), min(num_prompt_tokens), max(num_prompt_tokens) "
                           "FROM prompts GROUP BY 1, 2 ORDER BY 1, 2")[1]
    assert [r[:3] for r in rows] == [("0-256", "a", 45), ("0-256", "b", 15), ("256-4K", "a", 45),
                                     ("256-4K", "b", 15)]
    assert all(r[4] <= 256 for r in rows if r[0] == "0-256") and all(r[3] > 256 for r in rows if r[0] == "256-4K")
    assert query(run.root, "SELECT count(*) FROM prompts WHERE length_band IS NULL OR mode IS NULL")[1] == [(0,)]


def test_profile_checks_bands_and_modes():
    with pytest.raises(ProfileError, match="select.modes .* and generate.modes"):
        load_profile("local", {"select.modes": {"a": 1.0}})
    with pytest.raises(ProfileError, match="band_shares has 1 entries for 2"):
        load_profile("local", {"select.length_bands": [512, 1536], "select.band_shares": [1.0]})
    with pytest.raises(ProfileError, match="max_prompt_tokens is 1536"):
        load_profile("local", {"select.length_bands": [512, 1024]})
    with pytest.raises(ProfileError, match="strictly increasing"):
        load_profile("local", {"select.length_bands": [1536, 512]})
    ok = load_profile("local", {"select.modes": {"a": 0.5, "b": 0.5},
                                "generate.modes": {"a": {"temperature": 0.0}, "b": {"extra_body": {"x": 1}}}})
    assert ok.generate.for_mode("a").temperature == 0.0 and ok.generate.for_mode("b").extra_body["x"] == 1
    assert ok.generate.for_mode("b").temperature == ok.generate.temperature
    assert set(CATEGORIES) >= set(ok.select.shares())
