"""Tool declarations of source rows -> OpenAI chat-completions `tools`
(`[{type: "function", function: {name, description, parameters}}]`).

Accepted: a JSON string or a list of bare function objects (glaive, BFCL) or of OpenAI tools; BFCL's type
dialect is rewritten into JSON Schema types; BFCL `involved_classes` are read from `multi_turn_func_doc/`.
Malformed declarations raise `RowError` (a `parse` reject).
"""
from __future__ import annotations

import json
from pathlib import Path

from regen.select import strict_json
from regen.select.errors import RowError

# BFCL tool-schema dialect -> JSON Schema types (BFCL `model_handler/utils.py` convert_to_tool / GORILLA_TO_OPENAPI).
BFCL_TYPES = {
    "dict": "object", "float": "number", "double": "number", "tuple": "array", "Array": "array",
    "ArrayList": "array", "list": "array", "HashMap": "object", "String": "string", "str": "string",
    "char": "string", "long": "integer", "int": "integer", "short": "integer", "byte": "integer",
    "Boolean": "boolean", "bool": "boolean", "any": None,
}
# BFCL `involved_classes` -> multi_turn_func_doc file stem (BFCL `constants/category_mapping.py`).
BFCL_CLASS_FILES = {
    "GorillaFileSystem": "gorilla_file_system", "MathAPI": "math_api", "MessageAPI": "message_api",
    "TwitterAPI": "posting_api", "TicketAPI": "ticket_api", "TradingBot": "trading_bot",
    "TravelAPI": "travel_booking", "VehicleControlAPI": "vehicle_control", "WebSearchAPI": "web_search",
    "MemoryAPI_kv": "memory_kv", "MemoryAPI_vector": "memory_vector", "MemoryAPI_rec_sum": "memory_rec_sum",
}


def _bfcl_schema(node):
    """Rewrite one BFCL parameter schema node (recursively) into JSON Schema types."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    t = out.get("type")
    if isinstance(t, str) and t in BFCL_TYPES:
        mapped = BFCL_TYPES[t]
        if mapped is None:
            out.pop("type")
        else:
            out["type"] = mapped
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: _bfcl_schema(v) for k, v in out["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = _bfcl_schema(out[key])
    return out


def openai_tools(raw, field: str, bfcl: bool = False) -> list[dict] | None:
    """Tools in any accepted form -> OpenAI `[{type: function, function: {...}}]`; None when empty.

    Accepts a JSON string (glaive), a list of bare function objects (glaive, BFCL) or of OpenAI tools.
    With `bfcl`, parameter types are rewritten (dict->object, float->number, ...) and dots in function
    names become underscores (as BFCL's OpenAI handler does). Raises RowError on bad JSON or a non-object tool.
    """
    if raw is None:
        return None
    if isinstance(raw, str):
        if not raw.strip():
            return None
        try:
            raw = strict_json.loads(raw)
        except strict_json.DuplicateKey as exc:
            raise RowError(field, f"tools: {exc}") from None
        except json.JSONDecodeError as exc:
            raise RowError(field, f"tools is not valid JSON ({exc.msg} at char {exc.pos})") from None
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list):
        raise RowError(field, f"tools must be a list of function objects, got {type(raw).__name__}")
    tools = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict):
            raise RowError(field, f"tool {i} is a {type(t).__name__}, expected an object")
        fn = t["function"] if t.get("type") == "function" and isinstance(t.get("function"), dict) else t
        fn = {k: v for k, v in fn.items() if k in ("name", "description", "parameters", "strict")}
        if bfcl:
            if isinstance(fn.get("name"), str):
                fn["name"] = fn["name"].replace(".", "_")
            if isinstance(fn.get("parameters"), dict):
                fn["parameters"] = _bfcl_schema(fn["parameters"])
        tools.append({"type": "function", "function": fn})
    return tools or None


def bfcl_class_tools(classes, excluded, base_dir: Path, cache: dict) -> list[dict]:
    """Tools of BFCL `involved_classes` from `base_dir/multi_turn_func_doc/<stem>.json` (minus `excluded`)."""
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise RowError("involved_classes", "must be a list of class names")
    excluded = set(excluded or [])
    tools: list[dict] = []
    for cls in classes:
        stem = BFCL_CLASS_FILES.get(cls)
        if stem is None:
            raise RowError("involved_classes", f"unknown BFCL class {cls!r} (known: {sorted(BFCL_CLASS_FILES)})")
        path = base_dir / "multi_turn_func_doc" / f"{stem}.json"
        if path not in cache:
            if not path.exists():
                raise RowError("involved_classes", f"tool docs for {cls} not found at {path}")
            with open(path, encoding="utf-8-sig") as fh:
                cache[path] = [json.loads(line) for line in fh if line.strip()]
        docs = [d for d in cache[path] if d.get("name") not in excluded]
        tools.extend(openai_tools(docs, "involved_classes", bfcl=True) or [])
    return tools
