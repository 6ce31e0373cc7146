"""Text <-> token ids for one model, loaded from its Hugging Face directory.

Reads tokenizer.json (the `tokenizers` pipeline: pre-tokenizer, BPE, added
tokens, decoder, post-processor) and tokenizer_config.json (special tokens and
the chat template). The end-of-sequence ids are the union of the tokenizer's
eos token and any `eos_token_id` in generation_config.json / config.json,
because instruction-tuned models often end a turn with a different token than
the base model's eos.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from pagoda.core.chat_template import ChatTemplate
from pagoda.core.text_stream import TextStream

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True)
class TokenVocab:
    """A vocabulary as a grammar engine reads it: each id's token as stored, and how tokens encode text."""

    tokens: tuple[str, ...]  # by id; "" where no token has that id
    encoding: str  # "byte_level" (GPT-2 style, 'Ġ' = space), "byte_fallback" ('<0x0A>' pieces) or "raw"
    add_prefix_space: bool = False  # the tokenizer puts a space before the text


class Tokenizer:
    """A model's tokenizer: encode, decode, chat template, end-of-sequence ids."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.bos_token_id = bos_token_id
        self._chat_template = ChatTemplate(chat_template) if chat_template else None
        added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        self.special_token_ids = frozenset(i for i, t in added.items() if t.special)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json + tokenizer_config.json (and eos ids from the model configs) from `path`."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {str(path)!r}: a fast (tokenizers) tokenizer file is required")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        tok_config = _read_json(path / "tokenizer_config.json", required=True)
        special = {k: _token_content(tok_config.get(k)) for k in _SPECIAL_TOKEN_KEYS}

        eos_ids: list[int] = []
        if special["eos_token"] is not None and backend.token_to_id(special["eos_token"]) is not None:
            eos_ids.append(backend.token_to_id(special["eos_token"]))
        for name in ("generation_config.json", "config.json"):
            eos_ids += _as_ids(_read_json(path / name, required=False).get("eos_token_id"))

        bos_id = backend.token_to_id(special["bos_token"]) if special["bos_token"] else None
        if bos_id is None:
            ids = _as_ids(_read_json(path / "config.json", required=False).get("bos_token_id"))
            bos_id = ids[0] if ids else None
        return cls(
            backend,
            special_tokens=special,
            eos_token_ids=eos_ids,
            bos_token_id=bos_id,
            chat_template=_chat_template_source(path, tok_config),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    @property
    def chat_template_takes_tools(self) -> bool:
        """The chat template renders a tool list itself (else the protocols write the default tool prompt)."""
        return self._chat_template is not None and self._chat_template.takes_tools

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are matched whole."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for a conversation, rendered with the model's chat template."""
        if self._chat_template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json has no 'chat_template')")
        return self._chat_template.render(
            messages, add_generation_prompt=add_generation_prompt, special_tokens=self.special_tokens, **extra
        )

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        """Token ids of the chat prompt (the template writes any BOS itself, so none is added)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=False)

    def token_vocab(self) -> TokenVocab:
        """Every token by id and the vocabulary's encoding, read from the tokenizer.json pipeline."""
        tokens = [""] * self.vocab_size
        for token, token_id in self.backend.get_vocab(with_added_tokens=True).items():
            if 0 <= token_id < len(tokens):
                tokens[token_id] = token
        pipeline = json.loads(self.backend.to_str())
        pre = _components(pipeline.get("pre_tokenizer")) + _components(pipeline.get("normalizer"))
        if (pipeline.get("model") or {}).get("byte_fallback"):
            encoding = "byte_fallback"
        elif any(c.get("type") == "ByteLevel" for c in pre + _components(pipeline.get("decoder"))):
            encoding = "byte_level"
        else:
            encoding = "raw"
        prefix_space = any(
            (c.get("type") == "ByteLevel" and c.get("add_prefix_space"))
            or (c.get("type") == "Metaspace" and c.get("prepend_scheme", "always") != "never")
            or (c.get("type") == "Prepend")
            for c in pre
        )
        return TokenVocab(tuple(tokens), encoding, bool(prefix_space))

    def text_stream(self, stop: Sequence[str] = ()) -> TextStream:
        """A fresh incremental detokenizer for one request's output."""
        return TextStream(self.decode, stop, skip_token_ids=self.special_token_ids)


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"missing {path.name} in {str(path.parent)!r}")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from e


def _components(step: Any) -> list[dict[str, Any]]:
    """A tokenizer.json pipeline step and, for a Sequence, its members, flattened."""
    if not isinstance(step, Mapping):
        return []
    members = step.get("pretokenizers") or step.get("normalizers") or step.get("decoders") or []
    return [dict(step)] + [c for m in members for c in _components(m)]


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_template_source(path: Path, tok_config: Mapping[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, or tokenizer_config.json's entry."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None
