"""Build the bundled prompt subset in `data/prompts/` from `../shared/data/prompts/` (run once; outputs committed).

    .venv/bin/python data/prompts/build_bundle.py

Each file keeps the first N rows of its shared source in the source's own format (JSON lines stay JSON lines,
JSON lists stay lists, BBH-style objects keep their wrapper), so every row shape is exercised. It also writes
`kimi_mtp_sample/`: a `datasets.save_to_disk` directory in the kimi-mtp-dataset shape (see
`kimi_mtp_rows`), built from the same bundled prompts. Provenance: SOURCES.md beside this file.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[2] / "shared" / "data" / "prompts"

# (shared path, rows kept; None = whole file)
SUBSET = [
    ("fastchat_mt_bench/question.jsonl", None),
    ("fastchat_dummy_conversation/dummy_conversation.json", 40),
    ("arena_hard_v0.1/question.jsonl", 120),
    ("m_ifeval/en_input_data.jsonl", 80),
    ("m_ifeval/es_input_data.jsonl", 60),
    ("gpteacher/codegen-instruct.sample1000.json", 100),
    ("gpteacher/roleplay-simple-deduped-roleplay-instruct.json", 60),
    ("gsm8k/train.sample3000.jsonl", 150),
    ("math/test.sample2000.jsonl", 100),
    ("humaneval/HumanEval.jsonl", 40),
    ("mbpp/mbpp.jsonl", 100),
    ("swe_bench_lite/test.sample150.jsonl", 10),
    ("bfcl_v4/BFCL_v4_simple_python.json", 80),
    ("bfcl_v4/BFCL_v4_parallel_multiple.json", 40),
    ("bfcl_v4/BFCL_v4_multi_turn_base.json", 30),
    ("bfcl_v4/multi_turn_func_doc/*.json", None),
    ("llamafactory_toolcall/glaive_toolcall_en_demo.json", 80),
    ("llamafactory_toolcall/glaive_toolcall_zh_demo.json", 40),
    ("belle_eval/eval_set.jsonl", 150),
    ("mt_bench_zh/question.jsonl", None),
    ("gaokao_bench/Objective_Questions/2010-2022_Math_I_MCQs.json", 40),
    ("mt_bench_multilingual/de/question.jsonl", 40),
    ("mt_bench_multilingual/jp/question.jsonl", 40),
    ("mt_bench_multilingual/hindi/question.jsonl", 40),
    ("mgsm/mgsm_de.tsv", 80),
    ("mgsm/mgsm_ja.tsv", 80),
    ("mgsm/mgsm_sw.tsv", 80),
]


def copy_subset(rel: str, n: int | None) -> None:
    for src in sorted(SHARED.glob(rel)):
        dst = HERE / src.relative_to(SHARED)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if n is None:
            shutil.copyfile(src, dst)
            continue
        text = src.read_text(encoding="utf-8")
        if src.suffix in (".jsonl", ".tsv") or (text.lstrip()[:1] == "{" and "\n{" in text and not text.lstrip().startswith("{\n")):
            lines = [ln for ln in text.splitlines() if ln.strip()][:n]
            dst.write_text("\n".join(lines) + "\n", encoding="utf-8")
            continue
        obj = json.loads(text)
        if isinstance(obj, list):
            obj = obj[:n]
        else:
            key = max((k for k, v in obj.items() if isinstance(v, list)), key=lambda k: len(obj[k]))
            obj[key] = obj[key][:n]
        dst.write_text(json.dumps(obj, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


def _kimi_call_text(text: str, calls: list[tuple[str, str]]) -> str:
    """Assistant text with Kimi tool markers (`functions.NAME:IDX` ids, JSON arguments)."""
    body = "".join(
        f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{args}<|tool_call_end|>"
        for i, (name, args) in enumerate(calls)
    )
    return f"{text}<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def kimi_mtp_rows() -> list[dict]:
    """Rows in the kimi-mtp-dataset shape: `conversations: [{from, value}]`, `source`, optional `tools` (JSON).

    Made from the bundled prompts: plain and multi-turn chats with assistant turns, system prompts, glaive
    tool-call conversations re-encoded with Kimi tool markers and `tool` turns, and user turns holding a JSON
    string of OpenAI content parts (text + image, and image only).
    """
    rows: list[dict] = []

    def jl(rel):
        return [json.loads(x) for x in (HERE / rel).read_text(encoding="utf-8").splitlines() if x.strip()]

    for r in jl("gsm8k/train.sample3000.jsonl")[:40]:
        rows.append({"source": "math", "conversations": [
            {"from": "human", "value": r["question"]}, {"from": "gpt", "value": r["answer"]}]})
    for r in jl("arena_hard_v0.1/question.jsonl")[:30]:
        rows.append({"source": "chat", "conversations": [
            {"from": "system", "value": "You are Kimi, an AI assistant created by Moonshot AI."},
            {"from": "human", "value": r["turns"][0]["content"]}, {"from": "gpt", "value": "(original answer)"}]})
    for r in jl("fastchat_mt_bench/question.jsonl")[:20]:
        rows.append({"source": "chat", "conversations": [
            {"from": "human", "value": r["turns"][0]}, {"from": "gpt", "value": "(first answer)"},
            {"from": "human", "value": r["turns"][1]}, {"from": "gpt", "value": "(second answer)"}]})
    for r in jl("mbpp/mbpp.jsonl")[:30]:
        rows.append({"source": "code", "conversations": [
            {"from": "human", "value": r["text"]}, {"from": "gpt", "value": "```python\n" + r["code"] + "\n```"}]})
    for r in jl("belle_eval/eval_set.jsonl")[:30]:
        rows.append({"source": "zh_chat", "conversations": [
            {"from": "human", "value": r["question"]}, {"from": "gpt", "value": r["std_answer"]}]})
    glaive = json.loads((HERE / "llamafactory_toolcall/glaive_toolcall_en_demo.json").read_text(encoding="utf-8"))
    for r in glaive:
        turns = r["conversations"]
        if not any(t["from"] == "function_call" for t in turns):
            continue
        tools = [{"type": "function", "function": t} for t in json.loads(r["tools"])]
        conv = []
        for t in turns:
            if t["from"] == "function_call":
                call = json.loads(t["value"])
                text = _kimi_call_text("", [(call["name"], json.dumps(call["arguments"], ensure_ascii=False))])
                conv.append({"from": "gpt", "value": text})
            elif t["from"] == "observation":
                conv.append({"from": "tool", "value": t["value"]})
            else:
                conv.append({"from": t["from"], "value": t["value"]})
        rows.append({"source": "tool_agent", "conversations": conv, "tools": json.dumps(tools, ensure_ascii=False)})
        if len(rows) > 200:
            break
    for i, r in enumerate(jl("m_ifeval/en_input_data.jsonl")[:10]):
        parts = [{"type": "text", "text": "Look at the attached image first. " + r["prompt"]},
                 {"type": "image_url", "image_url": {"url": f"https://example.com/images/{i}.png"}}]
        rows.append({"source": "vision", "conversations": [
            {"from": "human", "value": json.dumps(parts)}, {"from": "gpt", "value": "(answer about the image)"}]})
    for i in range(5):
        parts = [{"type": "image_url", "image_url": {"url": f"https://example.com/images/only-{i}.png"}}]
        rows.append({"source": "vision", "conversations": [
            {"from": "human", "value": json.dumps(parts)}, {"from": "gpt", "value": "(caption)"}]})
    for r in jl("mt_bench_multilingual/de/question.jsonl")[:20]:
        rows.append({"source": "multilingual_chat", "conversations": [
            {"from": "human", "value": r["turns"][0]}, {"from": "gpt", "value": "(Antwort)"}]})
    for row in rows:
        row.setdefault("tools", None)
    return rows


def write_kimi_sample(path: Path) -> None:
    import datasets

    if path.exists():
        shutil.rmtree(path)
    datasets.Dataset.from_list(kimi_mtp_rows()).save_to_disk(str(path))


def main() -> int:
    if not SHARED.is_dir():
        print(f"{SHARED} not found", file=sys.stderr)
        return 1
    for rel, n in SUBSET:
        copy_subset(rel, n)
    write_kimi_sample(HERE / "kimi_mtp_sample")
    return 0


if __name__ == "__main__":
    sys.exit(main())
