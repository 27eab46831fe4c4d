"""The part of the target a trainer rank holds when features come from producers: embeddings, final norm, LM head.

A DSpark draft shares the target's frozen `embed_tokens` and `lm_head` (spec §5), and its losses need the target's
distribution `p_t = softmax(lm_head(final_norm(h_last)))` (spec §1). Nothing else of the target is needed in a
trainer rank once the tap hidden states and the last hidden state arrive from feature producers
(`regen.train.features`), so `TargetHead` reads exactly those tensors from the checkpoint and never the decoder
layers: TorchSpec's trainer does the same (`load_synced_target_lm_head`, ../shared/docs/online-target-facts.md §1.2).

How: the target's own transformers classes are instantiated with every parameter on the `meta` device
(`accelerate.init_empty_weights`: no memory, buffers real), and only the three modules' parameters are read from
the safetensors files (one `model.safetensors` or a `model.safetensors.index.json` with its shards) and set on the
device. The target's own conventions therefore hold by construction: its embedding module (Gemma's scaled
embedding), its final norm (Llama's `w·x/rms`, Gemma's `(1+w)·x/rms`, its eps) and its tied embeddings
(`tie_word_embeddings`: the LM head reuses the embedding matrix). Logit soft-capping and the embedding scale are
read from the same config into the draft's config (`regen.train.draft_config.small_config_for_target`).

A target whose architecture transformers does not know (a checkpoint with custom code, e.g. Kimi-K3's) is read
by tensor names: `keys` = {"embed": ..., "norm": ..., "lm_head": ...} (`train.target_head_keys`), with a plain
RMSNorm (`rms_norm_eps` of its config) as the final norm.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from regen.errors import InputError

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
HEAD_PARTS = ("embed", "norm", "lm_head")


def weight_map(path: str | Path) -> dict[str, str]:
    """{tensor name: safetensors file name} of a checkpoint directory: its index's `weight_map`, else the names in
    its single `model.safetensors`. Raises InputError when the directory has neither."""
    from safetensors import safe_open

    p = Path(path)
    if (p / INDEX_NAME).exists():
        try:
            return dict(json.loads((p / INDEX_NAME).read_text())["weight_map"])
        except (ValueError, KeyError, TypeError) as exc:
            raise InputError(f"{p / INDEX_NAME}: not a safetensors index with a 'weight_map' ({exc})") from None
    if (p / SINGLE_NAME).exists():
        with safe_open(str(p / SINGLE_NAME), framework="pt") as f:
            return {k: SINGLE_NAME for k in f.keys()}
    raise InputError(f"target {str(p)!r} has neither {SINGLE_NAME} nor {INDEX_NAME}: give the directory of a "
                     "safetensors checkpoint (transformers `save_pretrained` writes one)")


def target_revision(path: str | Path, sample_bytes: int = 1 << 20) -> str:
    """A hex sha256 naming one checkpoint's files, cheap enough for a 1T-parameter target.

    Hashes `config.json`, and for every weight file in name order: its name, size, safetensors header (every
    tensor's name, dtype, shape and offsets) and its first and last `sample_bytes` bytes. Two processes that load
    the same files agree; a different checkpoint (other shapes, another fine-tune, a re-quantization) differs
    unless it changes only bytes outside the sampled ranges and leaves every header alone, which this hash does
    not detect (it is an identity check, not an integrity check). Raises InputError when files are missing.
    """
    p = Path(path)
    h = hashlib.sha256()
    try:
        h.update((p / "config.json").read_bytes())
    except FileNotFoundError:
        raise InputError(f"target {str(p)!r} has no config.json") from None
    for name in sorted(set(weight_map(p).values())):
        f = p / name
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise InputError(f"{f}: listed in {INDEX_NAME} but missing") from None
        h.update(f"{name}:{size}:".encode())
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(n, size)))
            h.update(fh.read(sample_bytes))
            fh.seek(max(0, size - sample_bytes))
            h.update(fh.read(sample_bytes))
    return h.hexdigest()


class _PlainRMSNorm:
    """`w · x / sqrt(mean(x²) + eps)` in float32, cast back: the final norm of a target read by tensor names."""

    def __init__(self, weight, eps: float):
        self.weight, self.eps = weight, float(eps)

    def __call__(self, x):
        import torch

        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


def _module_name(model, module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return name
    raise InputError(f"{type(module).__name__} is not a submodule of {type(model).__name__}")


class TargetHead:
    """Embeddings, final norm and LM head of a target, read alone from its checkpoint (see the module docstring).

    `model`: the target's transformers model whose decoder layers stay on the `meta` device (no memory); its
    `get_input_embeddings()` / `get_output_embeddings()` are real, so `DSparkDraft.from_target` and
    `share_frozen_with_target` take it like a full target. `final_norm(h)`: the target's final norm, float[..., Ht]
    -> same shape and dtype. `logits(last_hidden)`: float32 logits [..., V] with the target's soft cap.
    `memory_bytes`: bytes of the tensors this rank holds.
    """

    def __init__(self, model, config, norm, tensors: dict[str, object], path: Path):
        self.model, self._config, self.norm, self.path = model, config, norm, path
        seen, total = set(), 0
        for t in tensors.values():
            key = (t.untyped_storage().data_ptr(), t.dtype)
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
        self.memory_bytes = total
        self.tensor_names = sorted(tensors)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype=None, device="cpu", keys: dict | None = None) -> "TargetHead":
        """Read the head of the checkpoint at the LOCAL directory `path` (nothing downloads).

        keys: tensor names {"embed", "norm", "lm_head"} for architectures transformers cannot instantiate
        (`lm_head` may be omitted when the embeddings are tied). Raises InputError for a missing directory, config
        or tensor, naming the tensors the checkpoint has that look like the missing one.
        """
        import torch
        from transformers import AutoConfig

        p = Path(path)
        if not (p / "config.json").exists():
            raise InputError(f"target model {str(p)!r} has no config.json: give a local checkpoint directory")
        dtype = dtype or torch.float32
        config = AutoConfig.from_pretrained(str(p), local_files_only=True)
        wmap = weight_map(p)
        if keys:
            return cls._from_keys(p, config, wmap, keys, dtype, device)
        from accelerate import init_empty_weights
        from accelerate.utils import set_module_tensor_to_device
        from transformers import AutoModelForCausalLM

        try:
            with init_empty_weights(include_buffers=False):
                model = AutoModelForCausalLM.from_config(config)
        except (ValueError, KeyError, ImportError) as exc:
            raise InputError(f"{p}: transformers cannot build this architecture ({exc}); name the head's tensors "
                             "with train.target_head_keys={embed: ..., norm: ..., lm_head: ...}") from None
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        norm = getattr(decoder, "norm", None)
        if norm is None:
            raise InputError(f"{p}: {type(decoder).__name__} has no final `norm` module; name the head's tensors "
                             "with train.target_head_keys")
        modules = {"embed": model.get_input_embeddings(), "norm": norm, "lm_head": model.get_output_embeddings()}
        tied = bool(getattr(getattr(config, "text_config", None) or config, "tie_word_embeddings", False)) or \
            modules["lm_head"].weight is modules["embed"].weight
        tensors = {}
        with _Reader(p, wmap) as reader:
            for part, module in modules.items():
                prefix = _module_name(model, module)
                for pname, param in module.named_parameters(recurse=True):
                    full = f"{prefix}.{pname}"
                    if part == "lm_head" and tied and not reader.has(full):
                        continue  # tied: the embedding matrix, set below
                    t = reader.get(full, part).to(dtype)
                    if tuple(t.shape) != tuple(param.shape):
                        raise InputError(f"{p}: tensor {full} has shape {tuple(t.shape)}, the config implies "
                                         f"{tuple(param.shape)}: config.json and the weights disagree")
                    set_module_tensor_to_device(model, full, device, value=t)
                    tensors[full] = t
        if tied:
            model.get_output_embeddings().weight = model.get_input_embeddings().weight
        for part, module in modules.items():
            for pname, param in module.named_parameters():
                if param.is_meta:
                    raise InputError(f"{p}: no tensor for {part} parameter {pname!r}")
        head = cls(model, config, norm, {k: v for k, v in tensors.items()}, p)
        log.info("target head: %s, %.1f MiB in this rank (%s); decoder layers not loaded", p,
                 head.memory_bytes / 2**20, ", ".join(head.tensor_names))
        return head

    @classmethod
    def _from_keys(cls, p: Path, config, wmap, keys: dict, dtype, device) -> "TargetHead":
        from torch import nn

        bad = set(keys) - set(HEAD_PARTS)
        if bad or "embed" not in keys or "norm" not in keys:
            raise InputError(f"train.target_head_keys={keys}: give 'embed' and 'norm' (and 'lm_head' unless the "
                             "embeddings are tied); unknown keys " + ", ".join(sorted(bad)))
        tc = getattr(config, "text_config", None) or config
        with _Reader(p, wmap) as reader:
            t = {part: reader.get(name, part).to(dtype).to(device) for part, name in keys.items()}
        emb = nn.Embedding(*t["embed"].shape, device="meta")
        emb.weight = nn.Parameter(t["embed"], requires_grad=False)
        head_w = t.get("lm_head", t["embed"])
        lm_head = nn.Linear(head_w.shape[1], head_w.shape[0], bias=False, device="meta")
        lm_head.weight = nn.Parameter(head_w, requires_grad=False)
        eps = getattr(tc, "rms_norm_eps", None)
        if eps is None:
            raise InputError(f"{p}/config.json has no rms_norm_eps for the final norm read by train.target_head_keys")
        norm = _PlainRMSNorm(t["norm"], eps)
        model = _HeadOnlyModel(config, emb, lm_head)
        log.info("target head by tensor names: %s; plain RMSNorm(eps=%g) as the final norm", keys, eps)
        return cls(model, config, norm, {keys[k]: v for k, v in t.items()}, p)

    @property
    def config(self):
        return self._config

    @property
    def device(self):
        return self.model.get_input_embeddings().weight.device

    def final_norm(self, hidden):
        import torch

        with torch.no_grad():
            return self.norm(hidden)

    def logits(self, last_hidden):
        """lm_head(last_hidden) in float32 (+ final logit soft-capping when the target has it)."""
        from regen.train.target import target_logits

        return target_logits(self.model, last_hidden)

    def close(self) -> None:
        pass


class _HeadOnlyModel:
    """The two accessors `DSparkDraft.from_target` uses, for a head read by tensor names."""

    def __init__(self, config, embed, lm_head):
        self.config, self._embed, self._lm_head = config, embed, lm_head

    def get_input_embeddings(self):
        return self._embed

    def get_output_embeddings(self):
        return self._lm_head


class _Reader:
    """Read single tensors by name from a checkpoint's safetensors files (each file opened once)."""

    def __init__(self, path: Path, wmap: dict[str, str]):
        self.path, self.wmap, self._open = path, wmap, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in self._open.values():
            f.__exit__(None, None, None)
        self._open.clear()

    def has(self, name: str) -> bool:
        return name in self.wmap

    def get(self, name: str, part: str):
        from safetensors import safe_open

        if name not in self.wmap:
            tail = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
            near = [k for k in self.wmap if tail in k][:5]
            raise InputError(f"{self.path}: the checkpoint has no tensor {name!r} ({part}); tensors with "
                             f"{tail!r} in their name: {near or 'none'} — name it in train.target_head_keys")
        fname = self.wmap[name]
        if fname not in self._open:
            f = safe_open(str(self.path / fname), framework="pt")
            self._open[fname] = f.__enter__()
        return self._open[fname].get_tensor(name)
