"""The embedded target: a real small model served on loopback for the `local` profile.

Modules:
    prepare_model.py  `python -m regen.serve.prepare_model` (scripts/setup.sh): the model dir from its PyPI package
    server.py         `EmbeddedTarget`: `transformers serve` on 127.0.0.1, readiness, stop; CLI `regen serve-target`
"""
