"""The README's first command on a small prompt count: `regen run --profile local` with the embedded real model
(select -> embedded target -> generate -> filter -> render), then `regen query` prints the mix, a rerun on
the same directory resumes without asking the server again, and the report opens in headless Chromium."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_helpers import dump_dom

from regen.report.summary import MIX_SQL
from schemas.prompt import CATEGORIES

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
REGEN = str(Path(sys.executable).with_name("regen"))
# a small prompt count; training (when the profile enables it) for two steps only
SMALL = ["--set", "select.total=24", "--set", "generate.max_tokens=16", "--set", "train.max_steps=2",
         "--set", "train.checkpoint_every=2", "--set", "train.eval_prompts=2", "--set", "train.eval_max_new_tokens=8"]


def _regen(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    out = subprocess.run([REGEN, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"regen {args[0]} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("e2e") / "local"
    out = _regen("run", "--profile", "local", "--run", str(run), "--no-progress", *SMALL)
    return run, out.stdout


def _posts(run: Path) -> int:
    """Chat requests the embedded target logged: transformers serve's access lines or llama.cpp's `launch_slot_`."""
    log = run / "serve" / "server.log"
    return sum('"POST /v1/chat/completions' in x or "launch_slot_" in x
               for x in log.read_text(errors="replace").splitlines())


def test_every_stage_wrote_its_outputs(local_run):
    run, stdout = local_run
    for stage in ("prompts", "generations", "shards"):
        assert (run / stage / "manifest.json").exists(), stage
    assert list((run / "prompts").glob("part-*.parquet")) and list((run / "shards").glob("shard-*.parquet"))
    gen = json.loads((run / "generations" / "manifest.json").read_text())
    assert gen["accounting"]["balanced"] and gen["accounting"]["generated"] > 0
    assert "The mix (DuckDB" in stdout and MIX_SQL in stdout


def test_generations_come_from_the_real_model(local_run):
    run, _ = local_run
    out = _regen("query", "--run", str(run), "--json",
                 "SELECT model, status, content, num_completion_tokens FROM generations WHERE status = 'ok'")
    rows = [json.loads(x) for x in out.stdout.splitlines()]
    assert rows and {r["model"] for r in rows} == {"smollm2-135m"}
    assert all(0 < r["num_completion_tokens"] <= 16 for r in rows)
    assert sum(bool(r["content"].strip()) for r in rows) >= len(rows) // 2
    assert _posts(run) >= len(rows) + 1  # served over HTTP: warm-up + one request per row at least


def test_training_ran_when_the_profile_enables_it(local_run):
    from regen.config import load_profile

    run, stdout = local_run
    if not load_profile("local").train.enabled:
        pytest.skip("the local profile does not train")
    assert "== train done" in stdout and any((run / "train").iterdir())
    assert "== eval done" in stdout
    if "eval skipped: no held-out prompt" not in stdout:  # 24 prompts: the per-cell picks hold some out (unless filtered)
        ev = json.loads((run / "eval.json").read_text())
        assert ev["num_prompts"] >= 1 and ev["trained"]["acc_len"] >= 1.0 and ev["untrained"]["acc_len"] >= 1.0
        assert f"acc_len on {ev['num_prompts']} held-out prompts" in stdout
        # the round trip closes the main job: the draft served by llama.cpp, its acceptance and speedup
        assert "== serve done" in stdout and "llama.cpp q8_0: acc_len" in stdout
        ee = json.loads((run / "engine-eval.json").read_text())
        q8 = ee["by_gguf_type"]["q8_0"]
        assert ee["num_prompts"] == ev["num_prompts"] and q8["engine"]["num_rounds"] > 0
        assert q8["speed"]["tokens_per_s_target_alone"] > 0 and q8["lossless"]["num_prompts"] == ev["num_prompts"]
        # per category x length band x mode: every prompt in one cell, regen's replay per cell beside
        assert sum(c["num_requests"] for c in q8["cells"]["cells"]) == ev["num_prompts"]
        assert q8["cells"]["overall"]["num_rounds"] == q8["engine"]["num_rounds"]
        assert ee["regen"]["cells"]["engine_budget_rule"]["overall"]["num_requests"] == ev["num_prompts"]
        assert (run / "export" / "llama.cpp" / "draft-dspark.gguf").exists()
        assert "serve (llama.cpp q8_0)" in stdout  # the run's summary table shows it


def test_every_category_is_present_and_query_prints_the_mix(local_run):
    run, _ = local_run
    out = _regen("query", "--run", str(run), "--json", MIX_SQL)
    mix = {json.loads(x)["category"]: json.loads(x)["prompts"] for x in out.stdout.splitlines()}
    assert set(mix) == set(CATEGORIES) and sum(mix.values()) == 24
    samples = _regen("query", "--run", str(run), "--json", "SELECT DISTINCT category FROM samples").stdout
    assert {json.loads(x)["category"] for x in samples.splitlines()} == set(CATEGORIES)
    table = _regen("query", "--run", str(run), MIX_SQL).stdout
    assert all(c in table for c in CATEGORIES)


def test_rerun_resumes_without_requests(local_run):
    run, _ = local_run
    before = _posts(run)
    shards = (run / "shards" / "manifest.json").read_text()
    out = _regen("run", "--profile", "local", "--run", str(run), "--no-progress", *SMALL)
    assert _posts(run) == before  # finished generations: the target is not even started
    assert "embedded target" not in out.stdout
    assert json.loads((run / "shards" / "manifest.json").read_text())["shards"] == json.loads(shards)["shards"]


def test_report_of_the_run_in_chromium(local_run, chromium, tmp_path):
    run, _ = local_run
    _regen("report", "--run", str(run))
    dom = dump_dom(chromium, run / "report.html", tmp_path)
    # mix, languages, prompt and response lengths, finish reasons, rejects, throughput, drift; acc_len per cell and
    # per-position acceptance; the training loss and tau; the held-out estimate during training (the local profile
    # runs it every 250 steps and at the last): every plot the report holds is an image the browser decoded
    plots = (run / "report.html").read_text().count('class="plot-img"')
    text = (run / "report.html").read_text()
    assert 'id="plot-training"><img' in text and 'id="plot-eval_curve"><img' in text
    assert plots == 12 and f'data-images-ok="{plots}"' in dom, (plots, dom[:1000])


def test_the_main_job_trains_through_feature_producers_with_one_switch(local_run):
    """`--set train.features=producers` on the README's first command: the run resumes its training
    (two more steps) with SmolLM2's features from two local producer processes through a Mooncake store, the
    trainer holding only the target's embeddings, final norm and LM head."""
    from regen.config import load_profile

    run, _ = local_run
    if not load_profile("local").train.enabled:
        pytest.skip("the local profile does not train")
    before = json.loads((run / "train" / "summary.json").read_text())
    # the serve stage's round trip is held by test_training_ran_when_the_profile_enables_it: not served again here
    out = _regen("run", "--profile", "local", "--run", str(run), "--no-progress", *SMALL,
                 "--set", "train.features=producers", "--set", "train.max_steps=4", "--set", "train.eval_prompts=0",
                 "--set", "serve.engine_eval=false")
    summary = json.loads((run / "train" / "summary.json").read_text())
    assert "== train done" in out.stdout and summary["steps"] == 4 and summary["features_from"] == "producers"
    assert "== serve" not in out.stdout
    f = summary["features"]
    assert f["objects"] >= 2 and f["failed_microbatches"] == 0 and len(f["producers"]) == 2
    assert summary["target_memory_bytes_per_rank"] < before["target_memory_bytes_per_rank"] / 2
