"""A vLLM KV connector that writes the hidden states `extract_hidden_states` captures into a producer's staging file.

Loaded by vLLM itself, inside its engine process (this module imports vLLM; regen's own venv need not have it):

    --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
                           "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [...]}}}'
    --kv-transfer-config '{"kv_connector": "RegenHiddenStatesConnector", "kv_role": "kv_producer",
                           "kv_connector_module_path": "regen.train.features.vllm_connector",
                           "kv_connector_extra_config": {"staging_dir": "/dev/shm/regen-vllm-..."}}'

`regen.train.features.vllm_producer` starts the server so and is the only client it expects. What vLLM does
(vLLM PR #33736, `vllm/model_executor/models/extract_hidden_states.py` in 0.32): the target's forward returns the
residual stream at each `eagle_aux_hidden_state_layer_ids` id (id k = after k decoder layers, 0 = embeddings,
`num_hidden_layers` = the last layer's output before the final norm), and the `ExtractHiddenStatesModel` "draft"
writes them, stacked [tokens, ids, Ht] in the model dtype, into the KV pages of one `CacheOnlyAttentionLayer`. This
connector reads those pages back for each request once its whole prompt has been computed, and writes them where
the request's `kv_transfer_params["regen"]` says, in regen's feature-object tensor layout
(`regen.train.features.contract`):

    taps  -> bytes [taps_offset, + num_tokens·T·Ht·e)   the request's row of taps [B, S, T·Ht] (C-order)
    last  -> bytes [last_offset, + num_tokens·Ht·e)     the request's row of last_hidden [B, S, Ht], pre-final-norm
    row status byte `row` of `<path>.rows`: 1 written, 2 failed (the reason in `<path>.row<row>.err`)

T = number of ids − 1 (the last id is the last hidden state), e = the element size of `dtype`. Positions of the row
past `num_tokens` are not written: the producer's file is zero-filled, so padding is zeros.

Why not vLLM's `ExampleHiddenStatesConnector`: its background write copies into pinned host memory
(`torch.empty_like(..., pin_memory=True)`), which CPU torch refuses, and the engine dies
(../shared/docs/stack-notes.md "vLLM on CPU"). This connector pins nothing and writes synchronously from
`save_kv_layer`, which vLLM calls during the drafter's forward of the step that computes the prompt's last chunk,
before that step's output (so before the HTTP response) leaves the engine. A write that fails is reported in
the status file and the log, never raised: the engine keeps serving and the producer fails the lease, naming why.

Scheduler side and worker side are separate instances (vLLM builds one per role): the scheduler tracks each regen
request's KV blocks across chunked-prefill steps (replacing them when a preempted request resumes) and hands the
worker a `_Save` in the step that completes the prompt. Only tensor-parallel rank 0 writes. Pipeline parallelism:
vLLM gathers aux states to the last stage for models that support it, so the writer is on the last stage's node.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

log = logging.getLogger("vllm.regen_connector")  # under vLLM's logger, so its handlers print it

PARAMS_KEY = "regen"  # kv_transfer_params[PARAMS_KEY]: where to write one request's hidden states
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Save:
    """Worker order: write one request's captured states (its prompt is complete in the cache this step)."""

    req_id: str
    num_tokens: int
    block_ids: list[int]
    target: dict


@dataclass
class RegenConnectorMetadata(KVConnectorMetadata):
    saves: list[_Save] = field(default_factory=list)


def _write_all(fd: int, data, offset: int) -> None:
    """pwrite every byte of `data` (a contiguous tensor) at `offset` (Linux writes at most ~2 GiB per call)."""
    mv = memoryview(data.view(torch.uint8).numpy()).cast("B")
    done = 0
    while done < mv.nbytes:
        done += os.pwrite(fd, mv[done:], offset + done)


class RegenHiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only connector for `extract_hidden_states` (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "extract_hidden_states":
            raise ValueError("RegenHiddenStatesConnector needs --speculative-config with method "
                             "'extract_hidden_states'")
        self.layer_ids = list(getattr(spec.draft_model_config.hf_config, "eagle_aux_hidden_state_layer_ids", []))
        self.num_layers = vllm_config.model_config.get_total_num_hidden_layers()
        self.hidden_size = vllm_config.model_config.get_hidden_size()
        if not self.layer_ids or self.layer_ids != sorted(set(self.layer_ids)) or self.layer_ids[-1] != self.num_layers:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids {self.layer_ids} must ascend strictly and end with "
                             f"the model's num_hidden_layers {self.num_layers} (the last hidden state, pre-norm)")
        root = self._kv_transfer_config.get_from_extra_config("staging_dir", None)
        if not root:
            raise ValueError("RegenHiddenStatesConnector needs kv_connector_extra_config.staging_dir")
        self.staging_dir = os.path.realpath(root)
        self.group_id = self._hidden_state_group(kv_cache_config)
        # scheduler side: req_id -> [num_tokens, block_ids, target, number of steps that computed its prompt]
        self._tracked: dict[str, list] = {}
        self._status: dict[str, str] = {}
        # worker side
        self._layer_name: str | None = None
        self._writer = True

    @staticmethod
    def _hidden_state_group(kv_cache_config) -> int | None:
        if kv_cache_config is None:
            return None
        from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

        all_groups = kv_cache_config.kv_cache_groups
        groups = [g for g, grp in enumerate(all_groups) if isinstance(grp.kv_cache_spec, HiddenStateCacheSpec)]
        if not groups and len(all_groups) == 1:  # the hidden-state layer shares the only group (uniform page size)
            return 0
        if len(groups) != 1:
            raise ValueError(f"expected one hidden-state KV cache group, found {len(groups)} among "
                             f"{len(kv_cache_config.kv_cache_groups)}")
        return groups[0]

    # -- scheduler side -------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        return

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = RegenConnectorMetadata()
        gid = self.group_id
        for req in scheduler_output.scheduled_new_reqs:
            extra = (req.sampling_params.extra_args or {}) if req.sampling_params else {}
            target = (extra.get("kv_transfer_params") or {}).get(PARAMS_KEY)
            if target is None:
                continue
            n = len(req.prompt_token_ids or [])
            blocks = list(req.block_ids[0 if gid is None else gid])
            self._tracked[req.req_id] = [n, blocks, target, 0]
            self._status[req.req_id] = {"status": "prefilling"}
            self._maybe_save(meta, req.req_id, req.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            entry = self._tracked.get(req_id)
            if entry is None:
                continue
            new = cached.new_block_ids[i]
            if new is not None:
                ids = list(new[0 if gid is None else gid])
                entry[1] = ids if req_id in cached.resumed_req_ids else entry[1] + ids
            self._maybe_save(meta, req_id, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def _maybe_save(self, meta: RegenConnectorMetadata, req_id: str, num_computed: int, scheduler_output) -> None:
        entry = self._tracked[req_id]
        n, blocks, target = entry[:3]
        entry[3] += 1
        if num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0) >= n:
            meta.saves.append(_Save(req_id, n, list(blocks), dict(target)))
            self._status[req_id] = {"status": "saved by the step that completed the prompt", "prefill_steps": entry[3]}
            del self._tracked[req_id]

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        status = self._status.pop(request.request_id, None)
        return False, (None if status is None else {PARAMS_KEY: status})

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    # -- worker side ----------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._writer = get_tensor_model_parallel_rank() == 0
        except (AssertionError, RuntimeError):
            self._writer = True
        names = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(names) != 1:
            raise ValueError(f"expected one CacheOnlyAttentionLayer (extract_hidden_states), found {names}")
        self._layer_name = names[0]
        cache = kv_caches[self._layer_name]
        want = (len(self.layer_ids), self.hidden_size)
        if cache.dim() != 4 or (cache.shape[1], cache.shape[3]) != want:
            raise ValueError(f"hidden-state cache of shape {tuple(cache.shape)}: expected [blocks, {want[0]}, "
                             f"block_size, {want[1]}] as vLLM's basic_cache writes it")
        log.info("regen connector: layer %s, cache %s %s, staging %s, writer %s", self._layer_name,
                 tuple(cache.shape), cache.dtype, self.staging_dir, self._writer)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def wait_for_save(self) -> None:
        return  # writes are synchronous, in save_kv_layer

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        if layer_name != self._layer_name or not self._writer or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, RegenConnectorMetadata):
            return
        for save in meta.saves:
            self._save(save, kv_layer)

    def _save(self, save: _Save, kv_layer: torch.Tensor) -> None:
        t = save.target
        status_path = None
        try:
            path = os.path.realpath(str(t["path"]))
            if os.path.dirname(path) != self.staging_dir:
                raise ValueError(f"path {path} is not a file directly under the staging dir {self.staging_dir}")
            status_path, row = path + ".rows", int(t["row"])
            dtype = DTYPES.get(t["dtype"])
            if dtype is None or dtype != kv_layer.dtype:
                raise ValueError(f"the request wants {t['dtype']} states, the engine caches {kv_layer.dtype} "
                                 "(start the server with --dtype of the run's feature dtype)")
            if list(t.get("layer_ids") or []) != self.layer_ids:
                raise ValueError(f"the request wants capture ids {t.get('layer_ids')}, the engine captures "
                                 f"{self.layer_ids} (its eagle_aux_hidden_state_layer_ids)")
            n, T, H = int(save.num_tokens), len(self.layer_ids) - 1, self.hidden_size
            if int(t["num_tokens"]) != n or int(t["num_taps"]) != T or int(t["hidden_size"]) != H:
                raise ValueError(f"request declares {t['num_tokens']} tokens, {t['num_taps']} taps, hidden "
                                 f"{t['hidden_size']}; the engine ran {n} tokens, {T} taps, hidden {H}")
            bs = kv_layer.shape[2]
            blocks = torch.tensor(save.block_ids, dtype=torch.int64, device=kv_layer.device)
            slots = (blocks[:, None] * bs + torch.arange(bs, device=kv_layer.device)).flatten()[:n]
            if slots.numel() < n:
                raise ValueError(f"{len(save.block_ids)} KV blocks of {bs} hold fewer than the prompt's {n} tokens")
            states = kv_layer[slots // bs, :, slots % bs]  # [n, T+1, H], indexed as vLLM's basic_cache wrote it
            taps = states[:, :T, :].reshape(n, T * H).contiguous().cpu()
            last = states[:, T, :].contiguous().cpu()
            fd = os.open(path, os.O_WRONLY)
            try:
                end = max(int(t["taps_offset"]) + taps.numel() * taps.element_size(),
                          int(t["last_offset"]) + last.numel() * last.element_size())
                if os.fstat(fd).st_size < end:
                    raise ValueError(f"{path} is {os.fstat(fd).st_size} bytes, the row ends at byte {end}")
                _write_all(fd, taps, int(t["taps_offset"]))
                _write_all(fd, last, int(t["last_offset"]))
            finally:
                os.close(fd)
            self._mark(status_path, row, 1)
        except Exception as exc:  # noqa: BLE001 - reported to the producer through the status file, never fatal
            log.exception("regen connector: request %s: hidden states not written", save.req_id)
            if status_path is not None:
                try:
                    with open(f"{status_path[:-5]}.row{int(t['row'])}.err", "w") as f:
                        f.write(f"{type(exc).__name__}: {exc}")
                    self._mark(status_path, int(t["row"]), 2)
                except (OSError, ValueError, KeyError):
                    pass

    @staticmethod
    def _mark(status_path: str, row: int, value: int) -> None:
        fd = os.open(status_path, os.O_WRONLY)
        try:
            os.pwrite(fd, bytes([value]), row)
        finally:
            os.close(fd)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None
