"""The JSON-schema keywords xgrammar would silently ignore, found before compiling.

xgrammar compiles a schema with `not`, `if`/`then`/`else`, `dependentRequired`, `uniqueItems`, a
multi-branch `allOf` or an external `$ref` without complaint but does not enforce them, so the output
could break the schema the caller asked for. Such a schema is refused instead, naming the keyword
and where it is (each was checked against xgrammar 0.2: compiled, then fed an instance that breaks it).
"""

from __future__ import annotations

from typing import Any

_UNENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "uniqueItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # [subschema, ...]
_SCHEMA_ONE = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedProperties",
               "unevaluatedItems", "additionalItems")


def unsupported_schema_feature(schema: Any, where: str = "") -> str | None:
    """A description of the first keyword the compiler cannot enforce, or None when there is none."""
    if not isinstance(schema, dict):
        return None if isinstance(schema, bool) or where else "the JSON schema must be an object"
    at = f" (at {where})" if where else ""
    for keyword in _UNENFORCED:
        if keyword in schema:
            return f"unsupported keyword {keyword!r}{at}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"unsupported keyword 'allOf' with more than one schema{at}"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"unsupported $ref {ref!r}: only references within the schema ('#/...') are resolved{at}"
    return _first_in_children(schema, where)


def _first_in_children(schema: dict[str, Any], where: str) -> str | None:
    prefix = f"{where}." if where else ""
    for keyword in _SCHEMA_MAPS:
        children = schema.get(keyword)
        if isinstance(children, dict):
            for name, child in children.items():
                found = unsupported_schema_feature(child, f"{prefix}{keyword}.{name}")
                if found:
                    return found
    for keyword in _SCHEMA_LISTS:
        children = schema.get(keyword)
        if isinstance(children, list):
            for i, child in enumerate(children):
                found = unsupported_schema_feature(child, f"{prefix}{keyword}[{i}]")
                if found:
                    return found
    for keyword in _SCHEMA_ONE:
        if isinstance(schema.get(keyword), dict):
            found = unsupported_schema_feature(schema[keyword], f"{prefix}{keyword}")
            if found:
                return found
    return None
