"""`regen report`: every plot from a run with all stages, notes (not errors) for missing stages, and the page
checked in a real headless Chromium (images decoded, no network)."""
from __future__ import annotations

import base64
import re

from e2e_helpers import dump_dom, make_synthetic_run, screenshot

from regen import cli
from regen.report.html import render_report, write_report

PLOTS = ["mix", "languages", "prompt_tokens", "response_tokens", "finish_reasons", "rejects", "throughput", "drift"]


def _images(text: str) -> dict[str, bytes]:
    found = re.findall(r'<figure class="plot" id="plot-([a-z_]+)"><img class="plot-img" alt="[^"]*" '
                       r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    return {name: base64.b64decode(data) for name, data in found}


def test_every_plot_from_a_full_run(tmp_path):
    run = make_synthetic_run(tmp_path / "run")
    text = render_report(run)
    images = _images(text)
    assert sorted(images) == sorted(PLOTS)
    assert all(png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 2000 for png in images.values())
    assert "Render drift rate 6.67% of 30 rows checked" in text
    assert "answer is ru, prompt is en" in text  # reject reasons table
    assert "http://" not in text.replace("http://www.w3.org", "")  # self-contained


def test_missing_stages_give_notes(tmp_path):
    run = make_synthetic_run(tmp_path / "run", stages=("select",))
    text = render_report(run)
    assert sorted(_images(text)) == ["languages", "mix", "prompt_tokens", "rejects"]
    assert "no generations yet" in text and "render has not run" in text
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no stage has run" in render_report(empty)


def test_cli_writes_report_html(tmp_path, capsys):
    run = make_synthetic_run(tmp_path / "run")
    assert cli.main(["report", "--run", str(run)]) == 0
    assert (run / "report.html").exists() and "wrote" in capsys.readouterr().out
    assert cli.main(["report", "--run", str(tmp_path / "nope")]) == 2


def test_report_in_headless_chromium(tmp_path, chromium):
    run = make_synthetic_run(tmp_path / "run")
    page = write_report(run)
    dom = dump_dom(chromium, page, tmp_path)
    assert f'data-images-ok="{len(PLOTS)}"' in dom, dom[:500]
    for name in PLOTS:
        assert f'id="plot-{name}"' in dom
    png = screenshot(chromium, page, tmp_path)
    assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 20_000


def test_a_run_whose_rows_were_all_rejected(tmp_path):
    """An empty shard list (every row dropped) still gives a report (the `shards` view cannot be made)."""
    import json

    run = make_synthetic_run(tmp_path / "run")
    (run / "shards" / "shard-00000.parquet").unlink()
    manifest = json.loads((run / "shards" / "manifest.json").read_text())
    (run / "shards" / "manifest.json").write_text(json.dumps({**manifest, "shards": []}))
    text = render_report(run)
    assert "<tr><td>render</td><td>rows</td><td>0</td></tr>" in text and 'id="plot-mix"><img' in text


def test_acceptance_plots_from_eval_and_the_training_curve(tmp_path):
    """acc_len per category x band x mode (both averages, the untrained draft beside it), per-position
    acceptance, and the held-out curve measured during training, with the best step."""
    import json

    from regen.train.eval import Round
    from regen.train.eval_cells import breakdown

    run = make_synthetic_run(tmp_path / "run")
    assert "no eval.json" in render_report(run)
    reqs = [({"category": c, "length_band": b, "mode": "default", "prompt_ids": [1] * 9},
             [Round(a, a + 1, 4, False) for a in (k, k + 1, 0)])
            for k, (c, b) in enumerate([("coding", "0-128"), ("coding", "128-1536"), ("general", "0-128")])]
    ev = {name: {"acc_len": 1.5, "breakdown": breakdown(reqs, 4)} for name in ("trained", "untrained")}
    (run / "eval.json").write_text(json.dumps(ev))
    (run / "train").mkdir(exist_ok=True)
    (run / "train" / "periodic_eval.jsonl").write_text("".join(
        json.dumps({"step": s, "acc_len_estimate": v, "eval_every": 50, "method": "teacher-forced"}) + "\n"
        for s, v in ((50, 1.1), (100, 1.3), (150, 1.25))))
    text = render_report(run)
    images = _images(text)
    assert {"acc_len_cells", "position_acceptance", "eval_curve"} <= set(images)
    assert all(images[k].startswith(b"\x89PNG") for k in ("acc_len_cells", "position_acceptance", "eval_curve"))
    assert "best 1.300 at step 100" in text and "<td>coding</td><td>128-1536</td><td>default</td>" in text
