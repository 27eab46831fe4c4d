"""The run's trained draft measured as a user measures a served one: two llama.cpp servers started as their own
processes (the exported draft on one's command line, the target alone on the other's), then `regen engine-eval
--endpoint ... --baseline-endpoint ...` over the held-out cells and the named benchmark sets.

    .venv/bin/python -P bench/served_endpoint.py --run runs/local [--profile local] [--draft STEP_DIR]
        [--concurrency 1,2] [--benchmark humaneval,fastchat_mt_bench] [--num-prompts 24] [--max-new-tokens 64]
        [--set generate.temperature=0]

The servers are `python -m regen.target.llama_cpp` (llama.cpp's own C++ server through xllamacpp) on loopback, the
q8_0 engine GGUF of `serve.model_dir`, `--parallel` the highest concurrency, `--draft-n-max` the draft's block size;
they are stopped on exit. Everything else is `regen engine-eval`'s endpoint path (regen.serve.engines.endpoint_eval):
the engine's own `/metrics` counters, per cell and per benchmark set, acc_len per round and per request, tokens/s and
the speedup over the baseline server at each concurrency; its table and `<run>/engine-eval-endpoint.json` are the
figures, with regen's own replay of the same held-out cell beside each (`regen eval acc_len`, from the run's
eval.json). Machine and load are printed: the figures hold only when nothing else runs beside it.
"""
from __future__ import annotations

import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
from _preamble import ROOT, sibling  # noqa: E402 - bench/ off sys.path, the repository root first, HF offline

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


def server_commands(gguf, template, alias: str, *, parallel: int, ctx_per_slot: int, threads: int, draft=None,
                    block_size: int = 7) -> list[tuple[list[str], int]]:
    """The two llama.cpp command lines a user runs, each with a free loopback port: [(the target with `draft` at
    `block_size` draft tokens a round, port), (the target alone, port)]."""
    from regen.target.server import free_port

    out = []
    for d in (draft, None):
        port = free_port()
        cmd = [sys.executable, "-m", "regen.target.llama_cpp", "--gguf", str(gguf), "--alias", alias,
               "--template", str(template), "--port", str(port), "--parallel", str(parallel),
               "--ctx-per-slot", str(ctx_per_slot), "--threads", str(threads), "--poll", "0"]
        if d is not None:
            cmd += ["--draft", str(d), "--draft-n-max", str(block_size)]
        out.append((cmd, port))
    return out


@contextlib.contextmanager
def llama_cpp_servers(cmds: list[list[str]], logs: Path, ready_s: float = 180.0):
    """Each command started as its own process (stdout+stderr to `logs/server-i.log`), waited for until its
    `/v1/models` answers; yields their base URLs; terminates (then kills) every one on exit. Raises RuntimeError
    naming the log when a server exits or is not ready within `ready_s` seconds."""
    import httpx

    procs, urls = [], []
    try:
        for i, (cmd, port) in enumerate(cmds):
            log = (logs / f"server-{i}.log").open("w")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
            urls.append(f"http://127.0.0.1:{port}")
        for i, (url, proc) in enumerate(zip(urls, procs)):
            t0 = time.monotonic()
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"llama.cpp server {url} exited with {proc.returncode}: see "
                                       f"{logs / f'server-{i}.log'}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                        break
                if time.monotonic() - t0 > ready_s:
                    raise RuntimeError(f"llama.cpp server {url} not ready in {ready_s:.0f} s: see {logs}")
                time.sleep(0.25)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--profile", default="local")
    ap.add_argument("--draft", default=None, help="a step folder (default: the run's latest)")
    ap.add_argument("--concurrency", default="1,2")
    ap.add_argument("--benchmark", default="humaneval,fastchat_mt_bench")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="each server's threads")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()

    from regen.cli import main as regen_main
    from regen.config import load_profile, resolve_path
    from regen.rundir import RunDir
    from regen.serve.engines.spec_eval import ensure_engine_gguf, export_for_llama_cpp
    from regen.target.llama_cpp import served_template
    from regen.train.checkpoint import find_draft
    from regen.train.draft_config import DSparkConfig

    profile = load_profile(args.profile, args.set)
    run = RunDir.at(args.run)
    step = find_draft(args.draft or run.train)
    K = DSparkConfig.from_json(step / "config.json").block_size
    model_dir = resolve_path(profile.serve.model_dir)
    tmp = Path(tempfile.mkdtemp(prefix="bench-endpoint-"))
    ensure_engine_gguf(profile.serve, "q8_0", log=lambda *_: None)
    gguf = model_dir / "engine-q8_0.gguf"
    draft, _ = export_for_llama_cpp(profile, run, step, out=tmp / "export", log=lambda *_: None)
    template = tmp / "template.jinja"
    template.write_text(served_template(model_dir))
    cmds = server_commands(gguf, template, profile.generate.model, draft=draft, block_size=K,
                           parallel=max(int(c) for c in args.concurrency.split(",")),
                           ctx_per_slot=profile.serve.ctx_per_slot, threads=args.threads)
    print(json.dumps({"machine": sibling("spec_decode").cpu_line(), "draft": str(step), "block_size": K,
                      "servers": [c for c, _ in cmds]}), flush=True)
    t0 = time.perf_counter()
    with llama_cpp_servers(cmds, tmp) as (with_draft_url, alone_url):
        argv = ["engine-eval", "--profile", args.profile, "--run", str(run.root), "--endpoint", with_draft_url,
                "--baseline-endpoint", alone_url, "--concurrency", args.concurrency, "--benchmark", args.benchmark]
        argv += [a for kv in args.set for a in ("--set", kv)]
        if args.draft:
            argv += ["--draft", args.draft]
        if args.num_prompts:
            argv += ["--num-prompts", str(args.num_prompts)]
        if args.max_new_tokens:
            argv += ["--max-new-tokens", str(args.max_new_tokens)]
        print("regen " + " ".join(argv), flush=True)
        status = regen_main(argv)
    print(f"\n{time.perf_counter() - t0:.0f} s; load average after: {os.getloadavg()}; server logs in {tmp}")
    return status


if __name__ == "__main__":
    sys.exit(main())
