"""Profiles: one YAML file in `data/profiles/<name>.yaml`, validated into typed sub-configs.

Each stage receives only its sub-config (`profile.select`, `profile.generate`, ...). Command-line overrides
use dotted keys: `--set select.total=300 --set generate.max_in_flight=64`; values parse as YAML scalars.
Unknown keys are errors that name the key and the allowed ones.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from regen.config.generate import GenerateConfig
from regen.config.plan import PlanConfig
from regen.config.render import RenderConfig
from regen.config.select import SelectConfig
from regen.config.serve import ServeConfig
from regen.config.train import TrainConfig
from regen.errors import InputError

REPO_ROOT = Path(__file__).resolve().parents[2]
PROFILE_DIR = REPO_ROOT / "data" / "profiles"


class ProfileError(InputError):
    """A profile that cannot be loaded: names the file, the field and what to do."""


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="the profile's name (its file is data/profiles/<name>.yaml)")
    description: str = Field("", description="one line on what the profile is for")
    seed: int = Field(0, description="the run's seed: selection order, training (unless train.seed), eval")
    select: SelectConfig = Field(default_factory=SelectConfig, description="`regen select`: sources, mix, filters")
    serve: ServeConfig = Field(default_factory=ServeConfig, description="the embedded target (`local` profile)")
    generate: GenerateConfig = Field(default_factory=GenerateConfig, description="`regen generate`: endpoints, "
                                     "sampling, policies, retries")
    render: RenderConfig = Field(default_factory=RenderConfig, description="`regen render`: response filters, "
                                 "renderer, mask, shards")
    train: TrainConfig = Field(default_factory=TrainConfig, description="`regen train` and `regen eval`: target, "
                               "draft, objective, optimisation, feed")
    plan: PlanConfig = Field(default_factory=PlanConfig, description="stated assumptions of `regen plan`")

    @model_validator(mode="after")
    def _modes_agree(self):
        """`select.modes` (the shares) and `generate.modes` (the settings) name the same modes."""
        chosen, defined = set(self.select.modes), set(self.generate.modes)
        if chosen != defined:
            raise ValueError(f"select.modes {sorted(chosen)} and generate.modes {sorted(defined)} must name the same "
                             "modes: every mode selected needs its request settings, every mode defined a share")
        return self

    @model_validator(mode="after")
    def _train_seed(self):
        """`train.seed: null` is the profile's seed, resolved here once: the trainer, `regen eval` and the loop
        rounds read `train.seed` as it stands."""
        if self.train.seed is None:
            self.train = self.train.model_copy(update={"seed": self.seed})
        return self


def profile_path(name_or_path: str) -> Path:
    """A profile name (`local`) -> `data/profiles/local.yaml`; an existing path is taken as is."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    candidate = PROFILE_DIR / f"{name_or_path}.yaml"
    if candidate.exists():
        return candidate
    known = sorted(x.stem for x in PROFILE_DIR.glob("*.yaml"))
    raise ProfileError(f"profile {name_or_path!r} not found: give one of {known} or a path to a .yaml file")


def _set_dotted(tree: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ProfileError(f"override {dotted!r}: {k!r} is not a section")
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, object]:
    """`"select.total=300"` -> `("select.total", 300)`. Raises ProfileError without `=`."""
    if "=" not in text:
        raise ProfileError(f"override {text!r} must look like section.key=value, e.g. select.total=300")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def load_profile(name_or_path: str, overrides: list[str] | dict | None = None) -> Profile:
    """Load and validate a profile, applying overrides (list of `key=value` or dict of dotted keys).

    Raises ProfileError naming the file and each invalid field with the reason.
    """
    path = profile_path(name_or_path)
    with open(path, encoding="utf-8") as f:
        tree = yaml.safe_load(f) or {}
    items = overrides.items() if isinstance(overrides, dict) else [parse_override(o) for o in overrides or []]
    for key, value in items:
        _set_dotted(tree, key, value)
    try:
        return Profile.model_validate(tree)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"])
            lines.append(f"  {loc}: {err['msg']}")
        raise ProfileError(f"profile {path}: invalid fields:\n" + "\n".join(lines)) from None


def resolve_path(value: str | None) -> Path | None:
    """Paths in profiles are relative to the repository root unless absolute; `~` and env vars expand."""
    if value is None:
        return None
    import os

    p = Path(os.path.expandvars(os.path.expanduser(value)))
    return p if p.is_absolute() else REPO_ROOT / p


def local_model_config(raw: str | None, field_name: str, what: str, missing: str, rep) -> tuple[Path, dict] | None:
    """For a stage's check: the local model directory a profile field names, and its `config.json` parsed.

    Returns (path, config) or None after `rep.bad(line)` (a `regen.errors.CheckReport`) naming the field and the
    fix: the field unset, an environment variable in it unset, not a directory, no `config.json` there (`missing`:
    what to do then), a `config.json` that does not parse or is not a JSON object."""
    import json

    if not raw:
        rep.bad(f"{field_name} is not set: give the local path of the {what}")
        return None
    path = resolve_path(raw)
    if "$" in str(path):
        rep.bad(f"{field_name} {raw!r}: the environment variable is not set; export it or pass "
                f"--set {field_name}=/path/to/{what.replace(' ', '_')}")
        return None
    if not path.is_dir():
        rep.bad(f"{field_name} {raw!r}: {path} is not a directory; give the local path of the {what}")
        return None
    file = path / "config.json"
    if not file.is_file():
        rep.bad(f"{field_name} {raw!r}: no config.json in {path}; {missing}")
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        rep.bad(f"{field_name} {raw!r}: {file} does not parse as JSON ({exc})")
        return None
    if not isinstance(data, dict):
        rep.bad(f"{field_name} {raw!r}: {file} is not a JSON object")
        return None
    return path, data


def add_profile_arguments(parser: argparse.ArgumentParser, run_required: bool = True) -> None:
    """The arguments every stage takes: --profile, --run and repeated --set overrides."""
    parser.add_argument("--profile", default="local", help="profile name in data/profiles/ or a .yaml path")
    parser.add_argument("--run", required=run_required, help="run directory, e.g. runs/local")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a profile field, e.g. --set select.total=300 (repeatable)",
    )


def add_responses_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """`--responses regenerated|original`: which answers of the run a stage uses (`RunDir.with_responses`)."""
    parser.add_argument("--responses", choices=("regenerated", "original"), default="regenerated",
                        help=f"{what}: the target's regenerated answers (shards/, default) or the source's own "
                             "answers kept by regen select (shards-original/)")


def load_profile_from_args(args):
    """(Profile, RunDir) from parsed `--profile/--run/--set` arguments (and `--responses` where the stage has it)."""
    from regen.rundir import RunDir

    profile = load_profile(args.profile, args.overrides)
    return profile, RunDir.at(args.run, getattr(args, "responses", None) or "regenerated")
