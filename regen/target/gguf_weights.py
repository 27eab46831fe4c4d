"""The llama.cpp engine's weights: a GGUF written from the same source GGUF the trainer's safetensors come from.

The trainer's target (`data/models/<name>/model.safetensors`) is the source GGUF dequantized to fp32 by
transformers (regen.target.prepare_model). `write_gguf` makes the engine's file from that same source: every tensor
dequantized to fp32 (`gguf.quants.dequantize`, the function transformers' GGUF loader uses), then stored as
`qtype`:

- `f32`: the trainer's weights exactly (every 1-D tensor stays f32 in every type);
- `f16`: each weight rounded to fp16 (relative error <= 2^-11);
- `q8_0`: blocks of 32 weights, one fp16 scale = max|w| / 127 and int8 codes (ggml `block_q8_0`; error <= scale/2
  per weight); llama.cpp also rounds the activations to Q8_0 blocks in each matmul with these weights.

Which type the `local` profile serves is chosen by measurement (`serve.gguf_type`; docs/benchmarks.md,
speed by type, and the greedy agreement with the trainer's target in bench/serve_target.py). Metadata (tokenizer,
architecture, rope) is copied from the source unchanged. Writing takes about 10 s for SmolLM2-135M.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from schemas.io import write_json_atomic

GGUF_TYPES = ("q8_0", "f16", "f32")


def gguf_name(qtype: str) -> str:
    """The engine GGUF's file name inside the model directory: `engine-<qtype>.gguf`."""
    return f"engine-{qtype}.gguf"


def write_gguf(src: Path, dst: Path, qtype: str) -> Path:
    """Write `dst` from the GGUF `src` with every 2-D tensor stored as `qtype` (one of GGUF_TYPES), atomically.

    Raises ValueError for an unknown `qtype`."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    if qtype not in GGUF_TYPES:
        raise ValueError(f"gguf type {qtype!r}: choose one of {GGUF_TYPES}")
    reader = gguf.GGUFReader(str(src))
    tmp = dst.with_name(f"{dst.name}.tmp-{os.getpid()}")  # one per writer: two processes may prepare the same file
    writer = gguf.GGUFWriter(str(tmp), arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        if field.name == "general.file_type":
            continue  # describes the source's quantization, not this file's
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    target = {"q8_0": Q.Q8_0, "f16": Q.F16, "f32": Q.F32}[qtype]
    for t in reader.tensors:
        x = np.asarray(t.data) if t.tensor_type == Q.F32 else gguf.quants.dequantize(t.data, t.tensor_type)
        x = np.ascontiguousarray(x, dtype=np.float32).reshape([int(s) for s in reversed(t.shape)])
        if x.ndim == 1 or target == Q.F32:
            writer.add_tensor(t.name, x, raw_dtype=Q.F32)
        elif target == Q.F16:
            writer.add_tensor(t.name, x.astype(np.float16), raw_dtype=Q.F16)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(x, target), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return dst


def prepare_gguf(model_dir: Path, source: Path, source_sha256: str, qtype: str, log=print) -> Path:
    """`model_dir/engine-<qtype>.gguf`, written from `source` unless a sidecar `.json` says it was written from a
    source with `source_sha256` already (idempotent). Returns the path."""
    dst = model_dir / gguf_name(qtype)
    stamp = dst.with_suffix(".json")
    want = {"source": source.name, "source_sha256": source_sha256, "type": qtype}
    if dst.exists() and stamp.exists() and json.loads(stamp.read_text()) == want:
        return dst
    import time

    t0 = time.time()
    write_gguf(source, dst, qtype)
    write_json_atomic(want, stamp)
    log(f"prepare_model: wrote {dst} ({dst.stat().st_size / 1e6:.0f} MB, {qtype}) in {time.time() - t0:.0f}s")
    return dst
