"""Grammar-constrained decoding: compile cache, masks, termination, fault isolation, preemption, the default model."""

from __future__ import annotations

import json
import threading

import pytest
import tokenizers
import torch
from tokenizers import decoders, models

from pagoda.api.errors import api_error
from pagoda.core.async_engine import AsyncEngine
from pagoda.core.constraint import Constraint, ConstraintError
from pagoda.core.grammar import Grammars
from pagoda.core.request import FinishReason
from pagoda.core.sampling_params import SamplingParams
from pagoda.core.tokenizer import Tokenizer
from tests.helpers import drain, fake_engine, run, tokens

# A real (tokenizers) tokenizer over the fake model's 64 ids: id 0 is the fake model's EOS, the rest one
# character each. A space (compact JSON is written with ", " and ": ") and a newline (what compact JSON refuses).
CHARS = (list('{}[]":,') + [str(d) for d in range(10)] + [chr(c) for c in range(97, 123)]
         + [chr(c) for c in range(65, 83)] + [" ", "\n"])
SCHEMA = {"type": "object", "properties": {"a": {"enum": ["xyz", "abc"]}, "b": {"type": "boolean"}},
          "required": ["a", "b"]}


def tiny_tokenizer() -> Tokenizer:
    backend = tokenizers.Tokenizer(models.BPE(vocab={"<eos>": 0, **{c: i + 1 for i, c in enumerate(CHARS)}}, merges=[]))
    backend.add_special_tokens(["<eos>"])
    backend.decoder = decoders.Fuse()
    return Tokenizer(backend, special_tokens={"eos_token": "<eos>"}, eos_token_ids=(0,))


def engine(**kw):
    return fake_engine(tokenizer=tiny_tokenizer(), **kw)


def text(outs) -> str:
    return "".join(o.new_text for o in outs)


def greedy(constraint: Constraint | None, max_tokens: int = 40, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, constraint=constraint, **kw)


# -- compiling ---------------------------------------------------------------------------------------

def test_equal_constraints_compile_once_and_the_lru_evicts():
    grammars = Grammars(tiny_tokenizer().token_vocab, 64, [0], cache_size=1)
    first = grammars.submit(Constraint.json_schema(SCHEMA))
    again = grammars.submit(Constraint.json_schema(json.loads(json.dumps(SCHEMA))))  # an equal schema
    assert again is first and (grammars.num_compiles, grammars.num_cache_hits) == (1, 1)
    first.result(timeout=60)
    grammars.submit(Constraint("regex", "[a-z]+"))  # evicts the schema (cache_size=1)
    assert grammars.submit(Constraint.json_schema(SCHEMA)) is not first and grammars.num_compiles == 3
    grammars.shutdown()


@pytest.mark.parametrize("constraint, named", [
    (Constraint.json_schema({"type": "object", "not": {"required": ["a"]}}, "response_format.json_schema"), "'not'"),
    (Constraint.json_schema({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
                            "tools[0].function.parameters"), "'uniqueItems' (at properties.a)"),
    (Constraint.json_schema({"allOf": [{"type": "integer"}, {"minimum": 3}]}), "'allOf'"),
    (Constraint.json_schema({"$ref": "https://example.com/s.json"}), "$ref"),
    (Constraint("json_schema", "{not json", "response_format.json_schema"), "not valid JSON"),
    (Constraint("regex", "(ab", "regex"), "parenthesis"),
    (Constraint("grammar", "root ::= missing", "grammar"), "missing"),
    (Constraint("choice", "[]", "tool_choice"), "non-empty list"),
    (Constraint("regex", "-c", "guided_regex"), "no token of this model's vocabulary can begin"),  # no '-' here
])
def test_a_constraint_the_compiler_cannot_handle_is_refused_naming_its_field(constraint, named):
    e = engine()
    try:  # schema and choice checks refuse at once; a regex or grammar once its compile has failed
        e.compile_constraint(constraint).exception(timeout=60)
    except ConstraintError:
        pass
    with pytest.raises(ConstraintError) as refused:
        e.add_request("r", [1, 2], greedy(constraint))
    message = str(refused.value)
    assert message.startswith(f"{constraint.field}: ") and named in message, message
    error = api_error(refused.value)
    assert (error.status, error.param) == (400, constraint.field)
    assert not e.requests and e.scheduler.num_waiting == 0


def test_the_async_engine_refuses_before_admission_and_compiles_off_the_loop():
    e = engine()
    async_engine = AsyncEngine(e)
    async_engine.start()

    async def go():
        with pytest.raises(ConstraintError):
            async for _ in async_engine.generate([1, 2], greedy(Constraint.json_schema({"not": {}}))):
                pass
        return [o async for o in async_engine.generate([1, 2], greedy(Constraint.json_schema(SCHEMA)))]

    try:
        outs = run(go())
    finally:
        async_engine.stop()
    assert json.loads(text(outs))["a"] in ("xyz", "abc") and outs[-1].finish_reason is FinishReason.STOP


def test_a_request_waits_for_its_grammar_without_stalling_the_others():
    gate = threading.Event()
    e = engine()
    vocab = e.grammars._vocab
    e.grammars._vocab = lambda: (gate.wait(60), vocab())[1]  # the first compile blocks until the gate opens
    e.add_request("c", [1, 2], greedy(Constraint.json_schema(SCHEMA)))
    e.add_request("bad", [1, 2], greedy(Constraint("regex", "(unclosed", "tool_choice")))
    e.add_request("free", [3, 4], greedy(None, max_tokens=5))
    seen = [out.request_id for _ in range(5) for out in e.step()]
    assert seen == ["free"] * 5 and len(e.compiling) == 2 and e.scheduler.num_waiting == 0
    gate.set()
    outs = drain(e)
    assert json.loads(text(outs["c"])) and outs["c"][-1].finish_reason is FinishReason.STOP
    assert outs["bad"][-1].finish_reason is FinishReason.ERROR and "tool_choice: " in outs["bad"][-1].error
    assert "parenthesis" in outs["bad"][-1].error and len(e.compiling) == 0


# -- masks and termination ---------------------------------------------------------------------------

def _allowed_ids(grammar) -> set[int]:
    row = grammar.mask(torch.zeros(grammar.vocab_size))
    return set(torch.nonzero(row == 0).flatten().tolist())


def test_the_mask_never_allows_padded_vocab_rows():
    grammars = Grammars(tiny_tokenizer().token_vocab, 64 + 40, [0])  # an LM head with 40 padded rows
    grammar = grammars.matcher(grammars.submit(Constraint("json_object")).result(timeout=60))
    for token in '{"ab": [1, 2]}':
        allowed = _allowed_ids(grammar)
        assert allowed and max(allowed) < 64
        grammar.accept(CHARS.index(token) + 1)
    assert _allowed_ids(grammar) == {0}  # the object is closed: only EOS


def test_the_default_tokenizer_mask_covers_padded_rows(default_tokenizer):
    vocab = default_tokenizer.token_vocab()
    assert (vocab.encoding, vocab.add_prefix_space, len(vocab.tokens)) == ("byte_level", False, default_tokenizer.vocab_size)
    assert vocab.tokens[default_tokenizer.encode(" Paris", add_special_tokens=False)[0]].startswith("\u0120")  # 'Ġ'
    vocab_size = default_tokenizer.vocab_size + 64
    grammars = Grammars(default_tokenizer.token_vocab, vocab_size, default_tokenizer.eos_token_ids)
    grammar = grammars.matcher(grammars.submit(Constraint("choice", '["Paris", "London"]')).result(timeout=60))
    allowed = _allowed_ids(grammar)
    assert allowed and max(allowed) < default_tokenizer.vocab_size
    assert {default_tokenizer.decode([t]) for t in allowed} <= {p for w in ("Paris", "London") for p in _prefixes(w)}


def _prefixes(word: str) -> set[str]:
    return {word[:i] for i in range(1, len(word) + 1)}


def test_a_terminated_grammar_ends_the_request_with_stop_even_when_eos_is_ignored():
    e = engine()
    e.add_request("c", [1, 2], greedy(Constraint("choice", '["yes", "no"]'), max_tokens=30, ignore_eos=True))
    outs = drain(e)["c"]
    assert text(outs) in ("yes", "no") and tokens(outs)[-1] == 0
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].num_output_tokens < 30


@pytest.mark.parametrize("constraint, check", [
    (Constraint("regex", "[a-z]{2,4}:[0-9]{3}"), lambda s: len(s.split(":")[1]) == 3 and s.split(":")[0].isalpha()),
    (Constraint("choice", '["alpha", "beta", "gamma"]'), lambda s: s in ("alpha", "beta", "gamma")),
    (Constraint.json_schema(SCHEMA), lambda s: json.loads(s)["b"] in (True, False)),
])
def test_constrained_output_matches_on_the_fake_model(constraint, check):
    e = engine()
    e.add_request("c", [5, 6, 7], greedy(constraint))
    outs = drain(e)["c"]
    assert check(text(outs)) and outs[-1].finish_reason is FinishReason.STOP


def test_a_grammar_no_token_can_continue_fails_its_request_alone():
    e = engine()
    e.add_request("dead", [1, 2], greedy(Constraint("regex", "ab-c")))  # the vocabulary has no '-'
    e.add_request("free", [1, 2], greedy(None, max_tokens=6))
    outs = drain(e)
    assert text(outs["dead"]) == "ab" and outs["dead"][-1].finish_reason is FinishReason.ERROR
    assert "no token of this model's vocabulary can continue" in outs["dead"][-1].error
    assert outs["dead"][-1].error_field == "response_format"  # the constraint's field: the server's 400 names it
    assert outs["free"][-1].finish_reason is FinishReason.LENGTH


def test_a_matcher_that_raises_fails_only_its_own_request():
    e = engine()
    e.compile_constraint(Constraint.json_schema(SCHEMA)).result(timeout=60)  # compiled: admitted at once
    for name in ("broken", "fine"):
        e.add_request(name, [1, 2], greedy(Constraint.json_schema(SCHEMA)))
    e.add_request("free", [1, 2], greedy(None, max_tokens=8))

    def explode(token_id):
        raise RuntimeError("matcher exploded")

    e.requests["broken"].grammar.accept = explode
    outs = drain(e)
    assert outs["broken"][-1].finish_reason is FinishReason.ERROR and "matcher exploded" in outs["broken"][-1].error
    assert outs["fine"][-1].finish_reason is FinishReason.STOP and json.loads(text(outs["fine"]))
    assert outs["free"][-1].finish_reason is FinishReason.LENGTH


# -- batch invariance and preemption -------------------------------------------------------------------

CROWD = [
    ([1, 2, 3], Constraint.json_schema(SCHEMA), 0.0),
    ([4, 5], None, 0.0),
    ([6, 7, 8, 9], Constraint("regex", "[a-z]{3,6}:[0-9]{2,5}"), 0.9),
    ([10, 11], None, 0.8),
    ([12], Constraint("choice", '["left", "right", "middle"]'), 0.7),
    ([13, 14, 15], Constraint("json_object"), 0.0),
]


def _params(constraint, temperature, seed):
    return SamplingParams(max_tokens=26, temperature=temperature, seed=seed, constraint=constraint)


def test_a_crowd_mixing_constrained_and_free_requests_through_preemption_matches_the_solo_runs():
    solo = []
    for i, (prompt, constraint, temperature) in enumerate(CROWD):
        e = engine(num_blocks=32)
        e.add_request(str(i), prompt, _params(constraint, temperature, i))
        solo.append(tokens(drain(e)[str(i)]))
    tight = engine(num_blocks=8, block_size=4, max_running=6)  # 32 slots for ~6 x 29: must preempt
    for i, (prompt, constraint, temperature) in enumerate(CROWD):
        tight.add_request(str(i), prompt, _params(constraint, temperature, i))
    outs = drain(tight)
    assert tight.stats()["preemptions_total"] > 0
    assert [tokens(outs[str(i)]) for i in range(len(CROWD))] == solo
    assert json.loads(text(outs["0"]))["a"] in ("xyz", "abc")


def test_a_request_preempted_mid_json_resumes_with_its_matcher_state():
    tight = engine(num_blocks=8, block_size=4, max_running=3)  # 32 slots for 3 x 24: must preempt
    for i in range(3):
        tight.add_request(f"j{i}", [i + 1, i + 2], greedy(Constraint.json_schema(SCHEMA), max_tokens=22))
    checked = 0
    for _ in range(500):
        if not tight.has_unfinished():
            break
        tight.step()
        tight.audit()
        for request in tight.scheduler.running:
            if request.num_preemptions and request.output_token_ids and request.num_computed_tokens < request.num_tokens:
                # resumed and recomputing: its matcher is the one its accepted output tokens give
                fresh = tight.grammars.matcher(tight.grammars.submit(request.sampling_params.constraint).result())
                for token_id in request.output_token_ids:
                    fresh.accept(token_id)
                assert torch.equal(fresh.allowed(), request.grammar.allowed())
                assert request.grammar.num_accepted == request.num_output_tokens
                checked += 1
    assert checked and tight.stats()["preemptions_total"] > 0


# -- the default model -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_engine(default_model_dir, default_tokenizer):
    from pagoda.model.factory import EngineOptions, load_engine

    options = EngineOptions(device="cpu", dtype="float32", num_blocks=128, max_model_len=1024)
    return load_engine(default_model_dir, default_tokenizer, options)


@pytest.mark.slow
def test_constrained_output_on_the_default_model(default_engine, default_tokenizer):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}}}

    def chat(content):
        return default_tokenizer.encode_chat([{"role": "user", "content": content}])

    asks = {
        "schema": (chat("Describe a person named Ann aged 31 as JSON."), Constraint.json_schema(schema)),
        "object": (chat('Reply with exactly {"city": "Paris"}'), Constraint("json_object")),
        "regex": (chat("Name a colour."), Constraint("regex", "[A-Z][a-z]{2,8}")),
        "choice": (chat("What is the capital of France?"), Constraint("choice", '["Paris", "London", "Rome"]')),
    }
    for name, (prompt, constraint) in asks.items():
        default_engine.add_request(name, prompt, greedy(constraint, max_tokens=32))
    outs = drain(default_engine)
    assert all(outs[name][-1].finish_reason is FinishReason.STOP for name in asks), {k: text(v) for k, v in outs.items()}
    jsonschema.validate(json.loads(text(outs["schema"])), schema)
    assert isinstance(json.loads(text(outs["object"])), dict)
    assert text(outs["regex"]).isalpha() and text(outs["regex"])[0].isupper()
    assert text(outs["choice"]) in ("Paris", "London", "Rome")


# -- what JSON output may look like ------------------------------------------------------------------

def _matches(grammars: Grammars, constraint: Constraint, text: str) -> bool:
    """Whether the grammar accepts `text` (a token a character) and may end there."""
    grammar = grammars.matcher(grammars.submit(constraint).result(timeout=60))
    try:
        for char in text:
            grammar.accept(CHARS.index(char) + 1)
        grammar.accept(0)  # EOS: the grammar may end here
    except ValueError:
        return False
    return grammar.is_terminated


def test_json_object_admits_only_an_object_at_the_top_level():
    grammars = Grammars(tiny_tokenizer().token_vocab, 64, [0])
    grammar = grammars.matcher(grammars.submit(Constraint("json_object")).result(timeout=60))
    assert _allowed_ids(grammar) == {CHARS.index("{") + 1}  # not '[', a digit, a quote or whitespace
    obj = Constraint("json_object")
    assert _matches(grammars, obj, '{"a": [1, 2]}') and _matches(grammars, obj, "{}")
    for not_an_object in ("[1, 2]", "12", '"ab"', "true", "null"):
        assert not _matches(grammars, obj, not_an_object), not_an_object
    grammars.shutdown()


@pytest.mark.parametrize("constraint", [Constraint.json_schema(SCHEMA), Constraint("json_object")],
                         ids=["json_schema", "json_object"])
def test_json_output_is_compact_one_line_by_default(constraint):
    grammars = Grammars(tiny_tokenizer().token_vocab, 64, [0])
    assert _matches(grammars, constraint, '{"a": "xyz", "b": true}')
    for loose in ('{ "a": "xyz", "b": true}', '{"a": "xyz",\n"b": true}', '{"a":  "xyz", "b": true}',
                  '{"a": "xyz", "b": true}\n', '\n{"a": "xyz", "b": true}'):
        assert not _matches(grammars, constraint, loose), loose
    grammars.shutdown()


@pytest.mark.parametrize("constraint", [Constraint.json_schema(SCHEMA), Constraint("json_object")],
                         ids=["json_schema", "json_object"])
def test_grammars_with_any_whitespace_admit_it_and_still_enforce_the_format(constraint):
    grammars = Grammars(tiny_tokenizer().token_vocab, 64, [0], any_whitespace=True)
    for text in ('{"a": "xyz", "b": true}', '{\n  "a" : "xyz",\n  "b": true\n}', '{"a":"xyz","b":true}'):
        assert _matches(grammars, constraint, text), text
    assert not _matches(grammars, constraint, "[1, 2]")
    if constraint.kind == "json_schema":
        assert not _matches(grammars, constraint, '{"a": "no", "b": true}')
        assert not _matches(grammars, constraint, '{"b": true}')
    grammars.shutdown()
