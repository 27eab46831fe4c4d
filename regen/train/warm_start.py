"""Warm start: `regen train` begins from an existing draft instead of a random one.

`train.init_from` (or `regen train --init-from PATH`) names one of:

  a regen step folder      `<run>/train/checkpoints/step-N` (config.json of DSparkConfig + model.safetensors in
                           regen's names, spec §8), or a training directory / run directory (its latest step)
  a K3DSparkModel folder   what TokenSpeed and vLLM load for a Kimi-K3 target (`architectures: ["K3DSparkModel"]`,
                           the published K3 DSpark draft's layout, `regen export-draft --engine tokenspeed`): the
                           same tensor names, config fields under the same names
  a Qwen3DSparkModel folder  what vLLM and SGLang load for a Qwen3-style target (`architectures:
                           ["Qwen3DSparkModel"]`, `regen export-draft --engine vllm|sglang`): `fc`, `hidden_norm`,
                           `norm` read back as `context_proj`, `context_norm`, `final_norm`; taps and mask token
                           from `dflash_config`; `d2t` gives the reduced vocabulary, its `lm_head` rows (the
                           target's) are not read

The checkpoint's contract is checked against the draft the profile builds
(`regen.train.draft_config.build_draft_config`) before any weight is read into it: taps (`target_layer_ids`),
the tap stream (`aux_hidden_stream`, `fc_norm`), the vocabulary (`vocab_size` of the target,
`draft_vocab_size`), the widths (hidden and intermediate sizes, layers,
heads, the MLA or GQA dimensions, the target's hidden size), `block_size`, `markov_rank`, the confidence head,
`mask_token_id` and the RoPE base. Every mismatch is one line of one InputError naming the checkpoint's value,
the profile's and the setting that makes them agree. Then every trainable tensor of the draft must be in the file
with its shape (none missing, none left over); the frozen embeddings and LM head stay the target's. A run that
already has its own checkpoint resumes from it and ignores `init_from` (logged).

Only the weights are taken: the optimizer starts fresh, with the profile's schedule (warmup included).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from regen.errors import InputError

# the Qwen3DSparkModel layout's names -> regen's (the inverse of regen.serve.engines.hf_gqa.RENAMES; the round
# trip is tested against the exporter in tests/train/test_warm_start.py)
QWEN3_DSPARK_NAMES = {"fc.weight": "context_proj.weight", "hidden_norm.weight": "context_norm.weight",
                      "norm.weight": "final_norm.weight"}
K3_ARCH, QWEN3_ARCH = "K3DSparkModel", "Qwen3DSparkModel"

# field -> the profile setting that changes it (what the mismatch line tells the user to set)
SETTING = {
    "target_layer_ids": "train.target_layer_ids", "aux_hidden_stream": "train.aux_hidden_stream",
    "fc_norm": "train.fc_norm", "attention_type": "train.attention_type", "markov_rank": "train.markov_rank",
    "block_size": "train.block_size", "num_hidden_layers": "train.num_draft_layers",
    "mask_token_id": "train.mask_token_id", "draft_vocab_size": "train.draft_vocab_size",
    "enable_confidence_head": "train.enable_confidence_head", "rope_theta": "train.rope_theta",
    "vocab_size": "train.target (a target of this vocabulary)",
    "target_hidden_size": "train.target (a target of this hidden size)",
}
GQA_WIDTHS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
MLA_WIDTHS = ("hidden_size", "intermediate_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
CHECKED = ("target_layer_ids", "aux_hidden_stream", "fc_norm", "vocab_size", "draft_vocab_size", "attention_type",
           "num_hidden_layers", "target_hidden_size", "block_size", "markov_rank", "enable_confidence_head",
           "mask_token_id", "rope_theta")


@dataclass
class InitDraft:
    """A draft read for a warm start: `contract` {field: value} in regen's terms, `tensors` in regen's names,
    `d2t` int64[Vd] (reduced vocabulary) or None, `layout` (regen / K3DSparkModel / Qwen3DSparkModel)."""

    path: Path
    layout: str
    contract: dict
    tensors: dict
    d2t: object = None

    def vocab_ids(self):
        """The reduced vocabulary as target ids int64[Vd] (d2t offsets + arange), or None."""
        import torch

        return None if self.d2t is None else self.d2t.long() + torch.arange(self.d2t.numel())


def read_init(path: str | Path) -> InitDraft:
    """Read the draft at `path` (module docstring). InputError for a missing or unreadable one, a layout this
    project does not read, or a non-finite weight."""
    from safetensors.torch import load_file

    from regen.train.checkpoint import find_draft
    from regen.train.guard import nonfinite_tensors

    folder = find_draft(path, "train.init_from")
    raw = json.loads((folder / "config.json").read_text())
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise InputError(f"train.init_from: {weights} is missing (only model.safetensors is read)")
    if (folder / "MANIFEST.json").is_file():  # a trainer step folder: verified against its manifest
        from regen.train.checkpoint import check_intact

        check_intact(folder)
    tensors = load_file(str(weights))
    bad = nonfinite_tensors(tensors)
    if bad:
        raise InputError(f"train.init_from: {weights} holds non-finite values in {bad[:5]}: start from a "
                         "finite checkpoint")
    arch = (raw.get("architectures") or [None])[0]
    if arch == QWEN3_ARCH:
        return _qwen3(folder, raw, tensors)
    if arch == K3_ARCH:
        return _k3(folder, raw, tensors)
    from regen.train.draft_config import DSparkConfig

    try:
        cfg = DSparkConfig.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise InputError(f"train.init_from: {folder / 'config.json'}: {exc}; warm start reads a regen step folder or "
                         f"an exported {K3_ARCH} / {QWEN3_ARCH} folder") from None
    contract = {**cfg.to_dict(), "rope_theta": cfg.rope_theta}
    return InitDraft(folder, "regen", contract, {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")},
                     tensors.get("d2t"))


def _k3(folder: Path, raw: dict, tensors: dict) -> InitDraft:
    contract = {k: raw.get(k) for k in (*CHECKED, *MLA_WIDTHS) if k in raw}
    contract["attention_type"] = "mla"
    full = raw.get("draft_vocab_size") in (None, raw.get("vocab_size"))
    contract["draft_vocab_size"] = 0 if full else raw["draft_vocab_size"]
    contract["rope_theta"] = float(raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta"))
    return InitDraft(folder, K3_ARCH, contract, {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")})


def _qwen3(folder: Path, raw: dict, tensors: dict) -> InitDraft:
    dflash = raw.get("dflash_config") or {}
    contract = {k: raw.get(k) for k in (*GQA_WIDTHS, "num_hidden_layers", "vocab_size", "target_hidden_size",
                                        "block_size", "markov_rank", "enable_confidence_head") if k in raw}
    contract.update(attention_type="gqa", aux_hidden_stream="prefix", fc_norm=False,
                    target_layer_ids=list(dflash.get("target_layer_ids") or []),
                    mask_token_id=dflash.get("mask_token_id"), rope_theta=float(raw.get("rope_theta")))
    vd = raw.get("draft_vocab_size")
    contract["draft_vocab_size"] = 0 if vd in (None, raw.get("vocab_size")) else vd
    mine = {QWEN3_DSPARK_NAMES.get(k, k): v for k, v in tensors.items() if k not in ("d2t", "lm_head.weight")}
    return InitDraft(folder, QWEN3_ARCH, contract, mine, tensors.get("d2t"))


def prepare(cfg, draft_cfg, resume_from, is_main: bool = True) -> InitDraft | None:
    """The checked draft of `cfg.init_from` (`read_init`, `check`), or None: no init_from, or the run resumes its
    own checkpoint `resume_from` (which wins: logged)."""
    import logging

    if not cfg.init_from:
        return None
    if resume_from is not None:
        if is_main:
            logging.getLogger(__name__).warning("train.init_from %s ignored: resuming this run's own checkpoint %s",
                                                cfg.init_from, resume_from)
        return None
    from regen.config import resolve_path

    init = read_init(resolve_path(cfg.init_from))
    check(init, draft_cfg)
    return init


def vocabulary(init: InitDraft) -> tuple:
    """(target ids int64[Vd], report) of the checkpoint's reduced vocabulary: its weights were trained on it."""
    ids = init.vocab_ids()
    return ids, {"size": int(ids.numel()), "from": str(init.path)}


def mismatches(init: InitDraft, draft_cfg) -> list[str]:
    """One line per field where the checkpoint and the profile's draft differ (module docstring)."""
    want = {**draft_cfg.to_dict(), "rope_theta": draft_cfg.rope_theta}
    widths = MLA_WIDTHS if want["attention_type"] == "mla" else GQA_WIDTHS
    out = []
    for field in (*CHECKED, *widths):
        if field not in init.contract:
            continue
        have, need = init.contract[field], want.get(field)
        if isinstance(need, tuple):
            need = list(need)
        if isinstance(have, tuple):
            have = list(have)
        if field == "rope_theta":
            have, need = float(have), float(need)
        if have != need:
            setting = SETTING.get(field, f"train.draft: {{{field}: {have!r}}}")
            out.append(f"{field}: the checkpoint has {have!r}, the profile builds {need!r} (set {setting} to "
                       f"match, or start from another draft)")
        if field == "attention_type" and have != need:
            break  # the widths of another attention mean nothing here
    return out


def check(init: InitDraft, draft_cfg) -> None:
    """InputError listing every mismatch between the checkpoint and the profile's draft (`mismatches`)."""
    lines = mismatches(init, draft_cfg)
    if lines:
        raise InputError(f"train.init_from {init.path} ({init.layout}) does not fit this profile's draft:\n"
                         + "\n".join(f"  - {x}" for x in lines))


def load_into(draft, init: InitDraft) -> dict:
    """Copy the checkpoint's trainable tensors into `draft` (a DSparkDraft before sharding). InputError naming the
    missing, left-over and misshapen tensors. Returns {tensors, layout, path}."""
    from regen.train.model import FROZEN_PREFIXES

    own = {k: v for k, v in draft.state_dict().items() if not k.startswith(FROZEN_PREFIXES) and k not in ("d2t", "t2d")}
    theirs = {k: v for k, v in init.tensors.items() if not k.startswith(FROZEN_PREFIXES)}
    missing = sorted(set(own) - set(theirs))
    extra = sorted(set(theirs) - set(own))
    shapes = sorted(f"{k}: {tuple(theirs[k].shape)} vs {tuple(own[k].shape)}" for k in set(own) & set(theirs)
                    if tuple(theirs[k].shape) != tuple(own[k].shape))
    if missing or extra or shapes:
        parts = [f"missing {missing[:8]}" if missing else "", f"not in this draft {extra[:8]}" if extra else "",
                 f"shapes (checkpoint vs draft) {shapes[:8]}" if shapes else ""]
        raise InputError(f"train.init_from {init.path} ({init.layout}): its tensors do not fit the draft: "
                         + "; ".join(p for p in parts if p))
    result = draft.load_state_dict({k: theirs[k].to(own[k].dtype) for k in own}, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    return {"path": str(init.path), "layout": init.layout, "tensors": len(own)}
