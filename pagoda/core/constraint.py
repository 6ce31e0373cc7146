"""What a request's output must match: a JSON schema, any JSON object, a regex, a grammar, a choice, a tag.

A `Constraint` is plain data on `SamplingParams` (no torch, no grammar library): the protocols build it
from their own fields (OpenAI `response_format`, responses `text.format`, forced tool calls, ...), the
engine compiles it off the step loop and masks every constrained row's logits with it before sampling.
Its `key` names it for the compile cache: two requests with equal constraints share one compiled grammar.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar", "choice", "structural_tag"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "grammar", "choice", "structural_tag")


@dataclass(frozen=True)
class Constraint:
    """kind and its spec: json_schema -> the schema (JSON text); json_object -> ""; regex -> the pattern;
    grammar -> EBNF text; choice -> a JSON list of the allowed strings; structural_tag -> its JSON spec.

    `field` is the protocol field it came from, so a compile error can name it in a 400.
    """

    kind: ConstraintKind
    spec: str = ""
    field: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError("constraint spec must be a string")

    @classmethod
    def json_schema(cls, schema: dict[str, Any], field: str = "response_format") -> Constraint:
        """A constraint to JSON matching `schema`, kept as compact JSON text in the caller's key order.

        Not sorted: the grammar emits an object's properties in the schema's order, which is the caller's.
        """
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), field)

    @property
    def key(self) -> str:
        """A stable name for the compile cache."""
        return hashlib.blake2b(f"{self.kind}\0{self.spec}".encode(), digest_size=16).hexdigest()


class ConstraintError(ValueError):
    """A constraint the engine cannot compile (a bad or unsupported schema, regex or grammar): an admission error.

    `field` is the constraint's protocol field, so the server's 400 names it (`param`).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
