"""Kimi-K3 tiktoken tokenizer: load a local checkpoint directory (or the project's test vocabulary) and encode
segment by segment.

Source: `shared/docs/kimi-k3-format.md` §3 (segment encoding, 400,000-char chunks, 25,000-char runs) and §4
(pre-tokenization regex, control-token block 163584-163839). A checkpoint directory holds:

- `tiktoken.model`: one `base64(token bytes) rank` line per BPE rank (163,584 ranks for the real vocabulary);
- `tokenizer_config.json`: `added_tokens_decoder` {"<id>": {"content": "<|open|>", ...}} naming control ids.

The control block is 256 ids starting at len(ranks) (TOK; 163584 for the real file), or at the lowest id in
`added_tokens_decoder` when the named ids lie elsewhere (the test vocabulary); unnamed ids are `<|reserved_token_<id>|>`
as in the checkpoint's `tokenization_kimi.py`. The test vocabulary (`data/tokenizers/kimi-k3-test/`, built by
`build_test_vocab` in `regen/render/kimi_k3/test_vocab.py`) has few BPE ranks but the REAL control ids, so control ids
in tests are the ones the target uses.
"""
from __future__ import annotations

import base64
import hashlib
import json
from functools import lru_cache
from pathlib import Path

import tiktoken

from regen.config import REPO_ROOT
from regen.errors import InputError

TEST_VOCAB_DIR = REPO_ROOT / "data" / "tokenizers" / "kimi-k3-test"

# §4: the checkpoint's `pat_str` (same as K2). `&&` is class intersection (tiktoken's Rust regex; `regex` V1).
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

CONTROL_BASE = 163_584
NUM_CONTROL_TOKENS = 256
VOCAB_SIZE = CONTROL_BASE + NUM_CONTROL_TOKENS  # 163,840
# §4: the named ids of the control block; every other id in it is `<|reserved_token_<id>|>`.
NAMED_CONTROL_TOKENS: dict[int, str] = {
    163584: "[BOS]", 163585: "[EOS]", 163586: "<|end_of_msg|>", 163587: "<|open|>", 163588: "<|close|>",
    163589: "<|sep|>", 163590: "[start_header_id]", 163591: "[end_header_id]", 163593: "[EOT]",
    163602: "<|media_begin|>", 163603: "<|media_content|>", 163604: "<|media_end|>", 163605: "<|media_pad|>",
    163649: "<osagent_mode>", 163838: "[UNK]", 163839: "[PAD]",
}
END_OF_MSG, OPEN, CLOSE, SEP = "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"

TIKTOKEN_MAX_ENCODE_CHARS = 400_000  # §3 / TOK `_encode_text_piece`
MAX_NO_WHITESPACES_CHARS = 25_000
CACHE_MAX_CHARS = 16_000_000  # bound on the structural-run cache (keys' characters)


def split_runs(s: str, max_run: int = MAX_NO_WHITESPACES_CHARS) -> list[str]:
    """Split `s` so no piece has more than `max_run` consecutive whitespace or non-whitespace characters.

    Same cut points as TOK `_split_whitespaces_or_nonwhitespaces` (a run longer than `max_run` is cut every
    `max_run` characters). Returns `[s]` when no run is too long (always when len(s) <= max_run).
    """
    if len(s) <= max_run:
        return [s]
    pieces: list[str] = []
    run_len = 0
    run_is_space = s[0].isspace()
    start = 0
    for i, ch in enumerate(s):
        is_space = ch.isspace()
        if run_is_space ^ is_space:
            run_len = 1
            run_is_space = is_space
        else:
            run_len += 1
            if run_len > max_run:
                pieces.append(s[start:i])
                start = i
                run_len = 1
    pieces.append(s[start:])
    return pieces


def file_sha256(*paths: Path) -> str:
    """sha256 over the bytes of `paths` in order (the tokenizer hash of a shard manifest)."""
    h = hashlib.sha256()
    for p in paths:
        h.update(Path(p).read_bytes())
    return h.hexdigest()


def read_ranks(path: Path) -> dict[bytes, int]:
    """`tiktoken.model` -> {token bytes: rank}. Raises InputError naming the file and line on a bad line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
            except ValueError:
                raise InputError(f"{path}: line {lineno} is not 'base64token rank'; is this a tiktoken.model?") from None
    return ranks


class KimiTokenizer:
    """A Kimi-K3 tiktoken `Encoding` plus the control block, with the §3 segment encoding.

    Attributes: `encoding` (tiktoken.Encoding), `name` (directory name), `hash` (sha256 of tiktoken.model +
    tokenizer_config.json), `special_ids` {control string: id}, `is_test_vocab` (True for the bundled one).
    `encode_text`/`encode_special` return list[int] token ids; `decode` returns str.
    """

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        model_path, config_path = directory / "tiktoken.model", directory / "tokenizer_config.json"
        for p in (model_path, config_path):
            if not p.is_file():
                raise InputError(f"tokenizer directory {directory}: missing {p.name}; give a Kimi-K3 checkpoint "
                                 f"directory with tiktoken.model and tokenizer_config.json (render.tokenizer)")
        ranks = read_ranks(model_path)
        config = json.loads(config_path.read_text(encoding="utf-8"))
        named = {int(k): (v["content"] if isinstance(v, dict) else str(v))
                 for k, v in (config.get("added_tokens_decoder") or {}).items()}
        base = len(ranks)  # TOK: the control block follows the ranks ...
        if named and not all(base <= i < base + NUM_CONTROL_TOKENS for i in named):
            base = min(named)  # ... or, in a test vocabulary with few ranks, starts at the lowest named id
        if base < len(ranks) and max(ranks.values()) >= base:
            raise InputError(f"{config_path}: control id {base} collides with BPE ranks (max "
                             f"{max(ranks.values())}); added_tokens_decoder must start after the ranks")
        self.special_ids: dict[str, int] = {
            named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + NUM_CONTROL_TOKENS)
        }
        self.encoding = tiktoken.Encoding(
            name=directory.name, pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=self.special_ids,
        )
        self.directory = directory
        self.name = str(config.get("name_or_path") or directory.name)
        self.hash = file_sha256(model_path, config_path)
        self.is_test_vocab = bool(config.get("regen_test_vocabulary"))
        self.num_ranks = len(ranks)
        self._special_cache: dict[str, tuple[int, ...]] = {}
        self._parts_cache: dict[tuple, tuple[int, ...]] = {}
        self._cache_chars = 0
        self._encode_ordinary = self.encoding.encode_ordinary

    # --- §3 segment encoding -------------------------------------------------------------------------------
    def encode_special(self, text: str) -> tuple[int, ...]:
        """A structural segment (`allowed_special="all"`): control strings become control ids. Cached."""
        ids = self._special_cache.get(text)
        if ids is None:
            ids = tuple(self._encode_pieces(text, allow_special=True))
            self._special_cache[text] = ids
        return ids

    def encode_parts(self, parts: tuple[tuple[str, bool], ...]) -> tuple[int, ...]:
        """A run of structural segments, each (text, allow_special) encoded on its own (§3) and concatenated.
        Cached per run until the cache holds CACHE_MAX_CHARS characters of keys."""
        ids = self._parts_cache.get(parts)
        if ids is None:
            out: list[int] = []
            for text, special in parts:
                out.extend(self.encode_special(text) if special else self.encode_text(text))
            ids = tuple(out)
            size = sum(len(t) for t, _ in parts)
            if self._cache_chars + size <= CACHE_MAX_CHARS:
                self._parts_cache[parts] = ids
                self._cache_chars += size
        return ids

    def encode_text(self, text: str) -> list[int]:
        """A content segment (`disallowed_special=()`): a literal `<|sep|>` is ordinary BPE, never 163589."""
        if len(text) <= MAX_NO_WHITESPACES_CHARS:
            return self._encode_ordinary(text)
        return self._encode_pieces(text, allow_special=False)

    def _encode_pieces(self, text: str, allow_special: bool) -> list[int]:
        ids: list[int] = []
        for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
            for piece in split_runs(text[i:i + TIKTOKEN_MAX_ENCODE_CHARS]):
                if allow_special:
                    ids.extend(self.encoding.encode(piece, allowed_special="all"))
                else:
                    ids.extend(self._encode_ordinary(piece))
        return ids

    def encode(self, text: str) -> list[int]:
        """Plain text to ids with no control tokens (`disallowed_special=()`)."""
        return self.encode_text(text)

    def decode(self, ids: list[int]) -> str:
        """ids -> str (invalid UTF-8 at a cut is replaced with U+FFFD)."""
        return self.encoding.decode(list(ids))

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self.encoding.decode_bytes(list(ids))

    def control_id(self, token: str) -> int:
        """Id of a control string, e.g. `control_id("<|sep|>") == 163589`. KeyError if unknown."""
        return self.special_ids[token]


@lru_cache(maxsize=8)
def load_tokenizer(path: str | None = None) -> KimiTokenizer:
    """Load a Kimi-K3 tokenizer directory (cached per path); `None` = the project's test vocabulary.

    Raises InputError if the directory lacks `tiktoken.model` or `tokenizer_config.json`.
    """
    return KimiTokenizer(Path(path) if path else TEST_VOCAB_DIR)


def pretokenize(text: str) -> list[str]:
    """The §4 pre-tokenization pieces of `text`, with the `regex` module in VERSION1 mode (`&&` = intersection)."""
    return [m.group(0) for m in _compiled_pattern().finditer(text)]


@lru_cache(maxsize=1)
def _compiled_pattern():
    import regex

    return regex.compile(KIMI_PAT_STR, flags=regex.VERSION1)

