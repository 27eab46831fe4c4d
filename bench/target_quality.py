"""Compare embedded targets on what the demo needs: finished answers, answer quality, training cost.

    # finish-reason mix of a run's generations, and the share that would end with `stop` at smaller budgets
    .venv/bin/python -P bench/target_quality.py finish --run runs/x [--budgets 64,128,256,384,512]
    # gsm8k exact match on the first N bundled problems (data/prompts/gsm8k), greedy, served by the model
    .venv/bin/python -P bench/target_quality.py gsm8k --model-dir data/models/smollm2-135m [--n 20] [--max-tokens 384]
    # the trainer's per-token cost of the target: a forward pass with hidden states, bf16, CPU seconds per token
    .venv/bin/python -P bench/target_quality.py train-forward --model-dir data/models/smollm2-135m

`finish`: decoding is greedy, so an answer generated with budget M is the prefix of length N of it under a budget
N < M: a first-turn answer ends with `stop` under budget N iff it ended with `stop` within N tokens under M
(`stop_share_at`, first turns only; later turns depend on the earlier answers). Also the response filters'
pass rates (repetition, compression, language: `filters.response`) over the ok rows.
`gsm8k`: the reference is the number after `####`; the model's answer is the last number in its text (commas
dropped); exact match of the two as numbers.
Every line carries the 1-minute load average (the machine is shared) and CPU seconds where they apply.
"""
from __future__ import annotations

import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
import _preamble  # noqa: E402, F401 - bench/ off sys.path, the repository root first, HF offline

import argparse
import asyncio
import json
import re
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from regen.config import REPO_ROOT

GSM8K = REPO_ROOT / "data" / "prompts" / "gsm8k" / "train.sample3000.jsonl"
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def read_generations(run: Path) -> list[dict]:
    """The run's generation rows: `generations/part-*.parquet` plus rows journaled but not yet flushed
    (`journal-*.jsonl`, so a generate stage still running can be read); one row per (prompt_id, turn)."""
    gen = run / "generations"
    cols = ["prompt_id", "turn", "status", "error_class", "finish_reason", "num_completion_tokens", "content",
            "messages", "category", "language", "tool_calls", "reasoning_content", "num_prompt_tokens"]
    rows = {}
    for f in sorted(gen.glob("part-*.parquet")):
        t = pq.read_table(f)
        for r in t.select([c for c in cols if c in t.column_names]).to_pylist():
            rows[(r["prompt_id"], r["turn"])] = r
    for f in sorted(gen.glob("journal-*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a line being written
            rows.setdefault((r.get("prompt_id"), r.get("turn")), {c: r.get(c) for c in cols})
    if not rows:
        raise SystemExit(f"no generation rows under {gen}")
    return list(rows.values())


def stop_share_at(rows: list[dict], budgets: list[int]) -> dict[int, float]:
    """{budget: share of first-turn ok rows that end with `stop` within `budget` completion tokens}."""
    first = [r for r in rows if r["status"] == "ok" and r["turn"] == 0]
    if not first:
        return {}
    return {b: round(sum(r["finish_reason"] == "stop" and (r["num_completion_tokens"] or 0) <= b for r in first)
                     / len(first), 3) for b in budgets}


def filter_pass_rates(rows: list[dict]) -> dict[str, float]:
    from filters.response import make_response_filters

    ok = [r for r in rows if r["status"] == "ok"]
    out = {}
    for f in make_response_filters(["repetition", "compression", "language"], {}):
        out[f.name] = round(sum(f.keep(f.score(r)) for r in ok) / max(1, len(ok)), 3)
    return out


def cmd_finish(args) -> dict:
    rows = read_generations(Path(args.run))
    ok = [r for r in rows if r["status"] == "ok"]
    budgets = [int(b) for b in args.budgets.split(",")]
    lengths = sorted(r["num_completion_tokens"] or 0 for r in ok)
    stopped = [r for r in ok if r["finish_reason"] == "stop"]
    by_cat: dict[str, Counter] = {}
    for r in ok:
        by_cat.setdefault(r["category"], Counter())[r["finish_reason"]] += 1
    return {
        "run": args.run, "rows": len(rows), "status": dict(Counter(r["status"] for r in rows)),
        "finish_reason": dict(Counter(r["finish_reason"] for r in ok)),
        "stop_share": round(len(stopped) / max(1, len(ok)), 3),
        "stop_share_at": stop_share_at(rows, budgets),
        "by_category": {c: dict(v) for c, v in sorted(by_cat.items())},
        "completion_tokens_p50_p90_max": [lengths[len(lengths) // 2], lengths[int(len(lengths) * 0.9)], lengths[-1]]
        if lengths else [],
        "filter_pass": filter_pass_rates(rows),
    }


def extract_number(text: str) -> float | None:
    nums = NUMBER.findall(text or "")
    if not nums:
        return None
    try:
        return float(nums[-1].replace(",", "").rstrip("."))
    except ValueError:
        return None


def gsm8k_problems(n: int) -> list[tuple[str, float]]:
    out = []
    with open(GSM8K, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            out.append((row["question"], float(row["answer"].split("####")[-1].strip().replace(",", ""))))
            if len(out) == n:
                break
    return out


def cmd_gsm8k(args) -> dict:
    import httpx
    import psutil

    from regen.config.serve import ServeConfig
    from regen.target.server import EmbeddedTarget

    problems = gsm8k_problems(args.n)
    cfg = ServeConfig(model_dir=args.model_dir, cb_num_blocks=args.cb_num_blocks, cb_max_batch_tokens=512)

    async def ask(client, url, model, sem, question):
        async with sem:
            body = {"model": model, "max_tokens": args.max_tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": question + "\nGive the final answer as a number."}]}
            r = await client.post(url, json=body, timeout=1800)
            r.raise_for_status()
            return r.json()

    with EmbeddedTarget(cfg) as target:
        proc = psutil.Process(target.pid)
        cpu0, t0 = sum(proc.cpu_times()[:2]), time.perf_counter()

        async def run_all():
            sem = asyncio.Semaphore(args.in_flight)
            async with httpx.AsyncClient() as client:
                return await asyncio.gather(*(ask(client, target.base_url + "/chat/completions", target.model,
                                                  sem, q) for q, _ in problems))

        replies = asyncio.run(run_all())
        wall, cpu = time.perf_counter() - t0, sum(proc.cpu_times()[:2]) - cpu0
    correct, finish, tokens = 0, Counter(), 0
    for (_, ref), rep in zip(problems, replies):
        choice = rep["choices"][0]
        finish[choice["finish_reason"]] += 1
        tokens += rep["usage"]["completion_tokens"]
        got = extract_number(choice["message"].get("content") or "")
        correct += got is not None and abs(got - ref) < 1e-6
    return {"model": Path(args.model_dir).name, "problems": len(problems), "exact_match": correct,
            "accuracy": round(correct / len(problems), 3), "finish_reason": dict(finish), "output_tokens": tokens,
            "wall_s": round(wall, 1), "server_cpu_s_per_token": round(cpu / max(1, tokens), 4), "load_avg": _load()}


def cmd_train_forward(args) -> dict:
    """The target's share of a training step: forward with every hidden state, batch 2 x 192, bf16, no grad."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16).eval()
    cfg = model.config
    ids = torch.randint(100, cfg.vocab_size - 1, (2, 192))
    with torch.no_grad():
        model(input_ids=ids, output_hidden_states=True)  # warm-up
        cpu0, t0 = time.process_time(), time.perf_counter()
        for _ in range(args.repeats):
            model(input_ids=ids, output_hidden_states=True)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    n = args.repeats * ids.numel()
    return {"model": Path(args.model_dir).name, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
            "vocab": cfg.vocab_size, "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
            "lm_head_macs_per_token_m": round(cfg.hidden_size * cfg.vocab_size / 1e6, 1),
            "forward_cpu_s_per_1k_tokens": round(1000 * cpu / n, 3), "forward_ms_per_step": round(1000 * wall / args.repeats),
            "threads": torch.get_num_threads(), "load_avg": _load()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("finish", help="finish-reason mix of a run's generations")
    f.add_argument("--run", required=True)
    f.add_argument("--budgets", default="64,128,192,256,384,512")
    g = sub.add_parser("gsm8k", help="gsm8k exact match on bundled problems")
    g.add_argument("--model-dir", required=True)
    g.add_argument("--n", type=int, default=20)
    g.add_argument("--max-tokens", type=int, default=384)
    g.add_argument("--in-flight", type=int, default=10)
    g.add_argument("--cb-num-blocks", type=int, default=32)
    t = sub.add_parser("train-forward", help="target forward cost per token (training)")
    t.add_argument("--model-dir", required=True)
    t.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    out = {"finish": cmd_finish, "gsm8k": cmd_gsm8k, "train-forward": cmd_train_forward}[args.cmd](args)
    print(json.dumps(out, ensure_ascii=False))


if __name__ == "__main__":
    main()
