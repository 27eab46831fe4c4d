"""`regen export-draft`: a trained draft in a serving engine's own layout, with its exact launch.

    regen export-draft --run runs/local --engine llama.cpp                 # the run's latest step, the profile's
                                                                           # target GGUF -> runs/local/export/llama.cpp
    regen export-draft --run runs/k3 --profile kimi-k3 --engine tokenspeed --out /models/k3-draft-tokenspeed
    regen export-draft --run runs/local --engine all                       # every engine that can serve it
    regen export-draft --run runs/local --engine all --check               # say which engines serve it; write nothing

Defaults come from the profile: the draft is `<run>/train` (its latest step folder; `--draft` takes any step
folder), the target is `train.target`, llama.cpp's target GGUF is the embedded target's
(`serve.model_dir/engine-<serve.gguf_type>.gguf`). An engine that cannot serve the draft is refused with every
reason and remedy (exit status 2), and nothing is written for it; with `--engine all` the others are written and
the refusals listed. docs/serve.md has each engine's launch and the acceptance metric to read.
"""
from __future__ import annotations

import json


def add_arguments(parser) -> None:
    from regen.config import add_profile_arguments
    from regen.serve.engines import ENGINES

    add_profile_arguments(parser)
    parser.add_argument("--engine", required=True, choices=[*ENGINES, "all"], help="the serving engine")
    parser.add_argument("--draft", default=None, help="a step folder, or a folder with latest.json (default: "
                        "<run>/train, its latest step)")
    parser.add_argument("--out", default=None, help="output folder (default <run>/export/<engine>; with --engine "
                        "all, one subfolder per engine)")
    parser.add_argument("--target", default=None, help="the target's HF checkpoint directory (default "
                        "train.target): the lm_head rows of a reduced-vocabulary draft")
    parser.add_argument("--target-gguf", default=None, help="llama.cpp: the GGUF the engine serves the target "
                        "from (default: the embedded target's engine GGUF)")
    parser.add_argument("--check", action="store_true", help="only say which engines can serve the draft")


def default_target_gguf(profile):
    """The embedded target's engine GGUF (`serve.model_dir/engine-<gguf_type>.gguf`), or None when the profile
    serves no embedded target."""
    from regen.config import resolve_path
    from regen.target.gguf_weights import gguf_name

    serve = profile.serve
    if not serve.enabled or not serve.model_dir:
        return None
    return resolve_path(serve.model_dir) / gguf_name(serve.gguf_type)


def main(args) -> int:
    from pathlib import Path

    from regen.config import load_profile_from_args
    from regen.errors import InputError
    from regen.serve.engines import ENGINES, export_draft
    from regen.serve.engines.draft import EngineRefused, load_draft_checkpoint

    profile, run = load_profile_from_args(args)
    draft = args.draft or run.train
    target = args.target or profile.train.target
    gguf = args.target_gguf or default_target_gguf(profile)
    if args.check:
        ckpt = load_draft_checkpoint(draft)
        report = {name: [r.line() for r in mod.refusals(ckpt.config)] for name, mod in ENGINES.items()}
        for name, lines in report.items():
            print(f"{name} ({ENGINES[name].PACKAGE}=={ENGINES[name].PINNED_VERSION}): "
                  + ("serves this draft" if not lines else "refuses:\n    " + "\n    ".join(lines)))
        return 0 if any(not v for v in report.values()) else 2
    names = list(ENGINES) if args.engine == "all" else [args.engine]
    base = Path(args.out) if args.out else run.root / "export"
    written, refused = {}, {}
    for name in names:
        out = (base / name) if (args.engine == "all" or not args.out) else base
        try:
            rec = export_draft(draft, name, out, target_gguf=gguf, target_path=target)
        except EngineRefused as exc:
            if args.engine != "all":
                raise
            refused[name] = [r.line() for r in exc.refusals]
            continue
        written[name] = str(out)
        print(f"regen export-draft: {name}: {out} (launch: {out}/launch.sh; checked against "
              f"{rec['engine_version']})")
    for name, lines in refused.items():
        print(f"regen export-draft: {name} refuses this draft:\n    " + "\n    ".join(lines))
    if not written:
        raise InputError("no engine can serve this draft:\n" + "\n".join(f"  - {x}" for v in refused.values()
                                                                        for x in v))
    print(json.dumps({"written": written, "refused": refused}, indent=2))
    return 0
