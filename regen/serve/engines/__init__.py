"""The trained draft handed to the serving engines people serve with: one adapter module per engine.

In:  a trainer step folder (`regen.train.checkpoint`: config.json + model.safetensors in regen's own names)
Out: `<out>/<engine>/`: the engine's own layout (a Hugging Face folder, or a GGUF for llama.cpp), launch.json and
     launch.sh (the exact launch: speculative config with the widths the engine derives from this draft, the tap
     stream and how the engine is told it, the environment, the engine version the layout was checked against)

Modules, in reading order:
    draft.py       read a step folder (finite weights only); Refusal / EngineRefused; the export's files
    k3_mla.py      the K3DSparkModel layout (TokenSpeed, vLLM): MLA, full vocabulary
    hf_gqa.py      the Qwen3DSparkModel layout (vLLM, SGLang): GQA, DFlash-family names
    tokenspeed.py  vllm.py  sglang.py  llama_cpp.py (GGUF `dflash`): refusals(cfg), launch(cfg), export(...)
    cli.py         `regen export-draft`
    spec_eval.py   `regen engine-eval`: the draft served by llama.cpp beside the embedded target, acceptance read
                   from the engine's counters (the round trip)
    endpoint.py    a served endpoint regen does not start: the engines' /metrics counters, /v1/models, streamed chat
    endpoint_eval.py `regen engine-eval --endpoint`: per held-out cell and benchmark set, at each concurrency

Each engine's contract is pinned to one released version and checked by that engine's own code in
tests/serve/test_engine_contracts.py; the draft model (regen.train.model) knows no engine.
Entry point: `export_draft(draft, engine, out, ...)`.
"""
from __future__ import annotations

from pathlib import Path

from regen.serve.engines import llama_cpp, sglang, tokenspeed, vllm

# engine name -> adapter module (each: ENGINE, PACKAGE, PINNED_VERSION, refusals(cfg), launch(cfg), export(...))
ENGINES = {"tokenspeed": tokenspeed, "vllm": vllm, "sglang": sglang, "llama.cpp": llama_cpp}


def support(cfg) -> dict:
    """{engine: [Refusal, ...]} for a DSparkConfig: an empty list means the engine can serve the draft."""
    return {name: mod.refusals(cfg) for name, mod in ENGINES.items()}


def support_report(cfg) -> dict:
    """{engine: {"serves": bool, "version": pinned, "refusals": [line, ...]}}: what plan and preflight print."""
    return {name: {"serves": not refused, "version": f"{ENGINES[name].PACKAGE}=={ENGINES[name].PINNED_VERSION}",
                   "refusals": [r.line() for r in refused]}
            for name, refused in support(cfg).items()}


def check(cfg, engines, rep) -> None:
    """The serving engines' check before a run (`regen.preflight`): the draft a profile will train (`cfg`, a
    DSparkConfig: `regen.train.preflight.check` returns it) against every engine's contract. A problem on `rep` (a
    `regen.errors.CheckReport`) for each engine of `engines` (`train.serve_engines`) that refuses it, with every
    field and its remedy, and one when no engine can serve it at all."""
    refused = support(cfg)
    serves = [name for name, r in refused.items() if not r]
    for name in engines:
        if refused[name]:
            rep.bad(f"train.serve_engines lists {name}, which cannot serve the draft this profile trains: "
                    + "; ".join(r.line() for r in refused[name]))
    if not serves:
        rep.bad("train: no serving engine can load the draft this profile trains (docs/serve.md): "
                + "; ".join(r.line() for rs in refused.values() for r in rs))
    elif not any(refused[name] for name in engines):
        others = [n for n in refused if n not in serves]
        rep.ok(f"train: the draft will load in {', '.join(serves)}"
               + (f" (not in {', '.join(others)})" if others else ""))


def export_draft(draft: str | Path, engine: str, out: str | Path, *, target_gguf: str | Path | None = None,
                 target_path: str | None = None) -> dict:
    """Export the draft in `draft` (a step folder, `<run>/train` or a run directory) for `engine` into `out`.

    Returns the launch record. Raises InputError for an unknown engine or a missing/diverged checkpoint, and
    EngineRefused (an InputError listing every field with its remedy) when the engine cannot serve the draft;
    nothing is written then."""
    from regen.errors import InputError
    from regen.serve.engines.draft import load_draft_checkpoint

    if engine not in ENGINES:
        raise InputError(f"--engine {engine!r}: choose one of {', '.join(ENGINES)}")
    ckpt = load_draft_checkpoint(draft)
    kwargs = {"target_path": target_path}
    if engine == "llama.cpp":
        if target_gguf is None:
            raise InputError("--engine llama.cpp needs --target-gguf: the GGUF llama.cpp serves the target from "
                             "(the local profile's: data/models/smollm2-135m/engine-q8_0.gguf)")
        kwargs["target_gguf"] = Path(target_gguf)
    return ENGINES[engine].export(ckpt, Path(out), **kwargs)


def serving_rows(report: dict | None) -> list[list[str]]:
    """`regen plan`'s table rows for a `support_report`: one per engine (figure, value, how)."""
    return [[f"served by {name}", "yes" if s["serves"] else "no",
             s["version"] + ("" if s["serves"] else ": " + "; ".join(s["refusals"]))]
            for name, s in (report or {}).items()]
