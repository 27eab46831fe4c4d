"""regen: select prompts, regenerate them with the target, render token shards, train a DSpark draft.

Stages in pipeline order (one module each): sources -> select -> generate -> render -> shards -> train.
"""
__version__ = "0.1.0"
