"""`regen config`: the effective profile as YAML, or (`--markdown`) the configuration reference `docs/configuration.md`.

The reference is generated from the typed configs (`regen.config.Profile` and its sub-configs): every field with
its type, its default in code, its value in each bundled profile (`data/profiles/*.yaml`, as written there),
its allowed values (a `Literal` type, or `json_schema_extra={"allowed": ...}` beside a validator) and its
`Field(description=...)`. The environment variables are found by scanning the bundled profiles for `${NAME}` and
their `generate.api_key_env` values; each needs a line in `ENVIRONMENT`.

    regen config --markdown > docs/configuration.md      # the page; tests/docs/test_docs.py compares it
    regen config --profile kimi-k3 --set train.lr=1e-4   # the validated profile, defaults filled in
"""
from __future__ import annotations

import argparse
import json
import re
import types
import typing
from pathlib import Path

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from regen.config import PROFILE_DIR, Profile, add_profile_arguments, load_profile
from regen.config.generate import DEFAULT_POLICIES, POLICY_NAMES, RESTRICTED_POLICIES

# name -> (what it holds, which profile field reads it). A variable a bundled profile reads without a line here
# makes `markdown()` raise, so the page cannot leave one out.
ENVIRONMENT: dict[str, str] = {
    "KIMI_MTP_DATASET": "local folder of the kimi-mtp-dataset prompt pool (a `save_to_disk` directory or a Hub "
                        "snapshot of Parquet files)",
    "REGEN_ENDPOINTS": "the target's OpenAI-compatible base URL ending in /v1 (one; add more with `--endpoint URL` "
                       "or in a copy of the profile)",
    "REGEN_API_KEY": "the API key sent as `Authorization: Bearer ...`; never logged or written",
    "KIMI_K3_TOKENIZER": "the Kimi-K3 checkpoint directory holding `tiktoken.model` and `tokenizer_config.json`",
    "KIMI_K3_MODEL": "the Kimi-K3 checkpoint directory; trainer ranks read only its embeddings, final norm and LM "
                     "head, producers load all of it",
    "MOONCAKE_MASTER": "host:port of the cluster's `mooncake_master` (its metrics are read from port 9003 of that "
                       "host)",
}
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def bundled_profiles() -> dict[str, dict]:
    """Profile name -> its YAML tree as written (no defaults, `${VARS}` unexpanded), in name order."""
    return {p.stem: yaml.safe_load(p.read_text(encoding="utf-8")) or {} for p in sorted(PROFILE_DIR.glob("*.yaml"))}


def environment_variables() -> dict[str, list[str]]:
    """Variable -> the `profile: section.key` places that read it (`${NAME}` in a value, or `generate.api_key_env`)."""
    found: dict[str, list[str]] = {}

    def walk(node, path: str, profile: str):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else str(k), profile)
        elif isinstance(node, list):
            for v in node:
                walk(v, f"{path}[]", profile)
        elif isinstance(node, str):
            for name in ENV_REF.findall(node):
                found.setdefault(name, []).append(f"{profile}: {path}")

    for name, tree in bundled_profiles().items():
        walk(tree, "", name)
        key_env = (tree.get("generate") or {}).get("api_key_env")
        if key_env:
            found.setdefault(key_env, []).append(f"{name}: generate.api_key_env")
    return dict(sorted(found.items()))


def _is_model(tp) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _list_of_model(tp):
    if typing.get_origin(tp) is list and _is_model(typing.get_args(tp)[0]):
        return typing.get_args(tp)[0]
    return None


def type_name(tp, metadata=()) -> str:
    """A field's type as the page writes it: `int`, `float | null`, `list[str]`, `bytes`, `"auto" | int`."""
    if any(getattr(m, "func", None) is not None and m.func.__name__ == "_bytes" for m in metadata):
        return "bytes"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return type_name(args[0], args[1:])
    if origin is typing.Literal:
        return "str"
    if origin in (typing.Union, types.UnionType):
        names = []
        for a in args:
            n = "null" if a is type(None) else type_name(a)
            if n not in names:
                names.append(n)
        return " | ".join(names)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]" if args else origin.__name__
    if _is_model(tp):
        return "section"
    return getattr(tp, "__name__", str(tp))


def allowed_values(info) -> str:
    """The allowed values of a field: its Literal's, or the `allowed` of its json_schema_extra; "" when free."""
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if "allowed" in extra:
        allowed = extra["allowed"]
        return allowed if isinstance(allowed, str) else ", ".join(f"`{a}`" for a in allowed)

    def literals(tp):
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is typing.Literal:
            return list(args)
        if origin in (typing.Union, types.UnionType, typing.Annotated):
            return [x for a in args for x in literals(a)]
        return []

    values = literals(info.annotation)
    if not values:
        return ""
    return ", ".join(f"`{v}`" for v in values) + (" or an int" if "int" in type_name(info.annotation) else "")


def _value(v) -> str:
    if v is PydanticUndefined:
        return "required"
    if isinstance(v, BaseModel):
        return ""
    if isinstance(v, str):
        return f"`{v}`" if v else '`""`'
    return f"`{json.dumps(v, ensure_ascii=False)}`"


def default_of(info) -> str:
    if info.default_factory is not None:
        return _value(info.default_factory())
    return _value(info.default)


def _lookup(tree, dotted: str):
    node = tree
    for k in dotted.split("."):
        if not isinstance(node, dict) or k not in node:
            return PydanticUndefined
        node = node[k]
    return node


def fields(model: type[BaseModel], prefix: str = ""):
    """(dotted key, FieldInfo, nested model or None, is a list of that model) of every field, depth first: a
    section's own fields, then its sections."""
    nested = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = info.annotation if _is_model(info.annotation) else _list_of_model(info.annotation)
        yield key, info, sub, sub is not None and not _is_model(info.annotation)
        if sub is not None:
            nested.append((key, sub, not _is_model(info.annotation)))
    for key, sub, is_list in nested:
        yield from fields(sub, f"{key}[]." if is_list else f"{key}.")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _section_of(key: str) -> str:
    return key.rsplit(".", 1)[0] if "." in key else ""


def markdown() -> str:
    """The configuration reference page (docs/configuration.md). Raises ValueError for a field without a
    description or an environment variable without a line in ENVIRONMENT."""
    profiles = bundled_profiles()
    names = list(profiles)
    out = [
        "# Configuration reference",
        "",
        "```bash",
        ".venv/bin/regen config --profile kimi-k3 [--set train.lr=1e-4]   # the validated profile, defaults filled in",
        ".venv/bin/regen config --markdown > docs/configuration.md        # this page, generated from regen/config/",
        "```",
        "",
        "Generated from the typed configs in `regen/config/` (their `Field(description=...)`) and the bundled "
        "profiles in `data/profiles/` by `regen config --markdown`; `tests/docs/test_docs.py` fails when this "
        "page and the code disagree. Do not edit it by hand.",
        "",
        "A profile is one YAML file; every stage takes `--profile NAME` (a name in `data/profiles/` or a path) and "
        "repeated `--set section.key=value` overrides (values parse as YAML scalars). Unknown keys are errors "
        "naming the key and the allowed ones. Paths are relative to the repository root unless absolute; `~` and "
        "`${VARS}` expand. A profile column is empty where that profile leaves the default.",
        "",
        "## Environment variables the profiles read",
        "",
        "| variable | read by | what it holds |",
        "|---|---|---|",
    ]
    for var, places in environment_variables().items():
        if var not in ENVIRONMENT:
            raise ValueError(f"environment variable {var} ({places}) has no line in regen.config.reference.ENVIRONMENT")
        out.append(f"| `{var}` | {_cell(', '.join(f'`{p}`' for p in places))} | {_cell(ENVIRONMENT[var])} |")
    out += ["", "Preflight (`regen run`, `regen plan`, the flow) names every variable that a stage it will run "
            "needs and that is not set.", ""]
    section = None
    header = "| key | type | default | " + " | ".join(names) + " | allowed | meaning |"
    rule = "|---|---|---|" + "---|" * len(names) + "---|---|"
    for key, info, sub, is_list in fields(Profile):
        if not info.description:
            raise ValueError(f"profile field {key} has no Field(description=...)")
        here = _section_of(key)
        if here != section:
            section = here
            out += ["", f"## `{section}`" if section else "## Top level", "", header, rule]
        values = []
        for n in names:
            v = PydanticUndefined if "[]" in key else _lookup(profiles[n], key)
            if v is PydanticUndefined:
                values.append("")
            elif is_list:
                values.append(f"{len(v)} (below)")
            elif sub is not None:
                values.append("set" if v else "")
            else:
                values.append(_value(v))
        default = "" if sub is not None else default_of(info)
        kind = f"list[{sub.__name__}]" if is_list else type_name(info.annotation, info.metadata)
        cells = [f"`{key}`", kind, default, *values, allowed_values(info), info.description]
        out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    out += ["", "## The bundled profiles' sources", "", "| profile | name | path | category | language |",
            "|---|---|---|---|---|"]
    for n in names:
        for src in (profiles[n].get("select") or {}).get("sources") or []:
            out.append("| " + " | ".join(_cell(c) for c in (
                n, f"`{src['name']}`", f"`{src['path']}`", src.get("category") or "", src.get("language") or "")) + " |")
    out += ["", "## Quality classes and their policies (`generate.policies`)", "",
            "Policies: " + ", ".join(f"`{p}`" for p in POLICY_NAMES) + ". What each class is and what to do: "
            "[errors.md](errors.md).", "", "| class | default | allowed |", "|---|---|---|"]
    for klass, policy in DEFAULT_POLICIES.items():
        allowed = RESTRICTED_POLICIES.get(klass, POLICY_NAMES)
        out.append(f"| `{klass}` | `{policy}` | {', '.join(f'`{a}`' for a in allowed)} |")
    return "\n".join(out) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_arguments(parser, run_required=False)
    parser.add_argument("--markdown", action="store_true",
                        help="print the configuration reference (docs/configuration.md) instead of a profile")


def main(args) -> int:
    if args.markdown:
        print(markdown(), end="")
        return 0
    profile = load_profile(args.profile, args.overrides)
    print(yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False, allow_unicode=True), end="")
    return 0


def page_path() -> Path:
    """Where the reference lives in the repository."""
    return PROFILE_DIR.parents[1] / "docs" / "configuration.md"
