"""Structured outputs on a tiny random llama: every sampled output of a constrained request is
in its language (30 real-world JSON schemas, a regex, choices, a grammar), EOS comes only where
the grammar accepts, a constraint that cannot compile is refused, and ``logit_bias`` moves the
sampler."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jsonschema
import pytest
import torch

from inference_engine import SamplingParams
from inference_engine.guided import (
    MAX_OPTIONAL_PROPERTIES,
    GrammarCompiler,
    InvalidGrammar,
    apply_bitmask,
    fill_bitmask,
)
from inference_engine.protocol import InvalidParam, StructuredOutputsParams
from inference_engine.request import NO_TOKEN
from inference_engine.sampler import Sampler, SamplingRow
from inference_engine.tokenization import render_chat, tool_call_parser
from tests.inference_engine.conftest import build_tokenizer

SCHEMAS = json.loads((Path(__file__).parent / "data" / "schemas.json").read_text())
SAMPLES_PER_SCHEMA = 4
EOS = 0  # the eos llama's <|eos|>


@pytest.fixture(scope="module")
def llm(eos_llama_dir):
    from inference_engine import LLM

    return LLM(eos_llama_dir, dtype="float32")


def closing_bias(tokenizer) -> dict[int, float]:
    """A push towards the tokens that end a JSON value, so that a random model's strings and
    numbers end within the token budget (the grammar alone guarantees validity, not brevity)."""
    closers = set('"}],')
    bias = {
        token_id: 6.0
        for token_id in range(len(tokenizer))
        if closers & set(tokenizer.decode([token_id]))
    }
    return bias | {EOS: 6.0}  # a top-level number or string ends at EOS


def json_params(schema: dict, tokenizer, **overrides) -> SamplingParams:
    values = dict(
        temperature=1.0,
        max_tokens=400,
        logit_bias=closing_bias(tokenizer),
        structured_outputs=StructuredOutputsParams(json=json.dumps(schema)),
    )
    values.update(overrides)
    return SamplingParams(**values)


@pytest.mark.parametrize(("low", "high"), [(0, 4), (3, None), (300, 400), (129, None), (0, 5000)])
def test_length_bounded_strings_hold_only_json_string_characters(low, high):
    """xgrammar's own rule for a length-bounded string admits raw control characters; the
    pattern that replaced it (``^[\\s\\S]{300,400}$``) admitted a raw quote and newlines from
    129 characters on (a reply that did not parse, finished "stop"), and took 22 s to compile
    at a bound of 5,000. A bound counts characters, an escape one."""
    import xgrammar

    bounded = {"type": "string", "minLength": low} | ({"maxLength": high} if high else {})
    schema = {"type": "object", "properties": {"a": bounded}, "required": ["a"]}
    compiled = GrammarCompiler(build_tokenizer(), 384, frozenset([0])).compile(
        StructuredOutputsParams(json=json.dumps(schema))
    )

    def accepts(value: str) -> bool:
        return xgrammar.GrammarMatcher(compiled).accept_string(f'{{"a": "{value}"}}')

    enough = "x" * max(low, 1)
    assert accepts(enough)
    if low > 2:  # an escaped quote and an escaped letter: a character each
        assert accepts(enough[:-2] + '\\"' + "\\u00e9")
    assert not accepts(enough + '"')  # a raw quote inside
    assert not accepts(enough + "\n") and not accepts(enough + "\x01")
    if low > 1:
        assert not accepts("x" * (low - 1))
    if high is not None:
        assert not accepts("x" * (high + 1))


@pytest.mark.parametrize(
    ("bounds", "message"),
    [
        ({"minLength": 2**31}, "minLength"),
        ({"minLength": 2**40}, "minLength"),
        ({"maxLength": -1}, "maxLength"),
        ({"minLength": 1.5}, "minLength"),
        ({"minLength": 5, "maxLength": 4}, "minLength"),
        ({"type": "array", "minItems": 2**40}, "minItems"),
    ],
)
def test_length_bounds_out_of_range_are_refused_by_name(bounds, message):
    """2**31 was refused as "Invalid repetition range {-2147483648, -1}", and 2**40 wrapped
    around: a string of 12 characters, finished "stop"."""
    schema = {"type": "string"} | bounds
    compiler = GrammarCompiler(build_tokenizer(), 384, frozenset([0]))
    with pytest.raises(InvalidGrammar, match=message):
        compiler.compile(StructuredOutputsParams(json=json.dumps(schema)))


def test_sampled_outputs_of_thirty_schemas_always_parse_and_validate(llm):
    """All schemas in one batch, several samples each: every step masks many different
    grammars at once."""
    prompts, params = [], []
    for index, schema in enumerate(SCHEMAS):
        for sample in range(SAMPLES_PER_SCHEMA):
            prompts.append("hello world")
            params.append(json_params(schema, llm.tokenizer, seed=index * 100 + sample))
    outputs = llm.generate(prompts, params)
    for i, output in enumerate(outputs):
        schema = SCHEMAS[i // SAMPLES_PER_SCHEMA]
        assert output.finish_reason == "stop", (schema["title"], output.text, output.error)
        assert output.token_ids[-1] == EOS  # it ended because the grammar let it
        value = json.loads(output.text)
        jsonschema.validate(value, schema)


@pytest.mark.parametrize("max_tokens", [160, 256])
def test_json_closes_before_the_token_limit_however_the_model_rambles(llm, max_tokens):
    """No help from a bias here: near its limit a JSON-guided request is steered to close its
    value, so it parses instead of being cut off inside a string. (This tokenizer spends a
    token per character on most keys: the budgets are larger than a real one needs.) A
    string ``pattern`` can need characters before its closing quote that no steering
    reaches: those schemas are left out."""
    schemas = [schema for schema in SCHEMAS if '"pattern"' not in json.dumps(schema)]
    params = [
        SamplingParams(
            temperature=1.0,
            max_tokens=max_tokens,
            seed=i,
            structured_outputs=StructuredOutputsParams(json=json.dumps(schema)),
        )
        for i, schema in enumerate(schemas)
    ]
    outputs = llm.generate(["hello world"] * len(schemas), params)
    assert len(schemas) >= 25
    for schema, output in zip(schemas, outputs, strict=True):
        assert output.finish_reason == "stop", (schema["title"], output.text)
        assert len(output.token_ids) <= max_tokens
        jsonschema.validate(json.loads(output.text), schema)


def test_the_demo_model_answers_a_schema_and_a_named_tool_with_valid_json():
    """The bundled model rambles inside strings; the README's two examples still parse, at
    their budgets, greedy and sampled."""
    from inference_engine import LLM

    llm = LLM(str(Path(__file__).resolve().parents[2] / "models" / "demo-chat"))
    answer = {
        "type": "object",
        "properties": {"topic": {"type": "string"}, "needs_code": {"type": "boolean"}},
        "required": ["topic", "needs_code"],
    }
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    questions = ["What is a list?", "Weather in Paris?", "Explain decorators", "hi"]
    for schema, max_tokens in ((answer, 200), (city, 100)):
        for temperature in (0, 1.0):
            params = SamplingParams(
                temperature=temperature,
                max_tokens=max_tokens,
                seed=1,
                structured_outputs=StructuredOutputsParams(json=json.dumps(schema)),
            )
            conversations = [[{"role": "user", "content": q}] for q in questions]
            for output in llm.chat(conversations, params):
                assert output.finish_reason == "stop", output.text
                jsonschema.validate(json.loads(output.text), schema)


def test_greedy_outputs_validate_and_eos_comes_only_where_the_grammar_accepts(llm):
    """With EOS pushed up by +100 the model wants to stop at every step; the grammar lets it
    only once the value is complete."""
    tokenizer = llm.tokenizer
    params = [
        json_params(schema, tokenizer, temperature=0, logit_bias={EOS: 100.0}) for schema in SCHEMAS
    ]
    outputs = llm.generate(["the quick brown fox"] * len(SCHEMAS), params)
    for schema, output in zip(SCHEMAS, outputs, strict=True):
        if output.finish_reason == "length":
            continue  # a random model may run out of tokens inside a string; not a stop
        assert output.finish_reason == "stop", output.error
        assert output.token_ids.count(EOS) == 1
        jsonschema.validate(json.loads(output.text), schema)


@pytest.mark.parametrize(
    ("spec", "accepts"),
    [
        (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), r"^[0-9]{3}-[a-z]{2}$"),
        (StructuredOutputsParams(choice=["yes", "no", 'say "maybe"']), r'^(yes|no|say "maybe")$'),
        (StructuredOutputsParams(grammar='root ::= "(" [a-c]+ ")"'), r"^\([a-c]+\)$"),
    ],
)
def test_regex_choice_and_grammar_outputs_are_in_their_language(llm, spec, accepts):
    import re

    params = SamplingParams(temperature=1.0, max_tokens=64, structured_outputs=spec, seed=7)
    outputs = llm.generate(["hi", "one two", "hello world", "lazy dog"] * 2, params)
    for output in outputs:
        assert output.finish_reason in ("stop", "length"), output.error
        if output.finish_reason == "stop":
            assert re.match(accepts, output.text), output.text


def test_json_object_gives_an_object(llm):
    params = SamplingParams(
        temperature=1.0,
        max_tokens=300,
        logit_bias=closing_bias(llm.tokenizer),
        structured_outputs=StructuredOutputsParams(json_object=True),
        seed=3,
    )
    for output in llm.generate(["hello"] * 4, params):
        assert output.finish_reason == "stop", output.text
        assert isinstance(json.loads(output.text), dict)


def test_guided_and_free_requests_share_a_step_without_touching_each_other(llm):
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["the quick brown fox"], free)[0].token_ids
    guided = json_params(SCHEMAS[0], llm.tokenizer, temperature=0)
    mixed = llm.generate(["the quick brown fox", "hello world"], [free, guided])
    assert mixed[0].token_ids == alone
    json.loads(mixed[1].text)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputsParams(json='{"type": "nonsense"}'), 'Unsupported type "nonsense"'),
        (StructuredOutputsParams(json="not json"), "Failed to parse JSON"),
        (StructuredOutputsParams(regex="(unclosed"), "parenthesis is not closed"),
        (StructuredOutputsParams(grammar='root ::= "a" |'), "EBNF parser error"),
    ],
)
def test_a_constraint_that_cannot_compile_is_refused_naming_the_problem(llm, spec, message):
    output = llm.generate("hello", SamplingParams(max_tokens=5, structured_outputs=spec))[0]
    assert output.finish_reason == "error"
    assert output.error.startswith(f"structured_outputs.{spec.kind()} cannot be compiled: ")
    assert message in output.error
    assert "/project/" not in output.error  # the library's source positions are cut


@pytest.mark.parametrize(
    ("values", "field"),
    [
        (dict(json="{}", regex="a"), "structured_outputs"),
        (dict(), "structured_outputs"),
        (dict(choice=[]), "structured_outputs"),
        (dict(choice=["a", ""]), "structured_outputs"),
        (dict(regex=""), "structured_outputs"),
        (dict(json="x" * ((256 << 10) + 1)), "structured_outputs"),
    ],
)
def test_malformed_constraints_are_invalid_params(values, field):
    with pytest.raises(InvalidParam) as caught:
        SamplingParams(structured_outputs=StructuredOutputsParams(**values))
    assert caught.value.field == field


def test_ignore_eos_cannot_be_combined_with_a_grammar():
    with pytest.raises(InvalidParam, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a+"))


def test_a_grammar_compiles_once_per_distinct_constraint_and_cache_salt(llm, monkeypatch):
    """Compiled once per tenant (its prefix cache salt), not once for all: a compile takes tens
    of milliseconds, so a tenant timing its first token could tell whether another tenant
    had sent the same schema (the prefix cache is salted for the same reason)."""
    grammars = llm.core.grammars
    compiled = []
    library = grammars._library()
    compile_json_schema = library.compile_json_schema

    def counted(*args, **kwargs):
        compiled.append(args[0])
        return compile_json_schema(*args, **kwargs)

    monkeypatch.setattr(library, "compile_json_schema", counted)
    unseen = {"type": "object", "properties": {"cache_probe": {"type": "integer"}}}
    spec = StructuredOutputsParams(json=json.dumps(unseen))

    first = grammars.compile(spec, salt="tenant-a")
    assert (
        grammars.compile(StructuredOutputsParams(json=json.dumps(unseen)), salt="tenant-a") is first
    )
    assert len(compiled) == 1
    grammars.compile(spec, salt="tenant-b")  # another tenant's: compiled for it
    grammars.compile(spec)  # no salt (in-process LLM): one of its own
    assert len(compiled) == 3
    grammars.compile(spec, salt="tenant-b")
    assert len(compiled) == 3


def test_the_grammar_cache_keeps_within_its_bytes(llm, monkeypatch):
    from inference_engine import guided

    grammars = llm.core.grammars
    size = grammars.compile(StructuredOutputsParams(regex="[a-z]{3}"), salt="s0")
    monkeypatch.setattr(guided, "CACHE_LIMIT_BYTES", 3 * size.memory_size_bytes)
    for n in range(8):
        grammars.compile(StructuredOutputsParams(regex="[a-z]{3}"), salt=f"s{n}")
    assert grammars.cache_bytes() <= guided.CACHE_LIMIT_BYTES


class _NothingAllowed:
    """A matcher in a state no token can continue (a grammar that needs a string the
    tokenizer cannot spell)."""

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0

    def accept_token(self, token_id: int) -> bool:
        raise AssertionError("no token may be fed to a matcher that allows none")


def test_a_row_whose_grammar_allows_no_token_gets_none_and_the_others_sample():
    params = SamplingParams(temperature=0, max_tokens=4)
    rows = [
        SamplingRow("a", params, [1], [], frozenset(), grammar=_NothingAllowed()),
        SamplingRow("b", params, [1], [], frozenset()),
    ]
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 1.0, 0.0]])
    token_ids, _ = Sampler(torch.device("cpu"))(logits, rows)
    assert token_ids == [NO_TOKEN, 0]


def test_the_core_fails_a_request_its_grammar_strands(llm):
    """A request whose grammar allows no next token ends with an error; the rest of the batch
    goes on."""
    from inference_engine.protocol import ErrorCode, FinishReason

    core = llm.core
    grammar_params = SamplingParams(temperature=0, max_tokens=8)
    core.add_request("stranded", [5, 6], grammar_params)
    core.add_request("free", [5, 6], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    core.scheduler.requests["stranded"].grammar = _NothingAllowed()
    outputs = []
    while core.has_unfinished_requests():
        outputs.extend(core.step())
    stranded = [o for o in outputs if o.req_id == "stranded"]
    assert [o.finish_reason for o in stranded] == [FinishReason.ERROR]
    assert stranded[0].error_code == ErrorCode.INVALID_REQUEST
    assert "allows no token" in stranded[0].error_message
    assert sum(len(o.new_token_ids) for o in outputs if o.req_id == "free") == 3


def test_the_core_fails_a_request_left_no_token_to_draw_and_the_batch_goes_on(llm):
    """The out-of-vocabulary id such a request drew failed the next step's forward: every
    request in the batch ended with an engine error."""
    from inference_engine.protocol import ErrorCode, FinishReason

    core = llm.core
    banned_all = SamplingParams(
        temperature=1.0, min_tokens=3, max_tokens=8, stop_token_ids=list(range(core.vocab_size))
    )
    core.add_request("banned", [5, 6], banned_all)
    core.add_request("free", [5, 6], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outputs = []
    while core.has_unfinished_requests():
        outputs.extend(core.step())
    banned = [o for o in outputs if o.req_id == "banned"]
    assert [o.finish_reason for o in banned] == [FinishReason.ERROR]
    assert banned[0].error_code == ErrorCode.INVALID_REQUEST and not banned[0].new_token_ids
    assert "no token with any probability" in banned[0].error_message
    free = [o for o in outputs if o.req_id == "free"]
    assert sum(len(o.new_token_ids) for o in free) == 3
    assert free[-1].finish_reason == FinishReason.LENGTH


def test_the_bitmask_masks_exactly_the_cleared_bits():
    vocab_size = 70
    allowed = [0, 5, 31, 32, 63, 64, 69]
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    for token in allowed:
        word = int(bitmask[0, token // 32]) | (1 << (token % 32))
        bitmask[0, token // 32] = word - (1 << 32) if word >= 1 << 31 else word
    logits = torch.zeros(2, vocab_size)
    apply_bitmask(logits, torch.tensor([1]), bitmask)
    assert torch.isfinite(logits[0]).all()  # rows not named stay untouched
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == allowed


def test_the_device_unpacking_equals_the_host_one():
    """A GPU unpacks the bits with torch's shifts; the same words give the same bits."""
    from inference_engine.guided import unpack_bits_on_device, unpack_bits_on_host

    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 4), dtype=torch.int32, generator=generator)
    host = torch.from_numpy(unpack_bits_on_host(bitmask, 100)).to(torch.int32)
    assert torch.equal(unpack_bits_on_device(bitmask, 100), host)
    assert host.shape == (5, 100)


def test_the_filled_mask_of_a_choice_allows_its_first_tokens(tokenizer):
    grammars = GrammarCompiler(tokenizer, len(tokenizer), frozenset({EOS}))
    matcher = grammars.matcher(StructuredOutputsParams(choice=["hello", "world"]))
    bitmask = fill_bitmask([matcher], len(tokenizer))
    logits = torch.zeros(1, len(tokenizer))
    apply_bitmask(logits, torch.tensor([0]), bitmask)
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    texts = {tokenizer.decode([token]) for token in allowed}
    assert texts and all("hello".startswith(t) or "world".startswith(t) for t in texts)
    with pytest.raises(InvalidGrammar):
        grammars.compile(StructuredOutputsParams(regex="[unclosed"))


def test_logit_bias_moves_the_sampler(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = llm.generate("hello world", greedy)[0].token_ids
    forced = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={42: 100.0})
    assert llm.generate("hello world", forced)[0].token_ids == [42] * 6
    banned = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logit_bias={plain[0]: -100.0}
    )
    assert llm.generate("hello world", banned)[0].token_ids[0] != plain[0]


@pytest.mark.parametrize(
    "bias", [{-1: 1.0}, {1: 101.0}, {1: float("nan")}, {i: 1.0 for i in range(1025)}]
)
def test_logit_bias_out_of_bounds_is_an_invalid_param(bias):
    with pytest.raises(InvalidParam) as caught:
        SamplingParams(logit_bias=bias)
    assert caught.value.field == "logit_bias"


def test_logit_bias_beyond_the_vocabulary_is_refused(llm):
    output = llm.generate("hi", SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}))[0]
    assert output.finish_reason == "error"
    assert "logit_bias" in output.error


TOOL_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}"
    "{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c['function'] | tojson }}"
    "</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_tools_and_tool_turns_are_rendered_by_the_template():
    from inference_engine.protocol import Message, ToolCall
    from tests.inference_engine.conftest import build_tokenizer

    tool_tokenizer = build_tokenizer()
    tool_tokenizer.chat_template = TOOL_TEMPLATE
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [
        Message("user", "weather?"),
        Message("assistant", "", tool_calls=[ToolCall("call_1", "get_weather", '{"city": "x"}')]),
        Message("tool", "sunny", tool_call_id="call_1"),
    ]
    ids = render_chat(tool_tokenizer, [m.as_template_input() for m in messages], tools)
    text = tool_tokenizer.decode(ids)
    assert "tools: get_weather" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "x"}}</tool_call>' in text
    assert "<|tool|>sunny" in text
    assert tool_call_parser(tool_tokenizer) == "hermes"
    assert tool_call_parser(build_tokenizer()) == ""


def _compile_in_a_child(schema_expr: str) -> subprocess.CompletedProcess:
    """Compile a schema as the server's intake thread does, in a child process: a crash of
    the grammar library there cannot take the test run down."""
    code = textwrap.dedent(
        f"""
        import json, sys, threading
        sys.path.insert(0, {str(Path(__file__).parents[2])!r})
        from tests.inference_engine.conftest import build_tokenizer
        from inference_engine.guided import GrammarCompiler, InvalidGrammar
        from inference_engine.protocol import StructuredOutputsParams
        compiler = GrammarCompiler(build_tokenizer(), 384, frozenset([0]))
        spec = StructuredOutputsParams(json=json.dumps({schema_expr}))
        spec.validate()
        def intake():
            try:
                compiler.compile(spec)
                print("compiled")
            except InvalidGrammar as exc:
                print("refused:", exc)
        thread = threading.Thread(target=intake)
        thread.start()
        thread.join()
        """
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.parametrize(
    "schema_expr",
    [
        '{"type": "string", "pattern": "(" * 40000 + "a" + ")" * 40000}',
        '{"type": "object", "propertyNames": {"pattern": "(" * 40000 + "a" + ")" * 40000}}',
        '{"type": "object", "patternProperties": {"(" * 40000 + "a" + ")" * 40000: {}}}',
    ],
    ids=["pattern", "propertyNames", "patternProperties"],
)
def test_a_pattern_nested_too_deep_is_refused_not_the_engines_death(schema_expr):
    """An 80 KB schema (within the size limit) killed the engine process: xgrammar's regex
    converter recurses per group, and 40,000 nested groups overflowed its stack."""
    result = _compile_in_a_child(schema_expr)
    assert result.returncode == 0, f"the compiling process died: rc={result.returncode}"
    assert "refused:" in result.stdout and "nests groups 40000 deep" in result.stdout


@pytest.mark.parametrize(
    "schema",
    [
        {"allOf": [{"type": "object", "required": ["a"]}, {"type": "object", "required": ["b"]}]},
        {"not": {"type": "integer"}},
        {"if": {"type": "integer"}, "then": {"minimum": 5}},
        {"type": "object", "properties": {"a": {"dependentRequired": {"x": ["y"]}}}},
        {"type": "array", "items": {"anyOf": [{"not": {"type": "string"}}]}},
    ],
)
def test_a_keyword_the_grammar_would_not_enforce_is_refused(llm, schema):
    """xgrammar ignores them: the schema was served as if it were enforced."""
    spec = StructuredOutputsParams(json=json.dumps(schema))
    output = llm.generate("hello", SamplingParams(max_tokens=5, structured_outputs=spec))[0]
    assert output.finish_reason == "error" and "is not supported" in output.error


def test_schemas_that_name_a_property_like_a_keyword_or_allof_one_schema_compile(llm):
    schema = {
        "type": "object",
        "properties": {"not": {"type": "integer"}, "if": {"allOf": [{"type": "string"}]}},
        "required": ["not", "if"],
    }
    spec = StructuredOutputsParams(json=json.dumps(schema))
    output = llm.generate("hello", SamplingParams(max_tokens=60, structured_outputs=spec))[0]
    assert output.finish_reason != "error", output.error


def test_an_object_of_too_many_optional_properties_is_refused_at_once(tokenizer):
    """Each optional property adds to every other's grammar: 1,500 took 10 s to compile on
    the intake thread that every new request of the engine waits behind."""
    compiler = GrammarCompiler(tokenizer, 384, frozenset([0]))
    properties = {f"p{i}": {"type": "integer"} for i in range(1500)}
    started = time.monotonic()
    with pytest.raises(InvalidGrammar, match="1500 optional properties"):
        compiler.compile(
            StructuredOutputsParams(json=json.dumps({"type": "object", "properties": properties}))
        )
    assert time.monotonic() - started < 1.0
    required = {"type": "object", "properties": properties, "required": list(properties)}
    compiler.compile(StructuredOutputsParams(json=json.dumps(required)))  # no optional ones
    allowed = {f"p{i}": {"type": "integer"} for i in range(MAX_OPTIONAL_PROPERTIES)}
    compiler.compile(
        StructuredOutputsParams(json=json.dumps({"type": "object", "properties": allowed}))
    )


def test_a_schema_that_allows_nothing_is_refused_before_its_prefill(llm):
    """``{"$ref": "#"}`` compiled, was admitted, ran its prefill, and only then failed as a
    step with no token to draw."""
    spec = StructuredOutputsParams(json=json.dumps({"$ref": "#"}))
    with pytest.raises(InvalidGrammar, match="allows no output"):
        llm.core.grammars.compile(spec)


def test_a_short_budget_still_writes_its_strings(llm):
    """With a budget of 32 tokens or fewer the closing steer was on from the first token:
    every string closed at once, {"answer": ""}, finish_reason stop."""
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string"}},
        "required": ["answer"],
    }
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=24,
            structured_outputs=StructuredOutputsParams(json=json.dumps(schema)),
        )
        for seed in range(4)
    ]
    outputs = llm.generate(["the quick brown"] * 4, params)
    answers = [json.loads(o.text)["answer"] for o in outputs if o.finish_reason == "stop"]
    assert any(answers), [o.text for o in outputs]


def test_a_grammar_being_built_holds_up_no_look_into_the_cache(monkeypatch):
    """The library's first build (a whole vocabulary read: seconds for a large one) held the
    cache's lock: the intake thread, asking whether a request's grammar was compiled, waited
    behind it, and with it every request."""
    import threading
    import time

    import xgrammar

    from tests.inference_engine.conftest import build_tokenizer

    building, gate = threading.Event(), threading.Event()
    from_huggingface = xgrammar.TokenizerInfo.from_huggingface

    def slow_build(*args, **kwargs):
        building.set()
        assert gate.wait(20)
        return from_huggingface(*args, **kwargs)

    monkeypatch.setattr(xgrammar.TokenizerInfo, "from_huggingface", slow_build)
    compiler = GrammarCompiler(build_tokenizer(), 384, frozenset([0]))
    spec = StructuredOutputsParams(regex="[ab]{1,3}")
    compiling = threading.Thread(target=compiler.compile, args=(spec,))
    compiling.start()
    try:
        assert building.wait(10)
        started = time.monotonic()
        assert compiler.cached(spec) is None
        assert time.monotonic() - started < 1.0
    finally:
        gate.set()
        compiling.join(10)
    assert compiler.cached(spec) is not None


def test_a_json_grammar_enters_the_cache_with_its_closing_tokens_built(llm, monkeypatch):
    """The grammar was cached before the closing tokens' first build (a whole vocabulary's
    read): a request taking it from the cache meanwhile had the busy loop wait for that
    build, every stream with it."""
    grammars = llm.core.grammars
    monkeypatch.setattr(grammars, "_closing_tokens", None)
    spec = StructuredOutputsParams(json=json.dumps({"type": "object", "title": "fresh"}))
    build, seen_cached = grammars.closing_tokens, []

    def closing_tokens():
        seen_cached.append(grammars.cached(spec, "salt") is not None)
        return build()

    monkeypatch.setattr(grammars, "closing_tokens", closing_tokens)
    llm.core.compile_structured_outputs(SamplingParams(structured_outputs=spec), "salt")
    assert seen_cached and not seen_cached[0]
