"""The two passes of `regen.report.rehearse` (`regen.rehearse`): one optimizer step of the trainer at its real size on
stand-in tensors.

The trainer's own code runs (`regen.train.build.build_draft`, `step.share_frozen_with_target`, `make_objective`,
`parallel.shard_model` (FSDP2), `step.prepare_microbatch`, the feature path through `features.client.RemoteFeatures`
and `features.staging.Staging` (the CUDA seam stood in for), `step.train_step` (loss, clip, AdamW step) and the
checkpoint's `parallel.gathered_model_state`), on tensors that hold no memory, in two passes:

1. **memory** (two optimizer steps: the second is the steady state, AdamW's moments held; `FakeTensorMode`, a fake
   process group of W ranks: `FakeStore`, backend "fake", a cpu mesh made before fake mode): `FSDPMemTracker` gives
   rank 0's peak by kind (sharded/unsharded parameters, gradients, activations, temporaries, all-gather/reduce-scatter
   buffers, optimizer state), set beside `regen plan`'s terms (`regen.report.plan.draft_plan` -> `regen.train.memory`)
   with the ratio. Every collective is listed with its tensors' devices and group. The frozen embed/lm_head sit outside
   FSDP (replicated), so the tracker does not see them: they are added from their tensors' sizes.
2. **placement and syncs** (the `meta` device stands in for the GPU; the same step without FSDP): a host tensor
   meeting a device one fails the rehearsal, naming the op and the line; every host sync (`.item()`, a copy to
   the host, `nonzero`, boolean masks, `unique`) is listed per micro-batch with its line
   (`regen.train.rehearse_modes`). Data-dependent shapes take their upper bound (every slot supervised).

Shapes: rows of `train.max_tokens` tokens (B = 1 per micro-batch: the feed's token budget), a quarter of each row
prompt (not supervised), `train.num_anchors` anchors, `train.grad_accum` micro-batches, W = `plan.world_size`.
The compute dtype is the CUDA one (`train.dtype` auto -> bfloat16). What it cannot see: kernels' workspaces, the
CUDA context and NCCL buffers, allocator fragmentation. With `train.attention: flex` (`flex_on_stand_ins`) the block
mask is built by the eager `create_block_mask` (the GPU runs the compiled one: the same BlockMask, without the eager
builder's [Q, L] index grids, which are freed before the forward); flex_attention's forward and backward are the
higher-order op's registered fake implementations in the memory pass (the outputs, logsumexp and gradients the
fused kernel allocates, never the dense scores) and its eager implementation on `meta` in the placement pass.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

# ---------------------------------------------------------------------------------------------- set-up


def _microbatches(cfg, shape, seed: int = 0):
    """Feed-like micro-batches (epoch 0, index i): int64[1, S] ids < the output vocabulary, a quarter prompt."""
    from types import SimpleNamespace

    import torch

    S, out = shape["tokens"], []
    g = torch.Generator().manual_seed(seed)
    for i in range(shape["grad_accum"]):
        ids = torch.randint(0, cfg.draft_vocab_size or cfg.vocab_size, (1, S), generator=g)
        lm = torch.zeros(1, S, dtype=torch.long)
        lm[:, S // 4:] = 1
        out.append(SimpleNamespace(epoch=0, index=i, sample_ids=[f"rehearsal-{i}"], input_ids=ids,
                                   attention_mask=torch.ones(1, S, dtype=torch.long), loss_mask=lm))
    return out


class StandInOps:
    """`staging._CudaOps` with the device stood in for: host slots are real (lazily allocated, never touched but
    for the header), device buffers are made on `device` (fake or meta), copies and events are no-ops."""

    def __init__(self, device):
        self.device = device

    def pinned(self, nbytes):
        import torch
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return torch.empty(nbytes, dtype=torch.uint8)

    def device_buffer(self, nbytes):
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy_async(self, dst, src):
        pass  # the copy moves bytes only; its memory is the device buffer (and a real copy would touch gigabytes)

    def side_wait(self, event):
        pass

    def train_wait(self, event, dev):
        pass

    def train_event(self):
        return None

    def host_wait(self, event):
        pass

    def on_copy_stream(self):
        return contextlib.nullcontext()


class _Store:
    """The store's reading side (`size`, `get_into`, `register`): each object's header written, its tensor bytes
    left unwritten (nothing reads them on stand-in tensors)."""

    def __init__(self):
        self.objects: dict[str, tuple[bytes, int]] = {}

    def register(self, buf):
        pass

    def unregister(self, buf):
        pass

    def size(self, key):
        return self.objects[key][1]

    def get_into(self, key, buf, nbytes):
        head, _ = self.objects[key]
        buf[:len(head)].numpy()[:] = memoryview(head)


def _remote_features(cfg, shape, head, mbs, device):
    """`RemoteFeatures` over `_Store` with a dispatcher that has every object ready; its staging on `device`."""
    import torch

    from regen.train.features import client
    from regen.train.features.contract import FeatureSpec, encode, make_header
    from regen.train.features.staging import Staging

    spec = FeatureSpec(namespace="rehearsal", target_layer_ids=cfg.target_layer_ids,
                       aux_hidden_stream=cfg.aux_hidden_stream, dtype="bfloat16",
                       target_hidden_size=cfg.target_hidden_size,
                       target_num_hidden_layers=cfg.target_num_hidden_layers, target_revision="rehearsal")
    store = _Store()
    T, Ht = len(cfg.target_layer_ids), cfg.target_hidden_size
    for mb in mbs:
        h = make_header(spec, epoch=mb.epoch, index=mb.index, attempt=0, sample_ids=mb.sample_ids,
                        input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                        producer={"id": "rehearsal", "engine": "rehearsal"}, stream_reading="rehearsal")
        S = mb.input_ids.shape[1]
        parts, total = encode(h, torch.empty(1, S, T * Ht, dtype=torch.bfloat16),  # never touched: no memory
                              torch.empty(1, S, Ht, dtype=torch.bfloat16))
        store.objects[f"rehearsal/{mb.index}"] = (bytes(parts[0]), total)

    def post(url, path, body, timeout_s=None):
        if path == "/wait":
            key = f"rehearsal/{body['index']}"
            return {"status": "ready", "key": key, "nbytes": store.size(key)}
        return {}

    client.post = post  # the module's name for the dispatcher call (restored by the caller)
    rf = client.RemoteFeatures("http://rehearsal.invalid", store, spec, head, device)
    rf.staging = Staging(device, ops=StandInOps(device), register=store.register, unregister=store.unregister)
    return rf


class _InProcess:
    """Features computed in the trainer's process (`train.features: in_process`): one micro-batch's at a time."""

    def __init__(self, cfg, device):
        self.cfg, self.device = cfg, device

    def features_of(self, batch):
        import torch

        B, S = batch["input_ids"].shape
        T, Ht = len(self.cfg.target_layer_ids), self.cfg.target_hidden_size
        return (torch.empty(B, S, T * Ht, dtype=torch.bfloat16, device=self.device),
                torch.empty(B, S, Ht, dtype=torch.bfloat16, device=self.device))


class _Phases:
    """Wraps a feature source: sets `watch.phase` per micro-batch (from `features_of` to `release`), and resets
    the memory tracker's per-module statistics for each new forward of the root (gradient accumulation)."""

    def __init__(self, source, watch, tracker=None):
        self.source, self.watch, self.tracker, self.i = source, watch, tracker, 0

    def features_of(self, batch):
        self.watch.phase = f"micro-batch {self.i}"
        self.i += 1
        if self.tracker is not None:
            self.tracker.reset_mod_stats()
        return self.source.features_of(batch)

    def release(self, batch):
        getattr(self.source, "release", lambda b: None)(batch)
        self.watch.phase = "step"

    def take_breaches(self):
        return getattr(self.source, "take_breaches", dict)()


def _head(cfg, tc, device, dtype):
    """The trainer rank's target head (`TargetHead`: embeddings, final norm, LM head) on `device`, empty."""
    import warnings

    import torch
    from torch import nn

    from regen.train.target_head import TargetHead, _HeadOnlyModel, _PlainRMSNorm

    V, H = cfg.vocab_size, cfg.target_hidden_size
    emb = nn.Embedding(V, H, device="meta")
    emb.weight = nn.Parameter(torch.empty(V, H, dtype=dtype, device=device), requires_grad=False)
    lm = nn.Linear(H, V, bias=False, device="meta")
    lm.weight = nn.Parameter(torch.empty(V, H, dtype=dtype, device=device), requires_grad=False)
    norm = _PlainRMSNorm(torch.ones(H, dtype=dtype, device=device), getattr(tc, "rms_norm_eps", 1e-6) or 1e-6)
    with warnings.catch_warnings():  # TargetHead counts its bytes by storage pointer: fake ones warn
        warnings.simplefilter("ignore")
        return TargetHead(_HeadOnlyModel(tc, emb, lm), tc, norm, {"embed": emb.weight, "lm_head": lm.weight,
                                                                   "norm": norm.weight}, Path("rehearsal"))


@contextlib.contextmanager
def _meta_module_build():
    """`build_draft` builds its module tree on `meta`; inside fake mode that tree cannot be `to_empty`-ed (its
    tensors would be fake meta tensors), so the tree is built with fake mode off, then materialised inside it."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    import regen.train.model as model_mod

    orig = model_mod.DSparkDraft

    def outside(cfg):
        with unset_fake_temporarily():
            return orig(cfg)

    model_mod.DSparkDraft = outside
    try:
        yield
    finally:
        model_mod.DSparkDraft = orig


def _build(profile, cfg, tc, shape, device, *, fsdp: bool, mesh=None):
    """(model, optimizer, target head) as `regen.train.trainer.Trainer.build` builds them, on `device`."""
    import torch

    from regen.train.build import build_draft
    from regen.train.parallel import DistInfo, shard_model
    from regen.train.step import make_objective, share_frozen_with_target

    t = profile.train
    dtype = torch.float32 if shape["dtype"] == "float32" else torch.bfloat16
    head = _head(cfg, tc, device, dtype)
    vocab = torch.arange(cfg.draft_vocab_size) if cfg.draft_vocab_size else None
    with _meta_module_build():
        draft = build_draft(head.model, cfg, device, draft_vocab=vocab, frozen_dtype=dtype)
    draft.attention_impl = shape["attention"]  # the CUDA choice (`attention.training_impl` refuses flex off CUDA)
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)  # fake parameters cannot be swapped in place
    try:
        share_frozen_with_target(draft, head.model, dtype)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
    model = make_objective(draft)
    if fsdp:
        import torch.distributed.device_mesh as dm

        info = DistInfo(0, shape["world_size"], 0, torch.device(device), "fake")
        orig, dm.init_device_mesh = dm.init_device_mesh, (lambda *a, **k: mesh)
        try:
            model = shard_model(model, info, blocks=draft.layers,
                                param_dtype=None if dtype == torch.float32 else dtype)
        finally:
            dm.init_device_mesh = orig
    else:  # the placement pass: one unsharded copy (FSDP2 has no meta mesh); accumulation is a no-op here
        model.set_requires_gradient_sync = lambda sync: None
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=t.lr, betas=tuple(t.betas),
                            eps=t.adam_eps, weight_decay=t.weight_decay)
    return model, opt, head, draft


def _t2d(cfg):
    import torch

    if not cfg.draft_vocab_size:
        return None
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[:cfg.draft_vocab_size] = True
    return t2d


def _features(profile, cfg, shape, head, mbs, device):
    if shape["features"] == "producers":
        return _remote_features(cfg, shape, head, mbs, device)
    return _InProcess(cfg, device)


# ---------------------------------------------------------------------------------------------- the passes


def memory_pass(profile, cfg, tc, shape) -> dict:
    """Pass 1 (fake tensors, FSDP2 over W fake ranks): rank 0's peak by kind, the collectives, syncs seen."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils._python_dispatch import _disable_current_modes

    from regen.train import collectives
    from regen.train.features import client
    from regen.train.parallel import gathered_model_state
    from regen.train.rehearse_modes import Watch
    from regen.train.step import prepare_microbatch, train_step

    mesh = DeviceMesh("cpu", list(range(shape["world_size"])))  # before fake mode (it reads ranks to the host)
    mbs = _microbatches(cfg, shape)
    post = client.post
    watch = Watch()
    with FakeTensorMode(allow_non_fake_inputs=True):
        with watch:  # host work of the build (the draft vocabulary's ids) runs on real tensors
            model, opt, head, draft = _build(profile, cfg, tc, shape, "cpu", fsdp=True, mesh=mesh)
        frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
        with _disable_current_modes():  # host work on the feed's tensors (reads them: not under fake mode)
            batches = [prepare_microbatch(mb, 0, cfg, torch.device("cpu"), _t2d(cfg)) for mb in mbs]
        tracker = FSDPMemTracker(model, opt)
        # flex_attention's HOP passes through the tracker whole (it counts the outputs it returns: with fake
        # tensors, the fused kernel's outputs, logsumexp and gradients)
        tracker.supports_higher_order_operators = True
        try:
            with _disable_current_modes():  # the producer's side and the host reads (numpy): not fake
                source = _features(profile, cfg, shape, head, mbs, "cpu")
            for _ in range(2):  # the second step is the steady state: AdamW's moments exist through its forward
                if hasattr(source, "fetch"):
                    with _disable_current_modes():
                        _fetch(source, mbs)
                with tracker, watch, efficient_attention():
                    m = train_step(model, _Phases(source, watch, tracker), opt, batches,
                                   loss_weights=tuple(profile.train.loss_weights), grad_clip=profile.train.grad_clip,
                                   loss_normalization=profile.train.loss_normalization)
            watch.phase = "checkpoint"
            with watch:
                gathered_model_state(model, keep=lambda name: "embed_tokens" not in name and "lm_head" not in name)
        finally:
            client.post = post
        peak = {k: int(v) for k, v in next(iter(tracker.get_tracker_snapshot("peak").values())).items()}
    peak.pop("Total", None)
    peak["Frozen (replicated)"] = frozen
    groups = {dist.group.WORLD.group_name: "hot (default group)"}
    plane = collectives.planes()
    if plane.control is not None:
        groups[plane.control.group_name] = "control"
    return {"peak": peak, "finite": bool(m["finite"]), "optimizer_states": len(opt.state),
            "events": watch.events, "group_names": groups}


@contextlib.contextmanager
def efficient_attention():
    """SDPA as CUDA runs it here (`regen.train.attention` pins memory-efficient attention): the memory-efficient
    kernel's own op (`aten._scaled_dot_product_efficient_attention`, whose fake implementation gives its outputs,
    logsumexp and what autograd saves), with the bool mask turned into the additive bias SDPA makes of it (padded
    to a multiple of 16 keys, as `sdp_utils` pads it). On fake CPU tensors SDPA would otherwise take the CPU
    kernels, which save other tensors."""
    import torch
    import torch.nn.functional as F

    orig = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        bias = None
        if attn_mask is not None:
            L = attn_mask.shape[-1]
            pad = (-L) % 16
            full = torch.zeros(*attn_mask.shape[:-1], L + pad, dtype=q.dtype, device=q.device)
            bias = full[..., :L].masked_fill_(~attn_mask, float("-inf"))
            bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], L)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, dropout_p, is_causal, scale=scale)[0]

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = orig


def _fetch(source, mbs):
    """`RemoteFeatures.fetch`. In the memory pass it reads host memory (the header, through numpy), which fake
    mode cannot, so it runs with the modes off; its last act, the first object's device copy, then makes a real
    (untouched) buffer the tracker does not count: the peak is taken from later micro-batches (grad_accum >= 3)."""
    failures = source.fetch(mbs)
    if failures:
        raise RuntimeError(f"rehearsal features failed: {failures}")


def placement_pass(profile, cfg, tc, shape) -> dict:
    """Pass 2 (the `meta` device for the GPU, no FSDP): placement errors and host syncs, with their lines."""
    import torch
    import torch.nn.utils.clip_grad as clip

    from regen.train.features import client
    from regen.train.rehearse_modes import Watch
    from regen.train.step import prepare_microbatch, train_step

    dev = torch.device("meta")
    mbs = _microbatches(cfg, shape)
    watch = Watch(device="meta")
    post, foreach = client.post, clip._device_has_foreach_support
    clip._device_has_foreach_support = lambda d: d.type == "meta" or foreach(d)  # CUDA's foreach clip, on meta
    try:
        with watch:
            model, opt, head, draft = _build(profile, cfg, tc, shape, dev, fsdp=False)
            watch.phase = "prepare"
            batches = [prepare_microbatch(mb, 0, cfg, dev, _t2d(cfg)) for mb in mbs]
            watch.phase = "fetch"
            source = _features(profile, cfg, shape, head, mbs, dev)
            if hasattr(source, "fetch"):
                _fetch(source, mbs)
            watch.phase = "step"
            m = train_step(model, _Phases(source, watch), opt, batches,
                           loss_weights=tuple(profile.train.loss_weights), grad_clip=profile.train.grad_clip,
                           loss_normalization=profile.train.loss_normalization)
    finally:
        client.post, clip._device_has_foreach_support = post, foreach
    return {"events": watch.events, "finite": bool(m["finite"])}


@contextlib.contextmanager
def fake_world(world_size: int):
    """A fake process group of `world_size` ranks (this process is rank 0) with the trainer's two planes: the
    default group (hot) and a control group, both fake. Restores the state it found."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from regen.train import collectives

    if dist.is_initialized():
        raise RuntimeError("regen rehearse needs a process without a process group (it makes a fake one)")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    saved = collectives._planes
    try:
        control = dist.new_group(backend="fake")
        collectives._planes = collectives._Planes("fake", "fake", control, 1800.0, 2100.0, dist.group.WORLD)
        yield
    finally:
        collectives._planes = saved
        dist.destroy_process_group()


@contextlib.contextmanager
def flex_on_stand_ins():
    """flex_attention's backward allowed on the rehearsal's CPU stand-ins. torch refuses flex's backward on CPU
    tensors (`flex_attention._validate_device`: its CPU kernel has none); the rehearsal's tensors are fake (the
    HOP's registered fake forward and backward: the outputs, logsumexp and gradients a fused kernel allocates,
    never the dense scores) or meta (no kernel runs), standing in for CUDA, so the guard is lifted inside this
    block only and restored after. Eager flex also wraps the op in `torch.compile(backend="eager",
    fullgraph=True)`, which finds no frame to compile under the rehearsal's dispatch modes; the op is called
    directly instead (`_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG`, restored too). torch 2.13 names both."""
    import torch.nn.attention.flex_attention as fa

    guard, debug = fa._validate_device, fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    fa._validate_device = lambda q, k, v: None
    fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        yield
    finally:
        fa._validate_device, fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = guard, debug
