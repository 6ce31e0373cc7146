"""Grammar-constrained decoding with xgrammar: compiled off the step loop, one matcher per request.

Design note. A `Constraint` compiles into a grammar over this model's vocabulary once, on a small
thread pool (`Grammars`), and the result is kept in an LRU keyed by `Constraint.key`, so equal
constraints compile once. Compilation never runs on the step loop:
- the async engine awaits the compile on the caller's event loop before it hands the request to the
  loop thread, so a constraint the compiler refuses is an admission error (a 400) and the engine only
  ever sees requests whose grammar is ready;
- a request added while its grammar is still compiling (offline use, or a cache entry evicted in
  between) waits in the engine's `CompileQueue`, outside the scheduler: it takes no queue position
  and no blocks, so it cannot hold the head of the waiting queue, and it enters the scheduler at the
  top of the first step after its grammar is ready (a failed compile ends it with finish reason error).
Admission waits rather than the scheduler skipping, because then the scheduler's first-come rule
needs no exception and a slow compile delays only its own request.

Each step, a constrained row's logits get the matcher's token bitmask (the tokens the grammar allows
next; padded LM-head rows beyond the tokenizer's vocabulary are never allowed) before sampling, and the
matcher accepts the sampled token. The matcher lives on the request: its state is exactly the output
tokens accepted so far, and since preemption keeps the output tokens and recompute samples nothing,
it stays valid across preemption with no rollback. Masking is per row, so a constrained row never
touches another row's logits.

xgrammar (and the transformers it pulls in) takes seconds to import: it is imported on first use.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import torch

from pagoda.core.constraint import Constraint, ConstraintError
from pagoda.core.grammar_schema import unsupported_schema_feature

if TYPE_CHECKING:
    from pagoda.core.tokenizer import TokenVocab

_ENCODINGS = {"raw": "RAW", "byte_fallback": "BYTE_FALLBACK", "byte_level": "BYTE_LEVEL"}
_LOCATION = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*(Check failed: .*? is false: )?")  # xgrammar's C++ prefix


class Grammars:
    """Compiles constraints on a worker pool for one model's vocabulary; an LRU of compiled grammars."""

    def __init__(self, vocab: Callable[[], TokenVocab], vocab_size: int, stop_token_ids: Sequence[int], *,
                 max_workers: int = 2, cache_size: int = 256, any_whitespace: bool = False) -> None:
        self._vocab = vocab  # called once, on a worker: a 49k-token vocabulary takes ~0.3 s to index
        self.vocab_size = vocab_size  # the LM head's rows (logits width), padded rows included
        self.stop_token_ids = tuple(stop_token_ids)
        self.cache_size = cache_size
        # JSON output (json_schema, json_object) is compact unless this is set: then any whitespace between tokens,
        # for every request (docs/reliability.md). Fixed for the Grammars' life: the cache is keyed by constraint.
        self.any_whitespace = any_whitespace
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="pagoda-grammar")
        self._lock = threading.Lock()  # guards the cache: held for microseconds, so submit never waits long
        self._build_lock = threading.Lock()  # guards the compiler's one-time build (seconds: the xgrammar import)
        self._cache: OrderedDict[str, Future[Any]] = OrderedDict()  # Constraint.key -> compiled grammar
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built by the first compile
        self.num_compiles = 0
        self.num_cache_hits = 0

    def submit(self, constraint: Constraint) -> Future[Any]:
        """The compiled grammar of `constraint` (a cached future, or a new compile); thread-safe.

        Raises ConstraintError at once for a spec that fails the cheap checks (a schema that is not JSON or
        uses a keyword the compiler cannot enforce, a malformed choice); the future raises it for the rest.
        """
        _check(constraint)
        with self._lock:
            future = self._cache.get(constraint.key)
            if future is not None and not future.cancelled():  # a failed compile is cached too: refused at once
                self._cache.move_to_end(constraint.key)
                self.num_cache_hits += 1
                return future
            future = self._pool.submit(self._compile, constraint)
            self.num_compiles += 1
            self._cache[constraint.key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def matcher(self, compiled: Any, field: str = "constraint") -> RequestGrammar:
        """A fresh matcher for one request over a compiled grammar (`field`: its constraint's protocol field)."""
        xgr = _xgrammar()
        return RequestGrammar(xgr.GrammarMatcher(compiled), self.vocab_size, field)

    def shutdown(self) -> None:
        """Stop the worker pool (compiles in flight finish; no new ones start)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- on a worker ---------------------------------------------------
    def _get_compiler(self) -> Any:
        with self._build_lock:
            if self._compiler is None:
                xgr = _xgrammar()
                vocab = self._vocab()
                tokens = list(vocab.tokens[: self.vocab_size])
                tokens += [""] * (self.vocab_size - len(tokens))  # padded rows: no token, never allowed
                info = xgr.TokenizerInfo(tokens, getattr(xgr.VocabType, _ENCODINGS[vocab.encoding]),
                                         vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids),
                                         add_prefix_space=vocab.add_prefix_space)
                # Our LRU is the one cache: xgrammar's own would keep what ours evicted.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile(self, constraint: Constraint) -> Any:
        compiler = self._get_compiler()
        try:
            compiled = _compile(compiler, constraint, self.any_whitespace)
        except ConstraintError:
            raise
        except Exception as exc:  # xgrammar reports a bad schema, regex or grammar as RuntimeError
            raise ConstraintError(constraint.field, f"{constraint.field}: {_describe(exc)}") from exc
        # An output no token of this vocabulary can begin (a character none of its tokens holds) is the request's
        # to fix: refused here, once per compiled grammar, rather than failing its request at the first token.
        if not bool(self.matcher(compiled).allowed().any()):
            raise ConstraintError(constraint.field, f"{constraint.field}: no token of this model's vocabulary can"
                                                    " begin the output it asks for")
        return compiled


def _check(constraint: Constraint) -> None:
    """The checks that need no compiler, on the caller's thread (microseconds for a schema)."""
    if constraint.kind == "json_schema":
        field = constraint.field
        try:
            schema = json.loads(constraint.spec)
        except ValueError as exc:
            raise ConstraintError(field, f"{field}: the JSON schema is not valid JSON ({exc})") from exc
        problem = unsupported_schema_feature(schema)
        if problem is not None:
            raise ConstraintError(field, f"{field}: {problem}")
    elif constraint.kind == "choice":
        _choice_grammar(constraint.spec, constraint.field)


# JSON mode is an object, as OpenAI's is: xgrammar's built-in JSON grammar also admits a top-level array.
_ANY_OBJECT = '{"type":"object"}'


def _compile(compiler: Any, constraint: Constraint, any_whitespace: bool) -> Any:
    kind, spec, field = constraint.kind, constraint.spec, constraint.field
    if kind in ("json_schema", "json_object"):
        # Compact by default: one line, xgrammar's separators ", " and ": ". With any whitespace allowed, a small
        # model can spend its whole max_tokens on newlines and indentation (docs/reliability.md).
        return compiler.compile_json_schema(spec if kind == "json_schema" else _ANY_OBJECT,
                                            any_whitespace=any_whitespace)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "grammar":
        return compiler.compile_grammar(spec)
    if kind == "choice":
        return compiler.compile_grammar(_choice_grammar(spec, field))
    return compiler.compile_structural_tag(spec)  # structural_tag: its JSON spec as text


def _choice_grammar(spec: str, field: str) -> str:
    """EBNF for exactly one of the strings in the JSON list `spec`."""
    try:
        choices = json.loads(spec)
    except ValueError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ConstraintError(field, f"{field}: a choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _describe(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location, on one line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _LOCATION.sub("", text)


def _failed(future: Future[Any]) -> bool:
    return future.done() and (future.cancelled() or future.exception() is not None)


def _xgrammar() -> Any:
    import xgrammar

    return xgrammar


class RequestGrammar:
    """One request's matcher: the mask for its next token, and each sampled token accepted."""

    def __init__(self, matcher: Any, vocab_size: int, field: str = "constraint") -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.field = field  # the constraint's protocol field: a dead end is that field's to fix
        self.num_accepted = 0

    def allowed(self) -> torch.Tensor:
        """The next-token bitmask, int32 [1, ceil(vocab_size / 32)] on the CPU (bit set = allowed)."""
        bitmask = _xgrammar().allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask, 0)
        return bitmask

    def mask(self, row: torch.Tensor) -> torch.Tensor:
        """A copy of `row` [vocab] with every token the grammar forbids next at -inf."""
        assert row.dim() == 1 and row.shape[0] == self.vocab_size, (row.shape, self.vocab_size)
        bitmask = self.allowed()
        if not bool(bitmask.any()):  # the grammar needs a character no token of this vocabulary has
            raise ConstraintError(self.field, f"{self.field}: no token of this model's vocabulary can continue the"
                                              f" output it asks for after {self.num_accepted} accepted tokens")
        masked = row.clone().unsqueeze(0)  # [1, vocab]
        # xgrammar's C++ kernel on the CPU ("auto" picks a path ~10x slower there), its CUDA/Triton one on a GPU
        backend = "cpu" if row.device.type == "cpu" else "auto"
        _xgrammar().apply_token_bitmask_inplace(masked, bitmask.to(row.device, non_blocking=True),
                                                backend=backend)
        return masked[0]

    def accept(self, token_id: int) -> None:
        """Advance the matcher by the sampled token; raises when the grammar rejects it."""
        if not self.matcher.accept_token(token_id):
            raise ValueError(f"the grammar rejected token {token_id} after {self.num_accepted} accepted tokens")
        self.num_accepted += 1

    @property
    def is_terminated(self) -> bool:
        """True once the grammar has ended (it accepted a stop token)."""
        return bool(self.matcher.is_terminated())


class CompileQueue:
    """Requests whose grammar is still compiling, in arrival order; they hold no queue place and no blocks."""

    def __init__(self) -> None:
        self._held: list[tuple[Any, Future[Any]]] = []  # (request, its compile)

    def hold(self, request: Any, future: Future[Any]) -> None:
        self._held.append((request, future))

    def discard(self, request: Any) -> bool:
        """Drop a held request (it finished or was aborted); False when it was not held."""
        before = len(self._held)
        self._held = [(r, f) for r, f in self._held if r is not request]
        return len(self._held) != before

    def ready(self) -> list[tuple[Any, Any]]:
        """(request, compiled grammar) for each held request whose compile succeeded, in arrival order."""
        return [(r, f.result()) for r, f in self._held if f.done() and not _failed(f)]

    def failures(self) -> list[tuple[Any, BaseException]]:
        """(request, error) for each held request whose compile failed; they stay held until discarded."""
        return [(r, f.exception() if not f.cancelled() else RuntimeError("the grammar compile was cancelled"))
                for r, f in self._held if _failed(f)]

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` s until some held compile ends (only when the engine has nothing to run)."""
        if self._held:
            wait([f for _, f in self._held], timeout=timeout, return_when=FIRST_COMPLETED)

    def __len__(self) -> int:
        return len(self._held)
