"""Are the llama.cpp engine's answers the trainer's target's? Prompt token ids, greedy top-1 and top-5 probabilities.

    .venv/bin/python -P bench/serve_agreement.py [--gguf-types q8_0,f32] [--prompts 16] [--tokens 32] [--quick]

For each engine GGUF type (written on demand by regen.target.gguf_weights, about 10 s each), the engine is started
as the pipeline starts it (regen.target.server.EmbeddedTarget, `serve.engine: llama.cpp`) and measured against
the trainer's target, `transformers` AutoModelForCausalLM on the model directory's fp32 `model.safetensors` (the
same source GGUF, dequantized):

1. prompt token ids: every selected prompt (first turn, with its tools) rendered by the engine (`POST
   /apply-template`, then `POST /tokenize` with special tokens parsed) against the renderer's prompt ids
   (regen.render.hf_template.HFTemplateRenderer: the template with the generation prompt, tokenized) - equal
   prompts / all;
2. greedy top-1: the engine answers each of `--prompts` prompts greedily (`temperature: 0`, `--tokens` tokens)
   with its top-5 log-probabilities (`logprobs`, `top_logprobs: 5`, computed by llama.cpp from the raw logits);
   the target reads the same prompt ids + the engine's tokens in one teacher-forced forward pass. `greedy_agreement`
   = share of answer positions where the target's argmax is the engine's token (the positions are fixed by the
   engine's own greedy path, so one early difference does not change the later positions compared);
3. the distribution: at the same positions, the target's probabilities of the engine's top-5 tokens against the
   engine's (`top5_prob_abs_diff_mean`, and the total-variation distance over those 5, `top5_tv_mean`), and the
   share of positions whose top-5 sets are equal.

Prints one JSON line per type and a SUMMARY line.
"""
from __future__ import annotations

import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
from _preamble import sibling  # noqa: E402 - bench/ off sys.path, the repository root first, HF offline

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402


def ensure_gguf(serve, qtype: str) -> Path:
    """The model directory's engine-<qtype>.gguf, written from the source GGUF when missing."""
    from regen.config import resolve_path
    from regen.target.gguf_weights import prepare_gguf
    from regen.target.prepare_model import MODELS, locate_gguf

    model_dir = resolve_path(serve.model_dir)
    spec = MODELS[model_dir.name]
    return prepare_gguf(model_dir, locate_gguf(spec, model_dir.parent / f".gguf-{spec.name}"), spec.sha256, qtype)


def prompt_ids_check(base: str, renderer, prompts: list[dict]) -> dict:
    """Engine template + tokenizer vs the renderer's prompt ids, per prompt (point 1 of the module doc)."""
    root = base.removesuffix("/v1")
    equal, first_bad = 0, None
    for i, p in enumerate(prompts):
        text = httpx.post(root + "/apply-template", json={"messages": p["messages"], "tools": p["tools"]},
                          timeout=60).json()["prompt"]
        ids = httpx.post(root + "/tokenize", json={"content": text, "add_special": False, "parse_special": True},
                         timeout=60).json()["tokens"]
        want = renderer.encode(renderer._text(p["messages"], p["tools"], True, {}))
        if ids == want:
            equal += 1
        elif first_bad is None:
            first_bad = {"prompt": i, "engine_len": len(ids), "renderer_len": len(want)}
    return {"prompt_ids_equal": equal, "prompts": len(prompts), "first_difference": first_bad}


def greedy_check(target, model, renderer, prompts: list[dict], tokens: int) -> dict:
    """Greedy top-1 and top-5 probabilities, engine vs the target (points 2 and 3 of the module doc)."""
    import torch

    agree = positions = same_top5 = 0
    abs_diff, tv = [], []
    for p in prompts:
        body = {"model": target.model, "messages": p["messages"], "max_tokens": tokens, "temperature": 0,
                "logprobs": True, "top_logprobs": 5}
        if p["tools"]:
            body["tools"] = p["tools"]
        out = httpx.post(target.base_url + "/chat/completions", json=body, timeout=600).json()
        steps = (out["choices"][0].get("logprobs") or {}).get("content") or []
        if not steps:
            continue
        prompt_ids = renderer.encode(renderer._text(p["messages"], p["tools"], True, {}))
        gen = [s["id"] for s in steps]
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + gen])).logits[0, len(prompt_ids) - 1: len(prompt_ids) - 1 + len(gen)]
        probs = torch.softmax(logits.float(), dim=-1)
        for j, s in enumerate(steps):
            positions += 1
            agree += int(probs[j].argmax().item() == s["id"])
            top = [(t["id"], math.exp(t["logprob"])) for t in s["top_logprobs"]]
            mine = [probs[j, tid].item() for tid, _ in top]
            abs_diff.append(sum(abs(a - b) for (_, a), b in zip(top, mine)) / len(top))
            tv.append(0.5 * sum(abs(a - b) for (_, a), b in zip(top, mine)))
            same_top5 += int({tid for tid, _ in top} == set(probs[j].topk(len(top)).indices.tolist()))
    return {"positions": positions, "greedy_agreement": round(agree / positions, 4) if positions else None,
            "top5_same_set": round(same_top5 / positions, 4) if positions else None,
            "top5_prob_abs_diff_mean": round(sum(abs_diff) / len(abs_diff), 5) if abs_diff else None,
            "top5_tv_mean": round(sum(tv) / len(tv), 5) if tv else None}


def main(argv: list[str] | None = None) -> int:
    from regen.config import load_profile, resolve_path
    from regen.render.hf_template import HFTemplateRenderer
    from regen.target.server import EmbeddedTarget
    bench_prompts, cpu_line = sibling("serve_target").bench_prompts, sibling("serve_target").cpu_line

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf-types", default="q8_0,f32")
    ap.add_argument("--prompts", type=int, default=16, help="prompts answered greedily")
    ap.add_argument("--check-prompts", type=int, default=128, help="prompts whose token ids are compared")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="q8_0 only, 2 prompts, 8 tokens, 16 prompt checks")
    args = ap.parse_args(argv)
    serve = load_profile("local").serve.model_copy(update={"engine": "llama.cpp", "parallel": 4})
    types = ["q8_0"] if args.quick else [t.strip() for t in args.gguf_types.split(",") if t.strip()]
    checked = bench_prompts(16 if args.quick else args.check_prompts)
    greedy = checked[: 2 if args.quick else args.prompts]
    tokens = 8 if args.quick else args.tokens
    model_dir = resolve_path(serve.model_dir)
    renderer = HFTemplateRenderer(model_dir)
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32).eval()
    print(json.dumps({**cpu_line(), "target": str(model_dir / "model.safetensors"), "dtype": "float32",
                      "greedy_prompts": len(greedy), "tokens": tokens}), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="regen-agreement-") as tmp:
        for qtype in types:
            ensure_gguf(serve, qtype)
            cfg = serve.model_copy(update={"gguf_type": qtype})
            t0 = time.perf_counter()
            with EmbeddedTarget(cfg, log_path=Path(tmp) / f"{qtype}.log") as target:
                row = {"gguf_type": qtype, "ready_s": round(time.perf_counter() - t0, 1),
                       **prompt_ids_check(target.base_url, renderer, checked),
                       **greedy_check(target, model, renderer, greedy, tokens)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("SUMMARY " + json.dumps({"agreement": rows}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
