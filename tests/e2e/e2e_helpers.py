"""End-to-end test helpers: a synthetic run directory (every stage's files, built from the shared schemas) and a
headless Chromium (Debian `chromium`, installed by .ci/run) to load the HTML report."""
from __future__ import annotations

import datetime as dt
import shutil
import subprocess
from pathlib import Path

from schemas.generation import GENERATION_SCHEMA
from schemas.io import write_json_atomic, write_rows_atomic
from schemas.messages import message_to_arrow
from schemas.prompt import CATEGORIES, PROMPT_SCHEMA
from schemas.rejected import REJECTED_SCHEMA
from schemas.shard import SHARD_SCHEMA

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def dump_dom(chromium: str, html_path: Path, tmp_path: Path) -> str:
    """The DOM of `html_path` after load, as a real headless Chromium sees it."""
    cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}",
           "--virtual-time-budget=10000", "--dump-dom", html_path.resolve().as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def screenshot(chromium: str, html_path: Path, tmp_path: Path) -> Path:
    png = tmp_path / "report.png"
    cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1200,2400",
           f"--screenshot={png}", html_path.resolve().as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and png.exists(), out.stderr[-2000:]
    return png


def make_synthetic_run(root: Path, *, stages=("select", "generate", "render")) -> Path:
    """A run directory with small but real files of the given stages (shapes as the stages write them)."""
    langs = ["en", "zh", "fr", "de"]
    prompts = []
    for i in range(36):
        cat = CATEGORIES[i % len(CATEGORIES)]
        prompts.append({"prompt_id": f"p{i:03d}", "messages": [message_to_arrow({"role": "user", "content": f"q{i}"})],
                        "tools": None, "category": cat, "language": langs[i % 4], "source": "synthetic",
                        "source_file": "x.jsonl", "source_row": i, "num_turns": 1, "num_prompt_tokens": 5 + 3 * i})
    if "select" in stages:
        info = write_rows_atomic(prompts, root / "prompts" / "part-00000.parquet", PROMPT_SCHEMA)
        write_json_atomic({"stage": "select", "parts": [info], "rows": len(prompts)}, root / "prompts" / "manifest.json")
        write_rows_atomic([{"stage": "select", "filter": "exact_dedup", "reason": "duplicate of p001",
                            "source": "synthetic", "prompt_id": None}] * 3,
                          root / "rejected" / "select" / "part-00000.parquet", REJECTED_SCHEMA)
    if "generate" in stages:
        t0 = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.timezone.utc)
        gens = [{"request_key": f"k{i}", "prompt_id": p["prompt_id"], "turn": 0, "status": "ok" if i % 9 else "error",
                 "error_class": None if i % 9 else "transient", "category": p["category"], "language": p["language"],
                 "model": "gemma3-270m", "finish_reason": "length" if i % 3 else "stop", "content": "answer",
                 "num_prompt_tokens": 10 + i, "num_completion_tokens": 4 + (i * 7) % 60, "attempts": 1,
                 "latency_s": 1.0, "finished_at": t0 + dt.timedelta(seconds=20 * i)} for i, p in enumerate(prompts)]
        write_rows_atomic(gens, root / "generations" / "part-w0-00000.parquet", GENERATION_SCHEMA)
        write_json_atomic({"stage": "generate", "accounting": {"generated": 32, "error": 4, "skipped": 0, "units": 36,
                                                              "balanced": True},
                           "metrics": {"attempts": 36, "output_tokens": 1200, "output_tok_per_s": 9.5,
                                       "error_rows_by_class": {"transient": 4}}},
                          root / "generations" / "manifest.json")
    if "render" in stages:
        rows = [{"sample_id": f"s{i}", "prompt_id": p["prompt_id"], "turn": 0, "category": p["category"],
                 "language": p["language"], "input_ids": [2, 5, 6, 7, 106], "loss_spans": [{"start": 3, "end": 5}],
                 "num_tokens": 5, "num_loss_tokens": 2} for i, p in enumerate(prompts[:30])]
        info = write_rows_atomic(rows, root / "shards" / "shard-00000.parquet", SHARD_SCHEMA)
        write_json_atomic({"shards": [{"path": "shard-00000.parquet", "rows": 30, "tokens": 150,
                                       "sha256": info.get("sha256")}],
                           "drift": {"rows_checked": 30, "rows_drifted": 2, "rate": 2 / 30,
                                     "causes": {"whitespace": 2}, "policy": "drop"}},
                          root / "shards" / "manifest.json")
        write_rows_atomic([{"stage": "render", "filter": "language", "reason": "answer is ru, prompt is en",
                            "prompt_id": "p031"}] * 2, root / "rejected" / "render" / "part-filter.parquet",
                          REJECTED_SCHEMA)
    return root
