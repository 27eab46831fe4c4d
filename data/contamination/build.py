"""Build `data/contamination/`: the benchmark prompt texts the `kimi-k3` profile's contamination filter reads
(run once by a maintainer; outputs committed). A user's clone needs nothing outside the repository.

    .venv/bin/python data/contamination/build.py PROMPTS_DIR

PROMPTS_DIR is the project's copy of the public prompt sets (the workspace's `shared/data/prompts`, see SOURCES.md
beside this file). For each evaluation set it writes `<set>.jsonl`: one row `{"prompt": TEXT}` per user message of
every benchmark row, exactly the texts `regen.select.sources.benchmark_texts` reads from the set itself, so the
filter matches the same n-grams as it would against the full files (checked here before anything is written).
BIG-Bench Hard rows also carry the set's canary string (`canary`), as every BBH file does upstream.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from regen.select.sources import benchmark_texts  # noqa: E402

# The evaluation sets the kimi-k3 profile must not train on (data/profiles/kimi-k3.yaml, select.contamination_files).
SETS = ["fastchat_mt_bench", "arena_hard_v0.1", "m_ifeval", "humaneval", "mbpp", "bbh", "swe_bench_lite",
        "mt_bench_zh"]


HEAD = """# Contamination sets (`data/contamination/`)

The prompts of public evaluation benchmarks that a training selection must not contain: the `kimi-k3` profile's
`select.contamination_files` (filter `contamination`, docs/select.md). **These are evaluation prompts: never train
on them.** Built by `data/contamination/build.py` from the project's copy of the public prompt sets: each
`<set>.jsonl` holds one row `{"prompt": TEXT}` per user message of every row of the set, exactly the texts the
filter reads from the set's own files (the build checks that they read back the same), without the sets' other
fields (answers, tests, patches). BIG-Bench Hard rows keep the set's canary string (`canary`): its authors ask that
its text never appear in training corpora.

| file | set (source folder) | texts | bytes |
|---|---|---|---|
{TABLE}

Provenance, licences and notes of each set, verbatim from the prompt sets' SOURCES.md (the "stored file" rows name
the files the texts were read from; rows kept / original says where a set was subsampled):

{ATTRIBUTIONS}
"""


def _canary(src: Path) -> str | None:
    for f in sorted(src.rglob("*.json")):
        obj = json.loads(f.read_text(encoding="utf-8"))
        if isinstance(obj, dict) and obj.get("canary"):
            return obj["canary"]
    return None


def _sections(sources_md: str, names: list[str]) -> str:
    """The per-dataset sections of the pool's SOURCES.md for `names` (attribution, licence, notes), verbatim."""
    parts = re.split(r"(?m)^(?=### `)", sources_md)
    keep = [p for p in parts if any(p.startswith(f"### `{n}/`") for n in names)]
    return "".join(keep).rstrip() + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(__doc__, file=sys.stderr)
        return 2
    src_root = Path(argv[0])
    rows_table = []
    for name in SETS:
        texts = benchmark_texts(str(src_root / name))
        canary = _canary(src_root / name)
        out = HERE / f"{name}.jsonl"
        with out.open("w", encoding="utf-8") as f:
            for t in texts:
                row = {"prompt": t, "canary": canary} if canary else {"prompt": t}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        again = benchmark_texts(str(out))
        if again != texts:
            print(f"{out}: the written texts do not read back as the set's own ({len(again)} vs {len(texts)})",
                  file=sys.stderr)
            return 1
        rows_table.append((name, len(texts), out.stat().st_size))
    table = "\n".join(f"| `{n}.jsonl` | `{n}/` | {k:,} | {b:,} |" for n, k, b in rows_table)
    attributions = _sections((src_root / "SOURCES.md").read_text(encoding="utf-8"), SETS)
    (HERE / "SOURCES.md").write_text(HEAD.replace("{TABLE}", table).replace("{ATTRIBUTIONS}", attributions),
                                     encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
