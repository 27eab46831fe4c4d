"""The train stage's check before a run: what `run_train` will load exists and fits.

    check(cfg, rep) -> the DSparkConfig the profile will train, or None

  target      `train.target` set, a directory whose `config.json` parses, with `train.target_layer_ids` inside its
              layer count
  draft       the draft config builds for that target (`regen.train.draft_config.build_draft_config`);
              returned, so that the serving engines' check (`regen.serve.engines.check`) can ask whether they
              load it
  features    (`train.features: producers`) the Mooncake store imports, the pool's addresses name no unset
              variable, and the byte budget, segments and buffers hold one feature object
              (`regen.train.features.pool.sizes_for`)
  init_from   the warm start's draft reads (`regen.train.warm_start.read_init`)
  tracking    every `train.tracking` backend imports (`regen.train.tracking.check_backends`)

Problems go to `rep` (a `regen.errors.CheckReport`), one line each naming the field and the fix. Nothing is
loaded beyond config files (no weights, no torch tensors).
"""
from __future__ import annotations

from types import SimpleNamespace

from regen.config import local_model_config, resolve_path
from regen.config.train import TrainConfig
from regen.errors import CheckReport, InputError
from regen.train.draft_config import build_draft_config


def check(cfg: TrainConfig, rep: CheckReport):
    """Check the target, the draft, the features, the warm start and tracking of `cfg` (module docstring); never
    raises for a problem. Returns the draft's DSparkConfig, or None when the target or the draft does not load."""
    found = local_model_config(cfg.target, "train.target", "target model", "give a transformers model directory",
                               rep)
    if found is None:
        return None
    path, target_config = found
    text = target_config.get("text_config") or target_config
    layers = text.get("num_hidden_layers")
    if isinstance(layers, int) and cfg.target_layer_ids and max(cfg.target_layer_ids) >= layers:
        rep.bad(f"train.target_layer_ids {cfg.target_layer_ids}: the target {path} has {layers} layers "
                f"(ids 0..{layers - 1})")
        return None
    rep.ok(f"train.target {path}: config.json loads ({layers} layers)")
    draft = _draft(cfg, text, rep)
    if cfg.features == "producers":
        _features(cfg, text, rep)
    if cfg.init_from:  # the warm start's draft is read (and checked against the draft) when training starts
        from regen.train.warm_start import read_init

        try:
            init = read_init(resolve_path(cfg.init_from))
            rep.ok(f"train.init_from {cfg.init_from}: a {init.layout} draft, {len(init.tensors)} tensors")
        except InputError as exc:
            rep.bad(str(exc))
    if cfg.tracking:
        from regen.train.tracking import check_backends

        try:
            check_backends(list(cfg.tracking))
        except InputError as exc:
            rep.bad(str(exc))
    return draft


def _draft(cfg: TrainConfig, target_config: dict, rep: CheckReport):
    try:
        return build_draft_config(cfg, SimpleNamespace(**target_config))
    except (InputError, ValueError, TypeError) as exc:
        rep.bad(f"train: the draft config does not build: {exc}")
        return None


def _features(cfg: TrainConfig, target_config: dict, rep: CheckReport) -> None:
    from regen.train.features.pool import expanded, sizes_for

    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        from regen.train.features.store import INSTALL_HINT

        rep.bad(f"train.features=producers: the Mooncake store does not import ({exc}): {INSTALL_HINT}")
    p = cfg.producers
    try:
        for field, value in (("store.master", p.store.master), ("store.metrics_url", p.store.metrics_url),
                             ("store.hostname", p.store.hostname), ("dispatcher_host", p.dispatcher_host)):
            expanded(value, field)
        taps = len(cfg.target_layer_ids) or 3
        dtype = "bfloat16" if cfg.target_dtype == "bfloat16" else "float32"  # `auto` checked at its largest, fp32
        sizes = sizes_for(p, taps, int(target_config.get("hidden_size") or 0), dtype, 1, cfg.max_tokens,
                          cfg.max_batch)
    except InputError as exc:
        rep.bad(str(exc))
        return
    rep.ok(f"train.features=producers: budget {sizes['budget_bytes']:,} B holds the largest feature object "
           f"({sizes['largest_object_bytes']:,} B)")
