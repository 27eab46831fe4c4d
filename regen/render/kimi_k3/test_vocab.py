"""Build the project's small Kimi-K3-format TEST vocabulary (not Kimi's): byte-level BPE ranks trained on
bundled text with the real pre-tokenization regex, written as `tiktoken.model` + `tokenizer_config.json` with the
REAL control-token ids 163584-163839 (`shared/docs/kimi-k3-format.md` §4).

The real `tiktoken.model` cannot be downloaded here, so tests and the embedded demo use this one; the same loader
(`regen.render.kimi_k3.tokenizer.KimiTokenizer`) reads either. BPE ids differ from Kimi's; control ids and structure do not.

    python -m regen.render.kimi_k3.test_vocab --out data/tokenizers/kimi-k3-test --vocab-size 8192 FILE_OR_DIR...

Trainer: classic byte-level BPE over pre-tokenized words (Sennrich et al. 2016; GPT-2 byte level): ranks 0-255
are the single bytes, rank r >= 256 is the r-th merge, picked as the most frequent adjacent pair (ties: the
smaller byte string), with incremental pair counts and a lazy max-heap. Deterministic for a given input.
"""
from __future__ import annotations

import argparse
import base64
import heapq
import json
from collections import Counter, defaultdict
from pathlib import Path

from regen.render.kimi_k3.tokenizer import (
    CONTROL_BASE,
    NAMED_CONTROL_TOKENS,
    NUM_CONTROL_TOKENS,
    VOCAB_SIZE,
    pretokenize,
)

CORPUS_SUFFIXES = (".json", ".jsonl", ".txt", ".md")


def corpus_text(paths: list[str | Path], max_chars: int = 4_000_000) -> str:
    """Natural text from files or directories (recursively, sorted): string values of JSON / JSON-lines files,
    raw text otherwise; each file contributes at most max_chars / num_files characters (an even mix)."""
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(sorted(x for x in p.rglob("*") if x.suffix in CORPUS_SUFFIXES) if p.is_dir() else [p])
    out: list[str] = []
    per_file = max(max_chars // max(len(files), 1), 1)
    for f in files:
        raw = f.read_text(encoding="utf-8", errors="replace")
        if f.suffix in (".json", ".jsonl"):
            texts: list[str] = []
            docs = [raw] if f.suffix == ".json" else raw.splitlines()
            for doc in docs:
                try:
                    _strings(json.loads(doc), texts)
                except ValueError:
                    texts.append(doc)
            raw = "\n".join(texts)
        out.append(raw[:per_file])
    return "\n".join(out)


def _strings(value, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _strings(v, out)
    elif isinstance(value, list):
        for v in value:
            _strings(v, out)


def train_bpe(text: str, vocab_size: int) -> list[bytes]:
    """Byte-level BPE ranks for `text`: list index = rank, len <= vocab_size (fewer if pairs run out).

    Raises ValueError if vocab_size < 256.
    """
    if vocab_size < 256:
        raise ValueError(f"vocab_size {vocab_size} < 256: the 256 single bytes need a rank each")
    tokens: list[bytes] = [bytes([b]) for b in range(256)]
    index: dict[bytes, int] = {t: i for i, t in enumerate(tokens)}
    counts = Counter(pretokenize(text))
    words: list[list[int]] = [list(w.encode("utf-8")) for w in counts]
    freqs: list[int] = list(counts.values())
    pair_count: dict[tuple[int, int], int] = defaultdict(int)
    pair_words: dict[tuple[int, int], set[int]] = defaultdict(set)
    for wi, w in enumerate(words):
        for pair in zip(w, w[1:]):
            pair_count[pair] += freqs[wi]
            pair_words[pair].add(wi)
    heap = [(-c, tokens[a] + tokens[b], (a, b)) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)
    while len(tokens) < vocab_size and heap:
        neg, merged, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -neg or -neg <= 0:
            continue  # stale heap entry
        new_id = index.get(merged)
        if new_id is None:
            new_id = len(tokens)
            tokens.append(merged)
            index[merged] = new_id
        changed: set[tuple[int, int]] = set()
        for wi in list(pair_words[pair]):
            w, f = words[wi], freqs[wi]
            for p in zip(w, w[1:]):
                pair_count[p] -= f
                changed.add(p)
            merged_word: list[int] = []
            i = 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == pair:
                    merged_word.append(new_id)
                    i += 2
                else:
                    merged_word.append(w[i])
                    i += 1
            words[wi] = merged_word
            for p in zip(merged_word, merged_word[1:]):
                pair_count[p] += f
                pair_words[p].add(wi)
                changed.add(p)
        pair_count.pop(pair, None)
        pair_words.pop(pair, None)
        changed.discard(pair)
        for p in changed:
            c = pair_count.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, tokens[p[0]] + tokens[p[1]], p))
    return tokens


def write_vocab(tokens: list[bytes], out_dir: str | Path, *, source: str = "") -> dict:
    """Write `tiktoken.model` (base64 token + rank per line) and `tokenizer_config.json` (real control ids).

    Returns {"dir", "num_ranks", "vocab_size"}.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode('ascii')} {rank}\n" for rank, t in enumerate(tokens)]
    (out / "tiktoken.model").write_text("".join(lines), encoding="ascii")
    added = {
        str(i): {"content": NAMED_CONTROL_TOKENS.get(i, f"<|reserved_token_{i}|>"), "lstrip": False,
                 "normalized": False, "rstrip": False, "single_word": False, "special": True}
        for i in range(CONTROL_BASE, CONTROL_BASE + NUM_CONTROL_TOKENS)
    }
    config = {
        "name_or_path": "regen/kimi-k3-test",
        "regen_test_vocabulary": True,
        "comment": "A TEST vocabulary built by regen (regen/render/kimi_k3/test_vocab.py), NOT Kimi's: BPE ranks differ; "
                   "control-token ids are the real Kimi-K3 ones. " + source,
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "vocab_size": VOCAB_SIZE,
        "model_max_length": 1048576,
        "added_tokens_decoder": added,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    return {"dir": str(out), "num_ranks": len(tokens), "vocab_size": VOCAB_SIZE}


def build_test_vocab(text_files: list[str | Path], out_dir: str | Path, vocab_size: int = 8192,
                     max_chars: int = 4_000_000) -> dict:
    """Train byte-level BPE ranks (at most `vocab_size`) on `text_files` and write a Kimi-K3-format directory."""
    text = corpus_text(text_files, max_chars=max_chars)
    tokens = train_bpe(text, vocab_size)
    names = ", ".join(Path(p).name for p in text_files)
    return write_vocab(tokens, out_dir, source=f"Trained on {len(text):,} characters of: {names}.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", help="text / JSON / JSON-lines files or directories")
    parser.add_argument("--out", required=True)
    parser.add_argument("--vocab-size", type=int, default=8192, help="number of BPE ranks (incl. 256 bytes)")
    parser.add_argument("--max-chars", type=int, default=4_000_000)
    args = parser.parse_args(argv)
    print(json.dumps(build_test_vocab(args.inputs, args.out, args.vocab_size, args.max_chars)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
