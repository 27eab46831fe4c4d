"""Does `regen eval` predict what the engine reports? A draft trained on the embedded target's own answers, measured
by regen (greedy; T = 1 under each served protocol: probabilistic or greedy drafting x token-level or block
verification) and by llama.cpp's server started as its own process, through `regen engine-eval --endpoint`'s path
(streamed chat requests, the engine's /metrics counters).

    .venv/bin/python -P bench/served_protocol.py [--steps 400] [--new-tokens 48] [--repeats 3] [--out FILE]

The data and training follow tests/serve/test_spec_roundtrip.py (8 prompts, the target's greedy continuation of each,
a one-sample overfit: SpecForge's serving gate), served beside the f32 target (the trainer's exact weights). llama.cpp
drafts greedily and verifies against a one-hot draft (launch.json `verification`: greedy + standard), so at T = 1 its
figure is to be compared with regen's `greedy+standard`; at T = 0 with regen's greedy replay. Acceptance only: the
machine's other work does not change it (timings are not reported).
"""
from __future__ import annotations

import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
from _preamble import ROOT  # noqa: E402 - bench/ off sys.path, the repository root first, HF offline

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "train"))

PROMPTS = ["Write a short poem about the sea.", "Explain what a binary search does.",
           "List three uses of a paperclip.", "What is the capital of France? Answer in one sentence.",
           "Give me a tip for learning to cook.", "Describe a sunset in two sentences.",
           "Why is the sky blue?", "Write a haiku about winter."]
PROTOCOLS = [("probabilistic", "standard"), ("probabilistic", "block"), ("greedy", "standard"), ("greedy", "block")]


def overfit_run(root: Path, model_dir: Path, new_tokens: int):
    import torch
    from train_helpers import ShardWriter
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows, prompts = [], []
    for i, text in enumerate(PROMPTS):
        ids = list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"])
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens + 16, do_sample=False,
                                 pad_token_id=tok.eos_token_id)[0].tolist()
        rows.append({"sample_id": f"s{i}", "prompt_id": f"p{i}", "turn": 0, "category": "general", "language": "en",
                     "input_ids": out, "loss_spans": [{"start": len(ids), "end": len(out)}], "num_tokens": len(out),
                     "num_loss_tokens": len(out) - len(ids)})
        prompts.append({"prompt_id": f"p{i}", "category": "general", "prompt_ids": ids,
                        "messages": [{"role": "user", "content": text}]})
    ShardWriter(root / "run").add(rows, complete=True)
    return root / "run", prompts


def train(root: Path, run: Path, model_dir: Path, steps: int) -> Path:
    from train_helpers import write_profile

    from regen.config import load_profile
    from regen.rundir import RunDir
    from regen.train.loop import run_train

    local = load_profile("local").train
    profile = write_profile(root / "p.yaml", model_dir, target_layer_ids=list(local.target_layer_ids),
                            mask_token_id=local.mask_token_id, attention_type=local.attention_type,
                            fc_norm=local.fc_norm, markov_rank=local.markov_rank, draft_vocab_size=1024,
                            num_anchors=64, max_len=192, max_tokens=384, max_batch=2, lr=1e-2, min_lr_frac=0.1,
                            max_steps=steps, log_every=100, dtype="float32", target_dtype="float32")
    out = RunDir.at(str(run))
    run_train(load_profile(str(profile)).train, out)
    from regen.train.checkpoint import find_draft

    return find_draft(out.train)


def regen_figures(step: Path, model_dir: Path, prompts, new_tokens: int, seeds) -> dict:
    from regen.train.draft_config import DSparkConfig
    from regen.train.eval import evaluate, evaluate_sampled
    from regen.train.model import load_draft
    from regen.train.target import TargetContract, TargetFeatures

    dcfg = DSparkConfig.from_json(step / "config.json")
    target = TargetFeatures.from_pretrained(model_dir, TargetContract.from_draft_config(dcfg), device="cpu")
    drafts = {"trained": load_draft(step, target_model=target.model).eval()}
    stop = sorted({*dcfg.eos_token_id, *([target.model.generation_config.eos_token_id]
                                         if isinstance(target.model.generation_config.eos_token_id, int) else
                                         (target.model.generation_config.eos_token_id or []))})
    out = {"greedy": evaluate(target, drafts, prompts, max_new_tokens=new_tokens, stop_ids=stop,
                              block_size=dcfg.block_size)["trained"]["acc_len"]}
    for dm, rm in PROTOCOLS:
        rounds = taus = 0
        for seed in seeds:
            r = evaluate_sampled(target, drafts, prompts, max_new_tokens=new_tokens, stop_ids=stop, temperature=1.0,
                                 seed=seed, draft_sample_method=dm, rejection_sample_method=rm)["trained"]
            rounds += r["num_rounds"]
            taus += r["acc_len"] * r["num_rounds"]
        out[f"T=1 {dm}+{rm}"] = round(taus / rounds, 4)
    target.close()
    return out


def engine_figures(step: Path, model_dir: Path, prompts, new_tokens: int, repeats: int, root: Path) -> dict:
    import httpx

    from regen.serve.engines import export_draft
    from regen.serve.engines.endpoint_eval import group_figures, run_group
    from regen.target.llama_cpp import served_template
    from regen.target.server import free_port

    rec = export_draft(step, "llama.cpp", root / "export", target_gguf=model_dir / "engine-f32.gguf",
                       target_path=str(model_dir))
    (root / "t.jinja").write_text(served_template(model_dir))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "regen.target.llama_cpp", "--gguf", str(model_dir / "engine-f32.gguf"),
                             "--alias", "smollm2-135m", "--template", str(root / "t.jinja"), "--port", str(port),
                             "--parallel", "1", "--ctx-per-slot", "1024", "--threads", "2",
                             "--draft", str(root / "export" / "draft-dspark.gguf"),
                             "--draft-n-max", str(rec["widths"]["block_size"])],
                            stdout=(root / "server.log").open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() - t0 > 180:
                raise SystemExit(f"llama.cpp did not start: {root / 'server.log'}")
            time.sleep(0.5)
        out = {}
        for name, temp, n in (("greedy", 0.0, 1), ("T=1", 1.0, repeats)):
            bodies = [{"model": "smollm2-135m", "messages": p["messages"], "temperature": temp, "top_p": 1.0,
                       "max_tokens": new_tokens} for p in prompts for _ in range(n)]
            f = group_figures(*run_group(url, bodies, 1, metrics_url=url + "/metrics", engine="llama.cpp"),
                              rec["widths"]["block_size"])
            out[name] = {k: f[k] for k in ("acc_len_per_round", "acc_len_per_request", "num_rounds", "num_requests")}
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3, help="T = 1: requests per prompt (engine) and seeds (regen)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from regen.config import resolve_path
    from regen.config.serve import ServeConfig

    model_dir = resolve_path(ServeConfig().model_dir)
    root = Path(tempfile.mkdtemp(prefix="served-protocol-"))
    t0 = time.time()
    run, prompts = overfit_run(root, model_dir, args.new_tokens)
    step = train(root, run, model_dir, args.steps)
    print(f"served_protocol: trained {step} in {time.time() - t0:.0f} s", flush=True)
    res = {"regen": regen_figures(step, model_dir, prompts, args.new_tokens, range(args.repeats)),
           "llama.cpp endpoint": engine_figures(step, model_dir, prompts, args.new_tokens, args.repeats, root),
           "prompts": len(prompts), "new_tokens": args.new_tokens, "repeats": args.repeats, "steps": args.steps,
           "elapsed_s": round(time.time() - t0)}
    print(json.dumps(res, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
