"""The trained draft as the exporters read it, what an engine cannot represent, and the export's own files.

    load_draft_checkpoint(path)   a trainer step folder (or `<run>/train`, or a run directory: the latest step)
                                  -> DraftCheckpoint(config, tensors, sha256, training meta)
    Refusal / EngineRefused       what one engine cannot represent: the engine, the field, the value, the reason
                                  and the remedy; never a file that loads into the wrong model
    write_hf_folder               config.json + model.safetensors, written under a temporary name and renamed
    write_launch                  launch.json (the engine, its pinned version, the widths, the tap stream, the
                                  environment) and launch.sh (the command line) beside the weights

Every engine module (regen.serve.engines.<engine>) refuses first, then writes; the draft's own tensors are the
trainer's (`regen.train.model.DSparkDraft.state_dict()` names, spec §8), read from `model.safetensors`.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from regen.errors import InputError


@dataclass(frozen=True)
class Refusal:
    """One thing `engine` cannot represent: `field` (a DSparkConfig field or `weights`) is `value` because of
    `reason`; `remedy` says what to do (another engine, or a training setting)."""

    engine: str
    field: str
    value: object
    reason: str
    remedy: str

    def line(self) -> str:
        return f"{self.engine}: {self.field}={self.value!r}: {self.reason}; {self.remedy}"

    def to_dict(self) -> dict:
        return {"engine": self.engine, "field": self.field, "value": self.value, "reason": self.reason,
                "remedy": self.remedy}


class EngineRefused(InputError):
    """The draft cannot be served by the engine asked for; `refusals` lists every reason (Refusal), each with
    its remedy. Nothing was written."""

    def __init__(self, engine: str, refusals: list[Refusal], draft: str = ""):
        self.engine = engine
        self.refusals = list(refusals)
        where = f" {draft}" if draft else ""
        super().__init__(f"{engine} cannot serve the draft{where}:\n" + "\n".join(f"  - {r.line()}" for r in refusals))


@dataclass
class DraftCheckpoint:
    """A trainer step folder read for export.

    config: regen.train.draft_config.DSparkConfig; tensors: {name: torch.Tensor} as saved (fp32 weights, `d2t`
    int64[Vd] EAGLE-3 offsets and `t2d` bool[V] with a reduced vocabulary; no `embed_tokens`/`lm_head` unless
    the trainer was asked to include them); sha256: of model.safetensors; training: training.json (target path,
    shards digest, step) or {}.
    """

    path: Path
    config: object
    tensors: dict
    sha256: str
    training: dict = field(default_factory=dict)

    @property
    def step(self) -> int | None:
        return self.training.get("step")


def load_draft_checkpoint(path: str | Path) -> DraftCheckpoint:
    """Read a trainer step folder for export. InputError when it is missing, is not a regen draft
    folder (an engine's export given back), or holds a non-finite weight (a diverged run: the engine would serve
    NaN); CheckpointError when a file differs from its MANIFEST.json (`regen.train.checkpoint.check_intact`)."""
    from regen.train.checkpoint import find_draft, load_servable_weights
    from regen.train.draft_config import CONFIG_NAME, WEIGHTS_NAME, DSparkConfig
    from schemas.io import read_json, sha256_file

    folder = find_draft(path)
    try:
        cfg = DSparkConfig.from_json(folder / CONFIG_NAME)
    except ValueError as exc:
        raise InputError(f"{folder / CONFIG_NAME}: {exc}") from None
    weights = folder / WEIGHTS_NAME
    tensors = load_servable_weights(folder)  # MANIFEST.json verified, every weight finite
    return DraftCheckpoint(folder, cfg, tensors, sha256_file(weights), read_json(folder / "training.json") or {})


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` folder to `out` (an earlier export there is replaced whole, never merged)."""
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)


def staging_dir(out: Path) -> Path:
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def write_hf_folder(folder: Path, config: dict, tensors: dict) -> None:
    """`config.json` + `model.safetensors` in `folder` (tensors contiguous, CPU; dtypes as given)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_launch(folder: Path, launch: dict) -> None:
    """`launch.json` (the whole launch record) and `launch.sh` (its `command`, shell-quoted, with its `env`)."""
    (folder / "launch.json").write_text(json.dumps(launch, indent=2) + "\n")
    env = "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in launch.get("env", {}).items())
    parts, line = [], []
    for a in launch["command"]:  # one option and its value per line
        if str(a).startswith("-") and line:
            parts.append(" ".join(line))
            line = []
        line.append(shlex.quote(str(a)))
    cmd = " \\\n  ".join(parts + [" ".join(line)])
    notes = "".join(f"# {line}\n" for line in launch.get("notes", []))
    script = folder / "launch.sh"
    script.write_text(f"#!/usr/bin/env bash\n# {launch['engine']} {launch['engine_version']}: written by regen "
                      f"export-draft (docs/serve.md)\n{notes}set -euo pipefail\n{env}{cmd}\n")
    os.chmod(script, 0o755)


def draft_block_size(gguf_path: str | Path) -> int:
    """`dflash.block_size` of a draft GGUF: the tokens a round must draft (llama.cpp's n_max). InputError when the
    file is missing or is not a DSpark draft GGUF."""
    import gguf

    p = Path(gguf_path)
    if not p.is_file():
        raise InputError(f"--draft {p}: not found; write it with `regen export-draft --engine llama.cpp`")
    fields = gguf.GGUFReader(str(p)).fields
    if "dflash.block_size" not in fields:
        raise InputError(f"--draft {p}: not a DSpark draft GGUF (no dflash.block_size); write it with `regen "
                         "export-draft --engine llama.cpp`")
    return int(fields["dflash.block_size"].contents())


def provenance(ckpt: DraftCheckpoint) -> dict:
    """Where the exported draft came from: the step folder, its weights' sha256, the trainer's step and target."""
    return {"step_folder": str(ckpt.path), "model_safetensors_sha256": ckpt.sha256, "step": ckpt.step,
            "target": ckpt.training.get("target"), "block_size": ckpt.config.block_size}


def write_export(ckpt: DraftCheckpoint, out: Path, config: dict, tensors: dict, launch: dict) -> dict:
    """An engine's Hugging Face folder at `out`: config.json, model.safetensors, launch.json and launch.sh, written
    in a staging folder and moved into place whole. Returns the launch record (with the draft's provenance)."""
    tmp = staging_dir(Path(out))
    write_hf_folder(tmp, config, tensors)
    record = {**launch, "draft": provenance(ckpt),
              "files": ["config.json", "model.safetensors", "launch.json", "launch.sh"]}
    write_launch(tmp, record)
    replace_dir(tmp, Path(out))
    return record


def verification_record(endpoints: dict, how: str) -> dict:
    """The launch's `verification`: how the engine drafts and verifies at T > 0, named as `regen eval` names it
    (`regen.train.verification`: draft_sample_method probabilistic | greedy, rejection_sample_method standard |
    block), and the `regen eval` flags that predict what the engine's counters report.

    endpoints: {endpoint name: {"draft_sample_method", "rejection_sample_method", ...how to launch it}}; the first
    is the launch's own command. `how`: where the engine reads the choice (its flag, config key or environment)."""
    drafts = ",".join(dict.fromkeys(e["draft_sample_method"] for e in endpoints.values()))
    rejects = ",".join(dict.fromkeys(e["rejection_sample_method"] for e in endpoints.values()))
    return {"endpoints": endpoints, "how": how,
            "regen_eval": ["regen", "eval", "--temperature", "1.0", "--draft-sample-method", drafts,
                           "--rejection-sample-method", rejects],
            "note": "at T = 0 every method is greedy verification (regen eval's top-level figures); at T > 0 "
                    "regen eval's served[<draft_sample_method>+<rejection_sample_method>] predicts the engine's "
                    "acc_len on the same prompts"}
