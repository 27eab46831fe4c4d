"""The feature object: what a producer puts in the store for one micro-batch, and the checks its consumer makes.

One store object per global micro-batch of the trainer's feed (`regen.train.feed`: epoch, index), laid out as

    MAGIC (8 bytes) | header length (u64 LE) | header: UTF-8 JSON, zero-padded to `header_reserve(B)` bytes
    | taps: dtype[B, S, T·Ht] C-order | last_hidden: dtype[B, S, Ht] C-order

so its size is known before it is produced (`object_nbytes`), which is what the byte budget counts. B, S are the
micro-batch's padded shape exactly as the feed materializes it, so a producer computes on the same tensors the
in-process target would (same padding, same batch: equal features, `regen.train.target.TargetFeatures`).

The header is the contract, checked by the consumer before any tensor is used (`check_header`): a mismatch is a
`FeatureContractError` naming the producer, the micro-batch and the field — never a fallback. Fields:

- `epoch`, `index`, `namespace`: which micro-batch of which training run;
- `tokens_sha256`: sha256 of the input ids (int64 LE) and attention mask (u8) the producer ran, against the
  consumer's own (a producer that ran other tokens, or another row order, is caught here);
- `layer_ids` + `layer_id_convention`: `hf_decoder_output` (id L = output of decoder layer L, −1 = embeddings:
  this project's convention, `regen.train.target`) or `vllm_capture` (vLLM `extract_hidden_states`: id L+1, the
  last hidden state appended as id num_hidden_layers; TorchSpec #87 was an off-by-one in that shift);
- `aux_hidden_stream` (`prefix` | `attn_res`) and `stream_reading` (who computed the stream and how: the
  transformers `attn_res` here is `regen.train.target`'s reading, labelled, not K3's AttnRes mixture);
- `last_hidden_norm`: `post_final_norm` (transformers, SGLang) or `pre_final_norm` (vLLM): the trainer applies the
  target's final norm iff pre-norm, so it is applied exactly once (TorchSpec #169 lost 6-33% acceptance without it);
- `dtype`, `target_hidden_size`, `target_num_hidden_layers`, shapes and offsets;
- `producer` {id, engine, engine_version, host, pid} and `target_revision` (`regen.train.target_head.target_revision`).
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass

from regen.errors import InputError

FORMAT = "regen.features/1"
MAGIC = b"RGNFEAT1"
_PREFIX = struct.Struct("<8sQ")
LAYER_ID_CONVENTIONS = ("hf_decoder_output", "vllm_capture")
LAST_HIDDEN_NORMS = ("post_final_norm", "pre_final_norm")
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


class FeatureContractError(InputError):
    """A feature object that does not match what its consumer trains on (the field is named)."""


@dataclass(frozen=True)
class FeatureSpec:
    """What every feature object of one training run must declare (the consumer's side of the contract)."""

    namespace: str
    target_layer_ids: tuple[int, ...]
    aux_hidden_stream: str
    dtype: str
    target_hidden_size: int
    target_num_hidden_layers: int
    target_revision: str

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.dtype not in DTYPES:
            raise InputError(f"feature dtype {self.dtype!r}: use one of {sorted(DTYPES)}")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "FeatureSpec":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


def header_reserve(batch_size: int) -> int:
    """Bytes reserved for the JSON header of a micro-batch of `batch_size` rows (a multiple of 64)."""
    return 4096 + 256 * int(batch_size)


def tensor_nbytes(batch_size: int, seq_len: int, num_taps: int, hidden: int, dtype: str) -> int:
    return batch_size * seq_len * (num_taps + 1) * hidden * DTYPES[dtype]


def object_nbytes(batch_size: int, seq_len: int, spec: FeatureSpec) -> int:
    """Exact bytes of the feature object of a [batch_size, seq_len] micro-batch under `spec`."""
    return _PREFIX.size + header_reserve(batch_size) + tensor_nbytes(
        batch_size, seq_len, spec.num_taps, spec.target_hidden_size, spec.dtype)


def tokens_sha256(input_ids, attention_mask) -> str:
    """sha256 of input_ids as int64 little-endian [B, S] C-order, then attention_mask as uint8 [B, S]."""
    import torch

    h = hashlib.sha256()
    h.update(input_ids.to(torch.int64).contiguous().cpu().numpy().astype("<i8", copy=False).tobytes())
    h.update(attention_mask.to(torch.uint8).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def layer_ids_in(convention: str, ids, num_hidden_layers: int) -> list[int]:
    """This project's tap ids (`hf_decoder_output`) written in `convention`'s ids (vLLM: +1, last appended)."""
    if convention == "hf_decoder_output":
        return [int(i) for i in ids]
    if convention == "vllm_capture":
        return [int(i) + 1 for i in ids] + [int(num_hidden_layers)]
    raise FeatureContractError(f"layer_id_convention {convention!r}: known conventions {list(LAYER_ID_CONVENTIONS)}")


def make_header(spec: FeatureSpec, *, epoch: int, index: int, attempt: int, sample_ids: list[str], input_ids,
                attention_mask, producer: dict, stream_reading: str, last_hidden_norm: str = "post_final_norm",
                layer_id_convention: str = "hf_decoder_output") -> dict:
    """The header of one micro-batch's object (tensor offsets are added by `encode`)."""
    B, S = (int(x) for x in input_ids.shape)
    return {
        "format": FORMAT, "namespace": spec.namespace, "epoch": int(epoch), "index": int(index),
        "attempt": int(attempt), "sample_ids": list(sample_ids), "shape": [B, S],
        "tokens_sha256": tokens_sha256(input_ids, attention_mask),
        "layer_ids": layer_ids_in(layer_id_convention, spec.target_layer_ids, spec.target_num_hidden_layers),
        "layer_id_convention": layer_id_convention, "aux_hidden_stream": spec.aux_hidden_stream,
        "stream_reading": stream_reading, "last_hidden_norm": last_hidden_norm, "dtype": spec.dtype,
        "target_hidden_size": spec.target_hidden_size, "target_num_hidden_layers": spec.target_num_hidden_layers,
        "target_revision": spec.target_revision, "producer": dict(producer),
    }


def _byte_view(t):
    import torch

    return memoryview(t.detach().contiguous().cpu().view(torch.uint8).numpy()).cast("B")


def encode(header: dict, taps, last_hidden) -> tuple[list, int]:
    """(parts for a zero-copy multi-part put, total bytes) of one object. taps: [B, S, T·Ht], last: [B, S, Ht],
    both of the header's dtype. Raises ValueError when shapes or dtype disagree with the header."""
    B, S = header["shape"]
    T, H = len(header["layer_ids"]) - (1 if header["layer_id_convention"] == "vllm_capture" else 0), \
        header["target_hidden_size"]
    want = {"taps": (B, S, T * H), "last_hidden": (B, S, H)}
    for name, t in (("taps", taps), ("last_hidden", last_hidden)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{name} shape {tuple(t.shape)} != {want[name]} declared by the header")
        if str(t.dtype).removeprefix("torch.") != header["dtype"]:
            raise ValueError(f"{name} dtype {t.dtype} != the header's {header['dtype']}")
    reserve = header_reserve(B)
    taps_off = _PREFIX.size + reserve
    last_off = taps_off + taps.numel() * taps.element_size()
    total = last_off + last_hidden.numel() * last_hidden.element_size()
    header = {**header, "tensors": {"taps": {"offset": taps_off, "shape": list(want["taps"])},
                                    "last_hidden": {"offset": last_off, "shape": list(want["last_hidden"])}},
              "nbytes": total}
    blob = json.dumps(header, separators=(",", ":")).encode()
    if len(blob) > reserve:
        raise ValueError(f"feature header of {len(blob)} bytes exceeds its {reserve}-byte reserve")
    head = _PREFIX.pack(MAGIC, len(blob)) + blob + bytes(reserve - len(blob))
    return [head, _byte_view(taps), _byte_view(last_hidden)], total


def read_header(buf) -> dict:
    """The header of an object in `buf` (any buffer). Raises FeatureContractError for a foreign or cut object."""
    mv = memoryview(buf).cast("B")
    if mv.nbytes < _PREFIX.size:
        raise FeatureContractError(f"feature object of {mv.nbytes} bytes is shorter than its prefix")
    magic, n = _PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise FeatureContractError(f"not a regen feature object (magic {bytes(magic)!r})")
    try:
        header = json.loads(bytes(mv[_PREFIX.size:_PREFIX.size + n]))
    except ValueError as exc:
        raise FeatureContractError(f"feature object header is not JSON: {exc}") from None
    if header.get("format") != FORMAT:
        raise FeatureContractError(f"feature object format {header.get('format')!r}, this trainer reads {FORMAT!r}")
    if header.get("nbytes") != mv.nbytes:
        raise FeatureContractError(f"feature object of {mv.nbytes} bytes, its header says {header.get('nbytes')}")
    return header


def tensor_extents(header: dict, size: int) -> list[tuple[int, int, tuple]]:
    """[(offset, nbytes, shape)] of taps and last_hidden, in that order, in an object of `size` bytes, read from its
    header (dtype, shapes, offsets). Raises FeatureContractError when a tensor lies outside the object or is not
    aligned to its dtype: one bounds check for every reader (`decode`, `regen.train.features.staging`)."""
    import torch

    dtype = getattr(torch, header["dtype"])
    out = []
    for name in ("taps", "last_hidden"):
        t = header["tensors"][name]
        n = 1
        for d in t["shape"]:
            n *= d
        start, nbytes = int(t["offset"]), n * dtype.itemsize
        if start < 0 or start + nbytes > size:
            raise FeatureContractError(f"feature object: tensor {name} [{start}, {start + nbytes}) lies outside "
                                       f"the object's {size} bytes")
        if start % dtype.itemsize:
            raise FeatureContractError(f"feature object: tensor {name} at offset {start} is not aligned to its "
                                       f"{dtype.itemsize}-byte {dtype}")
        out.append((start, nbytes, tuple(t["shape"])))
    return out


def decode(buf, header: dict):
    """(taps, last_hidden) tensors copied out of `buf` (so the buffer may be released). Raises
    FeatureContractError when a tensor lies outside `buf` (`tensor_extents`)."""
    import torch

    dtype = getattr(torch, header["dtype"])
    out = []
    for start, nbytes, shape in tensor_extents(header, memoryview(buf).nbytes):
        out.append(torch.frombuffer(buf, dtype=dtype, count=nbytes // dtype.itemsize, offset=start).view(*shape)
                   .clone())
    return tuple(out)


def _where(header: dict, epoch: int, index: int) -> str:
    who = header.get("producer") or {}
    return (f"feature object of micro-batch {epoch}:{index} (rows {header.get('sample_ids')}) from producer "
            f"{who.get('id', '?')} ({who.get('engine', '?')} {who.get('engine_version', '')} on "
            f"{who.get('host', '?')})")


def check_values(header: dict, taps, last_hidden, *, epoch: int, index: int) -> None:
    """Raise FeatureContractError when `taps` [B, S, T*H] or `last_hidden` [B, S, H] (the decoded tensors) hold a
    NaN or inf anywhere, padding included (0 x NaN is NaN: a masked position still poisons the draft's matmuls).
    The error names the tensor, how many values, the first (row, position) and the row's sample id. Cost: one
    `t.sum()` per tensor (a NaN or inf makes the sum non-finite, so a finite sum proves every value finite; only a
    non-finite sum, or an overflowing one, pays the exact `isfinite` pass). One K3-shaped row of 4,096 tokens (336
    MiB of bf16) on 2 CPU threads: 29 ms, 0.08x a copy of it; `isfinite(t).all()` alone took 2.2 s
    (bench/features.py `value_check`, docs/benchmarks.md)."""
    import torch

    for name, t in (("taps", taps), ("last_hidden", last_hidden)):
        if bool(torch.isfinite(t.sum())):
            continue
        ok = torch.isfinite(t)
        if bool(ok.all()):
            continue
        bad = ~ok
        row, pos = (int(x) for x in bad.any(dim=-1).nonzero()[0])
        summary = [[0, 0], [0, 0]]
        summary[name == "last_hidden"] = [int(bad.sum()), row * t.shape[1] + pos]
        raise FeatureContractError(value_breach(header, summary, t.shape[1], epoch=epoch, index=index))


def value_summary(taps, last_hidden, *, positions_per_pass: int = 4096):
    """The non-finite values of `taps` [B, S, T*H] and `last_hidden` [B, S, H], counted on their device without a
    host read: int64[2, 2], per tensor (taps, last_hidden) the number of NaN or inf values and the flat index
    row·S + position of the first position holding one (0 when none). Exact, every value counted (padding too),
    `positions_per_pass` positions at a time so the temporary flags stay small (about 150 MB per pass at K3's
    35,840 tap channels). Read it later, with other values (`RemoteFeatures.take_breaches`, once per step), and
    turn a non-zero count into the contract error with `value_breach`."""
    import torch

    out = []
    for t in (taps, last_hidden):
        S = t.shape[1]
        count = torch.zeros((), dtype=torch.long, device=t.device)
        pos_bad = []
        for a in range(0, max(S, 1), positions_per_pass):
            bad = ~torch.isfinite(t[:, a:a + positions_per_pass])
            count = count + bad.sum()
            pos_bad.append(bad.any(dim=-1))
        first = torch.cat(pos_bad, dim=1).flatten().to(torch.uint8).argmax() if t.numel() else count
        out.append(torch.stack([count, first.long()]))
    return torch.stack(out)


def value_breach(header: dict, summary, seq_len: int, *, epoch: int, index: int) -> str | None:
    """The contract error's message for a read `value_summary` (host ints [[count, first], [count, first]]) of an
    object of `seq_len` positions, or None when every value is finite. Same wording as `check_values`."""
    for name, (count, first) in zip(("taps", "last_hidden"), summary):
        if count:
            row, pos = divmod(int(first), seq_len)
            ids = header.get("sample_ids") or []
            return (f"{_where(header, epoch, index)} breaks the feature contract: {name} holds {int(count)} "
                    f"non-finite values, the first at row {row} ({ids[row] if row < len(ids) else '?'}), position "
                    f"{pos} — the producer's target diverged or overflowed in its dtype: check its checkpoint and "
                    "dtype (bfloat16/float32), restart it")
    return None


def check_header(header: dict, spec: FeatureSpec, *, epoch: int, index: int, input_ids, attention_mask) -> None:
    """Raise FeatureContractError when the object is not exactly what the consumer trains on (every field named)."""
    who = header.get("producer") or {}
    where = _where(header, epoch, index)
    bad = []

    def want(field, have, expected):
        if have != expected:
            bad.append(f"{field}: the object declares {have!r}, the trainer expects {expected!r}")

    want("namespace", header.get("namespace"), spec.namespace)
    want("epoch", header.get("epoch"), epoch)
    want("index", header.get("index"), index)
    want("shape", header.get("shape"), [int(x) for x in input_ids.shape])
    want("tokens_sha256", header.get("tokens_sha256"), tokens_sha256(input_ids, attention_mask))
    conv = header.get("layer_id_convention")
    if conv not in LAYER_ID_CONVENTIONS:
        bad.append(f"layer_id_convention: {conv!r} is none of {list(LAYER_ID_CONVENTIONS)}")
    else:
        want("layer_ids", header.get("layer_ids"),
             layer_ids_in(conv, spec.target_layer_ids, spec.target_num_hidden_layers))
    want("aux_hidden_stream", header.get("aux_hidden_stream"), spec.aux_hidden_stream)
    if header.get("last_hidden_norm") not in LAST_HIDDEN_NORMS:
        bad.append(f"last_hidden_norm: {header.get('last_hidden_norm')!r} is none of {list(LAST_HIDDEN_NORMS)}")
    want("dtype", header.get("dtype"), spec.dtype)
    want("target_hidden_size", header.get("target_hidden_size"), spec.target_hidden_size)
    want("target_num_hidden_layers", header.get("target_num_hidden_layers"), spec.target_num_hidden_layers)
    want("target_revision", header.get("target_revision"), spec.target_revision)
    if not who.get("engine") or not who.get("id"):
        bad.append("producer: the object names no producer id and engine")
    if bad:
        raise FeatureContractError(f"{where} breaks the feature contract: " + "; ".join(bad)
                                   + " — restart the producer with this run's target and settings")
