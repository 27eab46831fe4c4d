"""Helpers for the trainer tests: token shards listed in a manifest the way `regen render` lists them."""
from __future__ import annotations

import random
from contextlib import contextmanager
from pathlib import Path

from schemas.io import write_json_atomic, write_rows_atomic
from schemas.shard import SHARD_SCHEMA, spans_from_mask


def make_rows(num_rows: int, *, seed: int, vocab: int = 512, min_len: int = 20, max_len: int = 64,
              prefix: str = "s") -> list[dict]:
    """Random shard rows: a prompt part (no loss) then an assistant part (loss), ids in [3, vocab)."""
    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        n = rng.randint(min_len, max_len)
        prompt_len = rng.randint(2, max(2, n // 3))
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        mask = [0] * prompt_len + [1] * (n - prompt_len)
        spans = spans_from_mask(mask)
        rows.append({
            "sample_id": f"{prefix}{seed}-{i}", "prompt_id": f"p{prefix}{seed}-{i}", "turn": 0,
            "category": "math", "language": "en", "input_ids": ids, "loss_spans": spans,
            "num_tokens": n, "num_loss_tokens": sum(mask),
        })
    return rows


class ShardWriter:
    """Append shards to `<dir>/shards/` and list them in its manifest (atomically, like the render stage)."""

    def __init__(self, root: Path):
        self.dir = Path(root) / "shards"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.entries: list[dict] = []
        self.rows: list[dict] = []

    def add(self, rows: list[dict], *, complete: bool = False) -> dict:
        info = write_rows_atomic(rows, self.dir / f"shard-{len(self.entries):05d}.parquet", SHARD_SCHEMA)
        info["tokens"] = sum(r["num_tokens"] for r in rows)
        self.entries.append(info)
        self.rows.extend(rows)
        self.write_manifest(complete)
        return info

    def write_manifest(self, complete: bool, **extra) -> None:
        write_json_atomic({"schema": "regen.render.shards", "shards": self.entries, "complete": complete, **extra},
                          self.dir / "manifest.json")



def make_tiny_target(path: Path, *, vocab: int = 512, hidden: int = 64, layers: int = 4, seed: int = 0) -> Path:
    """A random Qwen3-style causal LM (hidden 64, 4 layers, vocab 512) saved with save_pretrained; no download."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=1, pad_token_id=0, bos_token_id=2)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return Path(path)


def write_profile(path: Path, target: Path, **train) -> Path:
    """A profile YAML whose train section runs the tiny target quickly on CPU (overrides via **train)."""
    import yaml

    section = {
        "enabled": True, "target": str(target), "target_layer_ids": [0, 1, 2], "num_draft_layers": 1,
        "markov_rank": 16, "num_anchors": 8, "max_len": 64, "max_tokens": 256, "max_batch": 4,
        "shuffle_buffer": 8, "bucket_window": 8, "min_loss_tokens": 4, "heldout_fraction": 0.0,
        "device": "cpu", "checkpoint_every": 0, "log_every": 1, "lr": 1e-3, "seed": 0, "epochs": 0,
    }
    section.update(train)
    Path(path).write_text(yaml.safe_dump({"name": "tiny", "train": section}))
    return Path(path)


@contextmanager
def one_torch_thread():
    """Run the block with one intra-op thread, as torchrun gives each rank (OMP_NUM_THREADS=1): a run in the test's
    own process (2 threads on a 2-core CI machine) would sum in another order than the ranks it is compared with."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
