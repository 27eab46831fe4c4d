"""The render stage's check before a run: the renderer `run_render` will use loads.

    check(cfg, rep) -> the renderer, or None   `render.tokenizer` set where the renderer needs one, its environment
                                                variables set, and the tokenizer directory loads
                                                (`regen.render.stage.make_renderer`)

`cfg` is the effective render config (`regen.config.render.effective_render_config`: the hf renderer without a
tokenizer renders with the embedded target's). Problems go to `rep` (a `regen.errors.CheckReport`), one line each
naming the field and the fix. The renderer is returned so that a caller that renders next (`regen plan`) loads it
once.
"""
from __future__ import annotations

from regen.config.render import RenderConfig
from regen.errors import CheckReport, InputError
from regen.render.stage import make_renderer


def check(cfg: RenderConfig, rep: CheckReport):
    """Load the renderer of `cfg` (module docstring); never raises for a problem. Returns it, or None."""
    try:
        renderer = make_renderer(cfg)
    except InputError as exc:
        rep.bad(str(exc))
        return None
    except Exception as exc:  # a tokenizer directory that exists but does not load
        rep.bad(f"render.tokenizer {cfg.tokenizer!r}: the {cfg.renderer} renderer does not load: "
                f"{type(exc).__name__}: {exc}")
        return None
    rep.ok(f"render: {renderer.name} renderer, tokenizer {renderer.tokenizer_name}")
    return renderer
