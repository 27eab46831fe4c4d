"""Benchmark: render + mask + shard write vs plain tiktoken encoding of the same text, tokens/s per core.

    .venv/bin/python bench/render.py [--quick] [--rows N] [--renderer kimi-k3|hf] [--tokenizer DIR]

Rows: N generation rows built from the bundled prompt texts (`data/pool`: English, Chinese,
code, tool schemas), deterministic (seed 0): a user prompt, long reasoning, an answer, some with history and
tool calls; as dicts, the way `regen.render.stage` reads them from `generations/part-*.parquet`.

Measured in one process (CPU time, so "per core"), in the same run, interleaved `--repeat` times (best of each,
the machine is shared):
  baseline  `tiktoken.Encoding.encode(text, allowed_special="all")` of each row's rendered text (the whole
            conversation as one string), with the renderer's own Encoding (Kimi-K3: the test vocabulary unless
            --tokenizer names a real checkpoint)
  render    `RowRenderer.sample` (conversation rebuild, checks, segment rendering, mask spans, sample_id) +
            `ShardWriter` (Arrow conversion, zstd Parquet, fsync, sha256) for every row
  stage     `regen.render.stage.run_render` end to end on the same rows in Parquet (loading the tokenizer, reading,
            sorting, checkpoints, manifest), response filters off, then with the default filters (reported, not
            in the ratio)
With `--renderer hf` the baseline is the Hugging Face tokenizer's own encoding of the rendered text.
Ratio = render tokens/s / baseline tokens/s (goal >= 0.7).
"""
from __future__ import annotations

import os  # os and sys: loaded when Python starts, nothing in bench/ can shadow them
import sys

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: _preamble (a test imports by path)
from _preamble import ROOT  # noqa: E402 - bench/ off sys.path, the repository root first, HF offline

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "render"))
PROMPTS = ROOT / "data" / "pool"


def corpus(limit_chars: int = 3_000_000) -> list[str]:
    """Strings of >= 40 chars from the bundled prompt files (an even share per file), else a fallback text."""
    files = sorted(p for p in PROMPTS.rglob("*") if p.suffix in (".json", ".jsonl"))
    texts: list[str] = []

    def walk(x):
        if isinstance(x, str):
            if len(x) >= 40:
                texts.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    share = limit_chars // max(1, len(files))
    for f in files:
        before, size = len(texts), 0
        try:
            raw = f.read_text(encoding="utf-8")
            items = [json.loads(line) for line in raw.splitlines() if line.strip()] if f.suffix == ".jsonl" else [json.loads(raw)]
        except (ValueError, UnicodeDecodeError):
            continue
        for item in items:
            walk(item)
            size = sum(len(t) for t in texts[before:])
            if size >= share:
                break
    return texts or ["The quick brown fox jumps over the lazy dog. " * 20]


def make_rows(n: int, texts: list[str]) -> list[dict]:
    from render_fixtures import generation_row

    rng = random.Random(0)
    pick = lambda k: "\n\n".join(rng.choice(texts) for _ in range(k))  # noqa: E731
    rows = []
    for i in range(n):
        user = {"role": "user", "content": pick(1)}
        if i % 4 == 3:  # a second turn with history
            history = [user, {"role": "assistant", "content": pick(2), "reasoning_content": pick(3)},
                       {"role": "user", "content": pick(1)}]
            rows.append(generation_row(f"b{i:06d}", 1, history, content=pick(3), reasoning_content=pick(8)))
        elif i % 4 == 2:  # a tool call
            call = {"id": f"c{i}", "type": "function",
                    "function": {"name": "search", "arguments": json.dumps({"query": pick(1)[:200], "k": 5})}}
            rows.append(generation_row(f"b{i:06d}", 0, [user], content=pick(1), reasoning_content=pick(6),
                                       tool_calls=[call]))
        else:
            rows.append(generation_row(f"b{i:06d}", 0, [user], content=pick(4), reasoning_content=pick(10)))
    return rows


def cpu() -> float:
    return time.process_time()


def bench(args) -> dict:
    from render_fixtures import write_generations

    from regen.config.render import RenderConfig
    from regen.render.rows import RowRenderer, conversation_of
    from regen.render.shards import ShardWriter
    from regen.render.stage import make_renderer, run_render
    from regen.rundir import RunDir

    kwargs = {"thinking": True, "thinking_effort": "max"} if args.renderer == "kimi-k3" else {}
    cfg = RenderConfig(renderer=args.renderer, tokenizer=args.tokenizer, template_kwargs=kwargs, max_tokens=10**9,
                       shard_max_tokens=50_000_000)
    renderer = make_renderer(cfg)
    if args.renderer == "kimi-k3":
        encoding = renderer.tokenizer.encoding
        encode = lambda text: encoding.encode(text, allowed_special="all")  # noqa: E731
    else:
        tk = renderer.tokenizer
        encode = lambda text: tk(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows = make_rows(args.rows, corpus())
    texts = []
    for row in rows:
        messages, tools = conversation_of(row)
        texts.append(renderer.render(messages, tools, **kwargs, add_generation_prompt=False).text)
    encode(texts[0])  # warm

    def baseline() -> tuple[int, float]:
        t0 = cpu()
        n = sum(len(encode(t)) for t in texts)
        return n, cpu() - t0

    tmp = Path(tempfile.mkdtemp(prefix="regen-bench-render-"))
    rr = RowRenderer(renderer, cfg, "bench")

    def render(rep: int) -> tuple[int, float]:
        writer = ShardWriter(tmp / f"shards-{rep}", max_rows=cfg.shard_max_rows, max_tokens=cfg.shard_max_tokens)
        t0 = cpu()
        n = 0
        for row in rows:
            s = rr.sample(row)
            n += s["num_tokens"]
            if not writer.fits(s):
                writer.flush()
            writer.add(s)
        writer.flush()
        return n, cpu() - t0

    try:
        writer = ShardWriter(tmp / "warm", max_rows=10, max_tokens=10**9)  # warm Arrow/Parquet and the caches
        for row in rows[:20]:
            writer.add(rr.sample(row))
        writer.flush()
        base_runs, render_runs = [], []
        for rep in range(args.repeat):  # interleaved, best of each: the machine is shared
            base_runs.append(baseline())
            render_runs.append(render(rep))
        base_tokens, base_s = min(base_runs, key=lambda x: x[1])
        tokens, render_s = min(render_runs, key=lambda x: x[1])
        write_generations(tmp / "run", rows, parts=4)
        stage = {}
        for label, filters in (("stage, no filters", []), ("stage + filters", RenderConfig().filters)):
            run = RunDir.at(tmp / "run")
            c = cfg.model_copy(update={"filters": filters})
            t0, w0 = cpu(), time.perf_counter()
            m = run_render(c, run, progress=False, force=True)
            stage[label] = (m["num_tokens"], cpu() - t0, time.perf_counter() - w0)  # incl. loading the tokenizer
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"rows": len(rows), "base": (base_tokens, base_s), "render": (tokens, render_s), "stage": stage,
            "runs": (base_runs, render_runs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small size (smoke)")
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved repetitions; the best of each is reported")
    ap.add_argument("--renderer", default="kimi-k3", choices=["kimi-k3", "hf"])
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (kimi-k3: default the test vocabulary)")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.repeat = 60, 1
    r = bench(args)
    base_tokens, base_s = r["base"]
    tokens, render_s = r["render"]
    base_rate, rate = base_tokens / base_s, tokens / render_s
    print(f"regen render bench: {r['rows']} rows, renderer {args.renderer}, 1 process (CPU seconds = per core)")
    plain = "tiktoken encode" if args.renderer == "kimi-k3" else "HF tokenizer   "
    print(f"  baseline  {plain} of the rendered text : {base_tokens:>11,} tokens {base_s:8.3f} s "
          f"{base_rate:>12,.0f} tokens/s/core")
    print(f"  render + mask + shard write (RowRenderer)      : {tokens:>11,} tokens {render_s:8.3f} s "
          f"{rate:>12,.0f} tokens/s/core")
    for label, (n, s, wall) in r["stage"].items():
        print(f"  {label:<46} : {n:>11,} tokens {s:8.3f} s {n / s:>12,.0f} tokens/s/core "
              f"(ratio {n / s / base_rate:.2f}, wall {wall:.2f} s)")
    ratios = [b[1] / r_[1] for b, r_ in zip(*r["runs"])]
    print(f"  ratio render / baseline: {rate / base_rate:.2f}  (goal >= 0.70; per repetition "
          f"{', '.join(f'{x:.2f}' for x in ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
