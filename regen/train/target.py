"""Online target features: tap hidden states and the final-normed last hidden state, computed on the fly.

Spec: shared/docs/dspark.md §1. Nothing is stored on disk: `TargetFeatures.features(input_ids, attention_mask)`
runs the target's decoder (no LM head over the full vocabulary) with forward hooks on the tap layers.

Shape legend: B batch, S sequence, T taps, Ht target hidden size, V vocabulary.

Tap ids: id L is 0-indexed decoder layer L (−1 = the embedding output). Ids strictly increase; a tap on the
last layer is refused (spec §1). Streams (`aux_hidden_stream`):

- `prefix`: the residual stream output of `layers[L]` (before the final norm) — the Inferact/vLLM contract.
- `attn_res`: our reading for standard HF decoders, which have no AttnRes: the hidden state of layer L+1 after
  its attention residual add and before its next pre-normalization, i.e. the input of layer L+1's
  `pre_feedforward_layernorm` (Gemma-style layers) or `post_attention_layernorm` (Llama/Qwen3-style).
  K3's true `attn_res` is the softmax-weighted AttnRes block mixture that layer L+1's attention receives
  (TKb `kimi_k3.py`); it does not exist in these models. On a plain residual model the literal analogue of
  that definition equals `prefix`, so this reading is the nearest distinct stream; it is NOT what a K3 serving
  engine computes. Declare the stream in the contract; a mismatch is an error here (serving would silently
  lose acceptance, spec §1).

The target distribution for the losses is `p_t = softmax(lm_head(final_norm(h_last)))` (norm convention
`final_norm`): `last_hidden` is the decoder's output after `model.model.norm`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from regen.errors import InputError

STREAMS = ("prefix", "attn_res")
NORM_CONVENTIONS = ("final_norm",)


class ContractError(InputError):
    """Target features declared by two parties (data, model, checkpoint, profile) disagree."""


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """`round(1 + i·(L−4)/(n−1))` for i = 0…n−1 (SF `build_target_layer_ids`, spec §1); n = 1 -> [L // 2]."""
    if num_taps < 1:
        raise ValueError("num_taps must be >= 1")
    if num_taps == 1:
        return [num_target_layers // 2]
    span = (num_target_layers - 3) - 1
    return [int(round(1 + i * span / (num_taps - 1))) for i in range(num_taps)]


def validate_layer_ids(ids, num_target_layers: int) -> tuple[int, ...]:
    """Unique ascending ids in [−1, L−2]. Raises ContractError naming the bad id (last layer refused)."""
    ids = tuple(int(i) for i in ids)
    if not ids or list(ids) != sorted(set(ids)):
        raise ContractError(f"target_layer_ids {list(ids)} must be non-empty, unique and ascending")
    for i in ids:
        if i == num_target_layers - 1:
            raise ContractError(
                f"target_layer_ids {list(ids)}: {i} is the target's last layer; its HF hidden state is already "
                "final-normed, so a tap there is refused (spec §1) — pick an earlier layer")
        if not -1 <= i < num_target_layers - 1:
            raise ContractError(f"target_layer_ids {list(ids)}: {i} outside [-1, {num_target_layers - 2}]")
    return ids


@dataclass(frozen=True)
class TargetContract:
    """What the draft's context features are: tap ids, stream and norm convention (+ target shape).

    Written into the checkpoint config (the `DSparkConfig` fields of the same names) and checked against what
    the shards manifest, the target model and a loaded checkpoint declare.
    """

    target_layer_ids: tuple[int, ...]
    aux_hidden_stream: str = "prefix"
    norm_convention: str = "final_norm"
    target_num_hidden_layers: int | None = None
    target_hidden_size: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.aux_hidden_stream not in STREAMS:
            raise ContractError(f"aux_hidden_stream {self.aux_hidden_stream!r}: use one of {list(STREAMS)}")
        if self.norm_convention not in NORM_CONVENTIONS:
            raise ContractError(f"norm_convention {self.norm_convention!r}: use one of {list(NORM_CONVENTIONS)}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TargetContract":
        keys = ("target_layer_ids", "aux_hidden_stream", "norm_convention", "target_num_hidden_layers",
                "target_hidden_size")
        return cls(**{k: d[k] for k in keys if k in d and d[k] is not None})

    @classmethod
    def from_draft_config(cls, cfg) -> "TargetContract":
        return cls(cfg.target_layer_ids, cfg.aux_hidden_stream, cfg.norm_convention,
                   cfg.target_num_hidden_layers, cfg.target_hidden_size)

    def for_model(self, model_config) -> "TargetContract":
        """This contract completed with (and checked against) an HF target config. Raises ContractError."""
        tc = getattr(model_config, "text_config", None) or model_config
        L, H = tc.num_hidden_layers, tc.hidden_size
        for name, have, want in (("target_num_hidden_layers", self.target_num_hidden_layers, L),
                                 ("target_hidden_size", self.target_hidden_size, H)):
            if have is not None and have != want:
                raise ContractError(f"contract {name}={have} but the target model has {want}: "
                                    "the draft was built for a different target")
        validate_layer_ids(self.target_layer_ids, L)
        return TargetContract(self.target_layer_ids, self.aux_hidden_stream, self.norm_convention, L, H)

    def check(self, declared: dict | "TargetContract" | None, source: str) -> None:
        """Raise ContractError if `declared` (a dict with any of the contract keys, e.g. a shards manifest or a
        checkpoint config.json) states a different value. Keys it does not state are not checked."""
        if declared is None:
            return
        d = declared.to_dict() if isinstance(declared, TargetContract) else declared_contract(declared)
        mine = self.to_dict()
        bad = []
        for k, v in d.items():
            if v is None or mine.get(k) is None:
                continue
            if (list(v) if isinstance(v, (list, tuple)) else v) != mine[k]:
                bad.append(f"{k}: {source} declares {v!r}, this run uses {mine[k]!r}")
        if bad:
            raise ContractError(f"target feature contract mismatch with {source}: " + "; ".join(bad)
                                + " — train/evaluate with the declared values or regenerate the data/checkpoint")


def declared_contract(d: dict) -> dict:
    """The contract keys a JSON document declares, at top level or under `contract`/`training_contract`/
    `hidden_states`/`dflash_config` (SF nesting)."""
    keys = ("target_layer_ids", "aux_hidden_stream", "norm_convention", "target_num_hidden_layers",
            "target_hidden_size")
    out = {}
    for node in (d, *(d.get(k) for k in ("contract", "training_contract", "hidden_states", "dflash_config"))):
        if isinstance(node, dict):
            out.update({k: node[k] for k in keys if k in node and node[k] is not None})
    return out


def target_logits(model, last_hidden):
    """float32 logits [..., V] = model's LM head on `last_hidden` [..., Ht], with the target's final logit soft-capping
    (`final_logit_softcapping`, Gemma) when its config has one. No gradients."""
    import torch

    with torch.no_grad():
        x = model.get_output_embeddings()(last_hidden).float()
    cfg = model.config
    cap = getattr(getattr(cfg, "text_config", None) or cfg, "final_logit_softcapping", None)
    return torch.tanh(x / cap) * cap if cap else x


def _cache_kwarg(decoder, cache) -> dict:
    """The decoder's name for the KV cache argument: `cache` (transformers >= 5.x, where `past_key_values` is
    deprecated) or `past_key_values`."""
    import inspect

    return {"cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values": cache}


def _out_tensor(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class TargetFeatures:
    """A frozen HF causal LM with hooks that capture the contract's tap states.

    `features(input_ids, attention_mask)` -> (taps float[B, S, T·Ht] in ascending tap order,
    last_hidden float[B, S, Ht] after the final norm). `logits(last_hidden)` applies the LM head.
    """

    def __init__(self, model, contract: TargetContract):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.contract = contract.for_model(model.config)
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.layers = self.decoder.layers
        self._captured: dict[int, object] = {}
        self._handles = [self._hook(i) for i in self.contract.target_layer_ids]

    @classmethod
    def from_pretrained(cls, path: str | Path, contract: TargetContract, *, dtype=None, device="cpu"):
        """Load a target from a LOCAL directory (offline; nothing downloads). Raises InputError if absent."""
        import torch
        from transformers import AutoModelForCausalLM

        p = Path(path)
        if not (p / "config.json").exists():
            raise InputError(f"target model {str(p)!r} has no config.json: give a local transformers directory "
                             "(e.g. data/models/gemma3-270m after `bash scripts/setup.sh`)")
        model = AutoModelForCausalLM.from_pretrained(str(p), local_files_only=True, dtype=dtype or torch.float32)
        return cls(model.to(device), contract)

    def _hook(self, layer_id: int):
        stream = self.contract.aux_hidden_stream

        def save(_m, _inp, out):
            self._captured[layer_id] = _out_tensor(out)

        def save_input(_m, args):
            self._captured[layer_id] = args[0]

        if stream == "prefix" or layer_id + 1 >= len(self.layers):
            module = self.decoder.embed_tokens if layer_id == -1 else self.layers[layer_id]
            if stream == "attn_res" and layer_id + 1 >= len(self.layers):
                raise ContractError(f"attn_res tap {layer_id} has no next layer")
            return module.register_forward_hook(save)
        nxt = self.layers[layer_id + 1]
        norm = getattr(nxt, "pre_feedforward_layernorm", None) or getattr(nxt, "post_attention_layernorm", None)
        if norm is None:
            raise ContractError(f"attn_res: layer {layer_id + 1} of {type(nxt).__name__} has no "
                                "pre_feedforward_layernorm/post_attention_layernorm to hook")
        return norm.register_forward_pre_hook(save_input)

    @property
    def config(self):
        return self.model.config

    @property
    def device(self):
        return next(self.model.parameters()).device

    def features(self, input_ids, attention_mask=None, past_key_values=None):
        """(taps [B, S, T·Ht], last_hidden [B, S, Ht]); no gradients; float dtype of the model.

        past_key_values: an HF cache (e.g. `transformers.DynamicCache`) holding the positions before
        `input_ids`, extended in place (speculative verification, `regen.train.eval`); None = no cache."""
        import torch

        self._captured.clear()
        with torch.no_grad():
            kw = {"use_cache": False} if past_key_values is None else {"use_cache": True, **_cache_kwarg(
                self.decoder, past_key_values)}
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, **kw)
            taps = torch.cat([self._captured[i] for i in self.contract.target_layer_ids], dim=-1)
        self._captured.clear()
        return taps, out.last_hidden_state

    def features_of(self, batch: dict):
        """`features(batch["input_ids"], batch["attention_mask"])`: the trainer's call (`regen.train.step.train_step`),
        shared with the producer path's `regen.train.features.client.RemoteFeatures.features_of`."""
        return self.features(batch["input_ids"], batch["attention_mask"])

    @property
    def memory_bytes(self) -> int:
        """Bytes of the target's parameters and buffers in this process."""
        return sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))

    def logits(self, last_hidden):
        """lm_head(last_hidden) in float32 (+ final logit soft-capping when the target has it)."""
        return target_logits(self.model, last_hidden)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
