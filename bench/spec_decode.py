"""What the draft buys: the embedded target's tokens/s through llama.cpp alone, with the trained draft and with an
untrained draft of the same config, at one request and several in flight, in one run; per-position acceptance.

    .venv/bin/python -P bench/spec_decode.py --run runs/local [--profile local] [--draft STEP_DIR]
        [--prompts 16] [--max-new-tokens 64] [--in-flight 1,4] [--gguf-type q8_0] [--quick]

Every arm serves the local profile's target (regen.target.server.EmbeddedTarget, `serve.parallel` = the level) and
sends the run's held-out prompts as token ids (`/completion`, greedy, `--max-new-tokens` each); C workers keep C
requests in flight until every prompt is answered. Figures per (arm, level): decode tokens/s over the wall time of
the level (the sum of generated tokens / seconds from the first request to the last answer), acc_len from the
engine's `/metrics` counters (1 + accepted / drafts), accept rate per draft position, and the ratio to the target
alone at the same level. The trained draft is the run's latest step (regen export-draft --engine llama.cpp); the
untrained one is DSparkDraft.from_target on the same config and draft vocabulary, exported the same way.
Machine and load are printed: figures hold only when nothing else runs beside it. `--quick` (the test suite): 4
prompts, 16 tokens, levels 1 and 2.
"""
from __future__ import annotations

import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
import _preamble  # noqa: E402, F401 - bench/ off sys.path, the repository root first, HF offline

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402


def cpu_line() -> dict:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    return {"cpu": model, "cpus": os.cpu_count(), "load_average": os.getloadavg(),
            "flags": [f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")]}


def untrained_export(profile, step: Path, out: Path) -> Path:
    """An untrained draft of `step`'s config and draft vocabulary, exported for llama.cpp; returns the GGUF."""
    import torch
    from transformers import AutoModelForCausalLM

    from regen.config import resolve_path
    from regen.serve.engines import export_draft
    from regen.serve.engines.cli import default_target_gguf
    from regen.serve.engines.llama_cpp import GGUF_NAME
    from regen.train.model import DSparkDraft, load_draft, save_draft

    target = AutoModelForCausalLM.from_pretrained(resolve_path(profile.train.target), dtype=torch.float32)
    trained = load_draft(step, target_model=target)
    torch.manual_seed(0)
    save_draft(DSparkDraft.from_target(target, trained.config, draft_vocab=trained.draft_vocab()), out / "step")
    export_draft(out / "step", "llama.cpp", out / "export", target_gguf=default_target_gguf(profile),
                 target_path=profile.train.target)
    return out / "export" / GGUF_NAME


def measure(serve_cfg, prompts, max_new: int, level: int, gguf, block_size: int, log_path: Path) -> dict:
    from regen.serve.engines.llama_client import complete, spec_counters
    from regen.target.server import EmbeddedTarget

    cfg = serve_cfg.model_copy(update={"parallel": level})
    with EmbeddedTarget(cfg, log_path=log_path, draft=gguf, draft_n_max=block_size, log=lambda *_: None) as t:
        before = spec_counters(t.base_url)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(level) as pool:
            answers = list(pool.map(lambda p: complete(t.base_url, p["prompt_ids"], max_new), prompts))
        wall = time.perf_counter() - t0
        d = spec_counters(t.base_url) - before
    tokens = sum(len(a.tokens) for a in answers)
    per_pos = {str(k): round(d.accepted_per_pos.get(k, 0.0) / d.drafts, 4) if d.drafts else None
               for k in range(block_size)}
    return {"tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 2),
            "acc_len": round(1 + d.accepted / d.drafts, 4) if d.drafts else None, "drafts": d.drafts,
            "accept_rate_per_position": per_pos if d.drafts else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--profile", default="local")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--in-flight", default="1,4")
    ap.add_argument("--gguf-type", default="q8_0")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from regen.config import load_profile
    from regen.rundir import RunDir
    from regen.serve.engines.spec_eval import ensure_engine_gguf, export_for_llama_cpp
    from regen.train.checkpoint import find_draft
    from regen.train.draft_config import DSparkConfig
    from regen.train.eval import heldout_prompts

    if args.quick:
        args.prompts, args.max_new_tokens, args.in_flight = 4, 16, "1,2"
    profile = load_profile(args.profile)
    run = RunDir.at(args.run)
    step = find_draft(args.draft or run.train)
    K = DSparkConfig.from_json(step / "config.json").block_size
    from regen.train.heldout import eval_heldout_split

    held, _ = eval_heldout_split(run, profile.train.heldout_fraction, profile.train.heldout_per_cell,
                                 {"trained": step})
    prompts = heldout_prompts(run, held, args.prompts)
    levels = [int(x) for x in args.in_flight.split(",")]
    ensure_engine_gguf(profile.serve, args.gguf_type, log=lambda *_: None)
    serve = profile.serve.model_copy(update={"gguf_type": args.gguf_type})
    tmp = Path(tempfile.mkdtemp(prefix="bench-spec-"))
    trained, _ = export_for_llama_cpp(profile, run, step, out=tmp / "trained", log=lambda *_: None)
    arms = {"target alone": None, "trained draft": trained, "untrained draft": untrained_export(profile, step, tmp)}
    print(json.dumps({"machine": cpu_line(), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                      "levels": levels, "draft": str(step), "gguf_type": args.gguf_type}), flush=True)
    results = {}
    for level in levels:
        for name, gguf in arms.items():
            r = measure(serve, prompts, args.max_new_tokens, level, gguf, K, tmp / f"{name}-{level}.log")
            results.setdefault(name, {})[level] = r
            print(json.dumps({"arm": name, "in_flight": level, **r}), flush=True)
    print("\n| arm | in flight | tokens/s | ratio to target alone | acc_len | accept rate by position |")
    print("|---|---|---|---|---|---|")
    for name, by_level in results.items():
        for level, r in by_level.items():
            ratio = r["tokens_per_s"] / results["target alone"][level]["tokens_per_s"]
            pos = " ".join(f"{v:.2f}" for v in (r["accept_rate_per_position"] or {}).values()) or "-"
            acc = f"{r['acc_len']:.3f}" if r["acc_len"] else "-"
            print(f"| {name} | {level} | {r['tokens_per_s']:.1f} | {ratio:.2f}x | {acc} | {pos} |")
    print(f"\nload average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
