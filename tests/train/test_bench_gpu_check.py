"""bench/gpu_check.sh as far as a CPU allows: its arguments, every section at toy shapes, and a run as the GPU
machine's image would make it (only the image's packages importable, plus the carried wheels), up to the point
where it needs CUDA."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # starts processes (docs/development.md, the test tiers)

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".gpu-wheels"

# sitecustomize of the image stand-in: a top-level module that only this venv's site-packages provides, from a
# distribution the image lacks, cannot be imported. The image's distributions: bench/gpu-image-packages.txt, with
# what those require as installed here (the venv's versions of the image's packages may need other helpers), but
# never what the image is known to lack (the carried wheels' pins, and the regen imports its operators found
# missing): this venv's typer requires pydantic, the image's has none. A module found elsewhere on the path (the
# carried wheels' folder, the working tree) imports as usual.
NOT_ON_IMAGE = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "polars", "duckdb", "prefect",
                "datasets", "openai", "ray", "mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda")
IMAGE_SITECUSTOMIZE = r'''
import importlib.machinery, importlib.metadata as md, re, sys, sysconfig
from packaging.requirements import Requirement

def _norm(n):
    return re.sub(r"[-_.]+", "-", n).lower()

_image = {_norm(l.strip()) for l in open(%(packages)r) if l.strip() and not l.startswith("#")}
_lacks = {_norm(n) for n in %(lacks)r} - _image
_todo = list(_image)
while _todo:
    try:
        _reqs = md.requires(_todo.pop()) or []
    except md.PackageNotFoundError:
        continue
    for _r in _reqs:
        _req = Requirement(_r)
        if (not _req.marker or _req.marker.evaluate({"extra": ""})) and _norm(_req.name) not in _image | _lacks:
            _image.add(_norm(_req.name))
            _todo.append(_norm(_req.name))
_venv_site = sysconfig.get_paths()["purelib"]
_absent = {m for m, ds in md.packages_distributions().items() if all(_norm(d) not in _image for d in ds)}

class _ImageOnly:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if path is not None or top not in _absent:
            return None
        elsewhere = [p for p in sys.path if p and not p.startswith(_venv_site)]
        spec = importlib.machinery.PathFinder.find_spec(top, elsewhere)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {top!r} (not on the GPU image)", name=name)
        return None  # found outside the venv (carried wheels): the ordinary finders take it

sys.meta_path.insert(0, _ImageOnly())
'''


def run(*args, env=None, timeout=600):
    env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def records(proc):
    return [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]


def test_bad_arguments_exit_2():
    assert run("--tokens", "0").returncode == 2
    assert run("--wheels", "/nonexistent").returncode == 2
    assert run("--cpu", "--attention", "flex").returncode == 2
    assert run("--only", "nothing").returncode == 2


def test_without_cuda_it_imports_everything_then_stops_non_zero_saying_why():
    proc = run("--quick")
    imports = records(proc)[0]
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert imports["section"] == "imports" and imports["ok"] and not imports["missing"]
    assert "no CUDA device" in proc.stderr and "--cpu" in proc.stderr


def test_on_the_gpu_image_as_it_is_the_carried_wheels_take_it_past_every_import(tmp_path):
    assert WHEELS.is_dir() and any(WHEELS.glob("pydantic-*.whl")), \
        "no .gpu-wheels/: scripts/setup.sh downloads them (bash scripts/gpu-wheels.sh)"
    site = tmp_path / "image"
    site.mkdir()
    pins = [ln.split("==")[0] for ln in (ROOT / "requirements" / "gpu-wheels.txt").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]
    (site / "sitecustomize.py").write_text(IMAGE_SITECUSTOMIZE % {
        "packages": str(ROOT / "bench" / "gpu-image-packages.txt"), "lacks": (*pins, *NOT_ON_IMAGE)})
    image_env = {"PYTHONPATH": str(site), "TMPDIR": str(tmp_path)}
    probe = subprocess.run([sys.executable, "-c", "import pydantic"], env={**os.environ, **image_env},
                           capture_output=True, text=True)
    assert probe.returncode != 0 and "not on the GPU image" in probe.stderr  # the stand-in does hide pydantic
    bare = run("--quick", "--wheels", str(tmp_path), env=image_env)  # no wheels in that folder
    assert bare.returncode == 2 and "scripts/gpu-wheels.sh" in bare.stderr
    proc = run("--quick", "--wheels", str(WHEELS), env=image_env)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
    imports = records(proc)[0]
    assert imports["ok"], imports["missing"]
    assert imports["origins"]["pydantic"].startswith(str(tmp_path))  # from the carried wheels, not the venv
    assert imports["origins"]["regen.train.loop"] == str(ROOT / "regen" / "train")
    assert "no CUDA device" in proc.stderr
    assert not list(tmp_path.glob("regen-gpu-site.*"))  # the temporary site is removed when the check ends


@pytest.mark.slow
def test_the_cpu_fallback_runs_every_section_at_toy_shapes():
    proc = run("--cpu", "--quick")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    recs = {r.get("section", "summary"): r for r in records(proc)}
    k3, store, attn, h2d, train = (recs[s] for s in ("k3_step", "store_step", "attention", "h2d", "train"))
    assert k3["finite"] and k3["layers"] == 5 and len(k3["losses"]) == 3
    assert k3["flops_per_row_counted"] > 0 and k3["tflops_per_s"] >= 0
    assert k3["plan_memory_per_gpu_gib"]["total"] > 0  # the kimi-k3 plan's figure at this row length, W = 1
    assert store["finite"] and store["resident_max"] <= 2 and store["staging"]["objects"] == store["grad_accum"]
    assert all(v["efficient"]["finite"] for k, v in attn.items() if k.startswith("S="))
    assert h2d["host_clone_gib_s"] > 0 and h2d["staging"]["host_copies"] == h2d["staging"]["objects"] > 0
    assert train["ok"] and train["loss_last"] < train["loss_first"]
    assert recs["summary"]["ok"] and set(recs["summary"]["summary"]) == {"imports", *(r for r in recs if r not in (
        "summary", "imports"))}
