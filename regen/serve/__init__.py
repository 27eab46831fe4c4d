"""Handing the trained draft to serving engines: the exporters, one adapter module per engine.

Modules:
    engines/  `regen export-draft` (a draft step folder -> each engine's layout and launch line) and
              `regen engine-eval` (acceptance read from a served engine's counters); its `__init__.py` is the map

The target that `regen run` generates from on loopback is a separate product: `regen.target`.
"""
