import json

import pytest

from gateway import openapi
from gateway.errors import ApiError
from gateway.validation import plan_chat, plan_completion
from serving.budget import ContextExceeded, PromptTokens, reserve

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _reservation(plan, max_context: int):
    """What a run of ``plan`` reserves on a replica of ``max_context`` tokens."""
    requests = plan.engine_requests("r")
    return reserve(
        prompt=plan.prompt_tokens,
        max_tokens=[r.params.max_tokens for r in requests],
        max_context=max_context,
    )


def _chat(**fields) -> bytes:
    return json.dumps({**CHAT, **fields}).encode()


def _completion(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


def _error(plan, body: bytes) -> ApiError:
    with pytest.raises(ApiError) as excinfo:
        plan(body)
    assert excinfo.value.status == 400
    return excinfo.value


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -5}, "max_completion_tokens"),
        ({"n": 0}, "n"),
        ({"n": 999}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"seed": 2**70}, "seed"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"functions": []}, "functions"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ({"model": ""}, "model"),
        ({"user": "u" * 300}, "user"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        # out of any engine's range: refused here, never encoded for the engine
        ({"temperature": 2.5}, "temperature"),
        ({"top_k": 10**30}, "top_k"),
        ({"n": 10**30}, "n"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"max_completion_tokens": 2**31}, "max_completion_tokens"),
        ({"min_tokens": 10**30}, "min_tokens"),
        ({"priority": 10**30}, "priority"),
        ({"seed": -(2**64)}, "seed"),
        ({"logprobs": True, "top_logprobs": 10**30}, "top_logprobs"),
        ({"repetition_penalty": 10**30}, "repetition_penalty"),
    ],
)
def test_invalid_chat_fields_name_their_param(fields, param):
    assert _error(plan_chat, _chat(**fields)).param == param


@pytest.mark.parametrize(
    "body", [b"", b"{", b"[]", b'"text"', b"\xff\xfe", b'{"model": "m"}', b"null"]
)
def test_malformed_bodies_are_refused(body):
    error = _error(plan_chat, body)
    assert error.message


def test_every_unknown_field_is_named_as_openai_names_them():
    error = _error(plan_chat, _chat(frobnicate=[], foo=1, bar=2))
    assert error.message == "Unrecognized request arguments supplied: bar, foo, frobnicate"
    assert error.param == "bar"
    assert _error(plan_chat, _chat(foo=1)).message == (
        "Unrecognized request argument supplied: foo"
    )
    deep = _chat()[:-1] + b', "x": ' + b'{"x": ' * 100_000 + b"1" + b"}" * 100_000 + b"}"
    assert _error(plan_chat, deep).param == "x"  # nested past any parser's depth


@pytest.mark.parametrize("field", ["structured_outputs", "response_format", "tools"])
def test_a_field_nested_past_pythons_stack_is_a_400(field):
    """The decoder reads untyped fields (a schema, a tool's parameters) by recursion: where
    Python's stack runs out it raised RecursionError, a 500 (json_body's cap stops such a body
    first; a batch line stored before the cap reaches the planner as it is)."""
    schema = b'{"a":' * 5_000 + b"1" + b"}" * 5_000
    value = {
        "structured_outputs": b'{"json": ' + schema + b"}",
        "response_format": b'{"type": "json_schema", "json_schema": {"name": "s", "schema": '
        + schema
        + b"}}",
        "tools": b'[{"type": "function", "function": {"name": "f", "parameters": '
        + schema
        + b"}}]",
    }[field]
    error = _error(plan_chat, _chat()[:-1] + b', "' + field.encode() + b'": ' + value + b"}")
    assert "100 levels" in error.message


def test_invalid_utf8_inside_a_string_is_a_400():
    body = b'{"model": "m", "messages": [{"role": "user", "content": "a\xffb"}]}'
    assert "UTF-8" in _error(plan_chat, body).message


def test_an_infinite_number_is_a_400():
    assert _error(plan_chat, _chat()[:-1] + b', "temperature": 1e400}').param == "temperature"


def test_a_valid_chat_request_becomes_one_engine_request():
    plan = plan_chat(
        _chat(
            messages=[
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
                },
            ],
            temperature=0,
            max_completion_tokens=7,
            max_tokens=99,
            stop="END",
            n=2,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            top_logprobs=2,
            top_k=5,
        )
    )
    [request] = plan.prompts
    assert [m.content for m in request.messages] == ["be brief", "hi there"]
    params = request.params
    assert (params.temperature, params.max_tokens, params.stop) == (0, 7, ["END"])
    assert (params.seed, params.top_k, params.logprobs) == (3, 5, 2)
    assert plan.n == 2 and plan.stream and plan.include_usage
    reservation = _reservation(plan, max_context=100)
    assert reservation.likely_tokens == plan.prompt_tokens.likely + 14
    assert reservation.tokens == plan.prompt_tokens.most + 14


def test_fields_of_openais_api_that_change_nothing_here_are_accepted():
    """Sent by current SDKs and frameworks where their users set them; refused as unknown,
    they failed requests that any OpenAI-compatible server takes."""
    plan = plan_chat(
        _chat(
            prompt_cache_key="tenant-app-7",
            safety_identifier="user-hash-1",
            stream=True,
            stream_options={"include_usage": True, "include_obfuscation": False},
        )
    )
    assert plan.include_usage
    assert _error(plan_chat, _chat(prompt_cache_keys="x")).param == "prompt_cache_keys"


def test_openais_fields_for_what_this_server_does_not_do_are_taken_when_they_ask_nothing():
    """Sent by SDKs, LangChain or LiteLLM as null or their no-op value, they were refused as
    "Unrecognized request argument" (OpenAI's words for a name it does not know)."""
    plan = plan_chat(
        _chat(
            modalities=["text"],
            audio=None,
            functions=None,
            function_call=None,
            web_search_options=None,
            verbosity="medium",
            prediction={"type": "content", "content": "hi there"},
        )
    )
    assert plan.prompts[0].messages[0].content == "hi"
    completion = {"model": "m", "prompt": "hi", "n": 2}
    assert plan_completion(json.dumps({**completion, "suffix": None, "best_of": 2}).encode())
    assert plan_completion(json.dumps({**completion, "suffix": ""}).encode())


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"function_call": "auto"}, "function_call"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"verbosity": "low"}, "verbosity"),
    ],
)
def test_asking_for_what_this_server_does_not_do_says_so(fields, param):
    error = _error(plan_chat, _chat(**fields))
    assert error.param == param and "not supported" in error.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"suffix": "end"}, "suffix"), ({"best_of": 3, "n": 2}, "best_of")],
)
def test_a_completion_asking_for_what_this_server_does_not_do_says_so(fields, param):
    body = json.dumps({"model": "m", "prompt": "hi", **fields}).encode()
    error = _error(plan_completion, body)
    assert error.param == param and "not supported" in error.message


def test_an_echo_asks_the_engine_for_the_prompts_logprobs_and_a_token_prompts_text():
    body = {"model": "m", "prompt": "hi", "echo": True, "logprobs": 2}
    plan = plan_completion(json.dumps(body).encode())
    assert plan.echo and not plan.echo_only
    assert plan.prompts[0].params.prompt_logprobs == 2
    assert not plan.prompts[0].return_prompt_text  # echoed as sent
    tokens = plan_completion(json.dumps({**body, "prompt": [[5, 6], [7]]}).encode())
    assert [request.return_prompt_text for request in tokens.prompts] == [True, True]
    alone = plan_completion(json.dumps({**body, "max_tokens": 0}).encode())
    assert alone.echo_only and alone.prompts[0].params.max_tokens == 1
    plain = plan_completion(json.dumps({**body, "prompt": [5], "echo": False}).encode())
    assert not plain.echo and plain.prompts[0].params.prompt_logprobs is None
    assert not plain.prompts[0].return_prompt_text
    no_logprobs = plan_completion(json.dumps({"model": "m", "prompt": "hi", "echo": True}).encode())
    assert no_logprobs.prompts[0].params.prompt_logprobs is None


def test_a_top_p_of_zero_is_greedy_as_openai_takes_it():
    params = plan_chat(_chat(top_p=0, temperature=0.9)).prompts[0].params
    assert (params.temperature, params.top_p) == (0.0, 1.0)


def test_vllms_stop_token_ids_and_stop_string_keeping_reach_the_engine():
    params = plan_chat(_chat(stop_token_ids=[7, 9], include_stop_str_in_output=True))
    assert params.prompts[0].params.stop_token_ids == [7, 9]
    assert params.prompts[0].params.include_stop_str_in_output


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("fields", "skip"),
    [
        ({}, True),  # vLLM's default
        ({"skip_special_tokens": False}, False),
        # the model may call at will: its calls' tags, special tokens in some models (Hermes 2
        # Pro's), must reach the reader as text, as vLLM's Hermes parser asks
        ({"tools": [TOOL]}, False),
        ({"tools": [TOOL], "tool_choice": "auto"}, False),
        ({"tools": [TOOL], "tool_choice": "auto", "skip_special_tokens": True}, True),
        ({"tools": [TOOL], "tool_choice": "none"}, True),
        ({"tools": [TOOL], "tool_choice": "required"}, True),  # guided: no tags to read
    ],
)
def test_special_tokens_are_skipped_unless_asked_or_read_as_tool_calls(fields, skip):
    assert plan_chat(_chat(**fields)).prompts[0].params.skip_special_tokens is skip


def test_a_completion_may_keep_special_tokens():
    plan = plan_completion(
        json.dumps({"model": "m", "prompt": "x", "skip_special_tokens": False}).encode()
    )
    assert plan.prompts[0].params.skip_special_tokens is False


def test_an_assistant_turn_that_refused_is_sent_back_as_openai_gave_it():
    """SDKs give back the refusal OpenAI answered with: a null content beside it, or a part
    of the content. Both were 400s; the model is shown what it refused with."""
    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "refusal": "I can't help with that."},
        {"role": "user", "content": "why?"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "Policy."}]},
        {"role": "user", "content": "ok"},
    ]
    messages = plan_chat(_chat(messages=turns)).prompts[0].messages
    assert [m.content for m in messages] == [
        "hi",
        "I can't help with that.",
        "why?",
        "Policy.",
        "ok",
    ]
    user_refusal = [{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]
    assert _error(plan_chat, _chat(messages=user_refusal)).param == "messages[0].content"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"model": "a\u0000b"}, "model"),
        ({"user": "alice\u0000"}, "user"),
        ({"metadata": {"k": "v\u0000"}}, "metadata"),
        ({"metadata": {"k\u0000": "v"}}, "metadata"),
    ],
)
def test_a_nul_in_a_field_that_is_stored_or_looked_up_is_refused(fields, param):
    """PostgreSQL's text refuses NUL: the usage record of such a request could not be written
    (it ran unmetered, and its stream never ended), and a model name failed its look-up (a
    500). Text the model reads may hold one."""
    body = json.dumps({**json.loads(_chat()), **fields}).encode()
    assert _error(plan_chat, body).param == param
    assert plan_chat(_chat(messages=[{"role": "user", "content": "a\u0000b"}]))


def test_nulls_mean_defaults():
    plan = plan_chat(_chat(temperature=None, top_p=None, n=None, stop=None, max_tokens=None))
    assert plan.prompts[0].params.temperature == 1.0 and plan.n == 1
    assert _reservation(plan, max_context=64).likely_tokens > plan.prompt_tokens.likely
    assert plan.prompts[0].params.max_tokens is None  # up to the context length


@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_above_the_context_can_never_be_served(param):
    """The run refuses it (tests/serving/test_runs.py), a 400 (test_hostile_input)."""
    plan = plan_chat(_chat(**{param: 10**9}))
    assert plan.max_tokens_param == param
    with pytest.raises(ContextExceeded):
        _reservation(plan, max_context=2048)
    assert _reservation(plan_chat(_chat(**{param: 2048})), max_context=2048)


@pytest.mark.parametrize("fields", [{}, {"max_tokens": None}])
def test_completions_default_to_16_tokens_as_openai_and_vllm_have_it(fields):
    """The legacy Completions API stops at 16 tokens unless asked for more; a chat goes up to
    the context (test_nulls_mean_defaults)."""
    plan = plan_completion(json.dumps({"model": "m", "prompt": "hi", "n": 2, **fields}).encode())
    assert [r.params.max_tokens for r in plan.engine_requests("r")] == [16, 16]
    assert _reservation(plan, max_context=4096).tokens == plan.prompt_tokens.most + 2 * 16


def test_the_openapi_document_states_each_endpoints_max_tokens_default():
    components = json.loads(openapi.document())["components"]["schemas"]
    assert components["CompletionRequest"]["properties"]["max_tokens"]["default"] == 16
    assert components["ChatCompletionRequest"]["properties"]["max_tokens"]["default"] is None


@pytest.mark.parametrize(
    ("prompt", "count"),
    [("hello", 1), (["a", "b", "c"], 3), ([1, 2, 3], 1), ([[1, 2, 3], [4, 5]], 2)],
)
def test_completion_prompts(prompt, count):
    plan = plan_completion(json.dumps({"model": "m", "prompt": prompt}).encode())
    assert len(plan.prompts) == count


def test_each_token_array_is_one_prompt_counted_by_its_ids():
    plan = plan_completion(json.dumps({"model": "m", "prompt": [[10, 11, 12], [20, 21]]}).encode())
    assert [request.prompt_token_ids for request in plan.prompts] == [[10, 11, 12], [20, 21]]
    assert all(request.prompt is None for request in plan.prompts)
    assert plan.prompt_tokens == PromptTokens(5, 5)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [-1]}, "prompt[0]"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens"),
        ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": "x", "logprobs": 99}, "logprobs"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": [10**23]}, "prompt[0]"),
        ({"prompt": "x", "logprobs": 10**30}, "logprobs"),
        # arrays of token arrays: as strict as one array of token ids
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": [[1], "a"]}, "prompt"),
        ({"prompt": ["a", [1]]}, "prompt"),
        ({"prompt": [[1], 2]}, "prompt"),
        ({"prompt": [[1]] * 17}, "prompt"),
        ({"prompt": [[1, -1]]}, "prompt[0][1]"),
        ({"prompt": [[1], [10**23]]}, "prompt[1][0]"),
        ({"prompt": [[1, [2]]]}, "prompt[0][1]"),
    ],
)
def test_invalid_completion_fields(fields, param):
    assert _error(plan_completion, json.dumps({"model": "m", **fields}).encode()).param == param


@pytest.mark.parametrize(
    "body",
    [
        _chat(messages=[{"role": "user", "content": "\U0001f600" * 250}], max_tokens=10),
        json.dumps({"model": "m", "prompt": "\U0001f600" * 250, "max_tokens": 10}).encode(),
    ],
)
def test_the_reservation_holds_whatever_the_tokenizer_makes_of_the_text(body):
    """250 emoji are about 60 tokens by the rule of thumb and up to 1,000 for a byte-level
    tokenizer: admission holds the most they can be, and judges a request by the likely."""
    plan = (plan_chat if b"messages" in body else plan_completion)(body)
    reservation = _reservation(plan, max_context=4096)
    assert reservation.tokens >= 250 * 4 + 10
    assert reservation.likely_tokens < 100


@pytest.mark.parametrize("kind", ["image_url", "input_audio", "file"])
def test_content_a_text_model_cannot_read_is_refused_saying_so(kind):
    """An image part was refused as "Invalid value 'image_url'", which reads as a typo."""
    body = _chat(messages=[{"role": "user", "content": [{"type": kind, kind: {}}]}])
    error = _error(plan_chat, body)
    assert error.param == "messages[0].content[0].type"
    assert f"Content of type '{kind}' is not supported" in error.message
    assert "text" in error.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"structured_outputs": {"choice": [""]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": ["a"] * 2000}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, None),
    ],
)
def test_a_constraint_refused_is_named_as_the_request_gave_it(fields, param):
    """A structured_outputs choice the engine refuses was named response_format, a field the
    request never used."""
    for plan, body in ((plan_chat, _chat(**fields)), (plan_completion, _completion(**fields))):
        if param is None:  # a valid constraint: planned
            plan(body)
            continue
        error = _error(plan, body)
        assert error.param == param and "response_format" not in error.message


def test_more_tools_than_the_engine_takes_are_refused_before_admission():
    """2,000 tools passed the gateway and were refused by the engine, after admission (a
    request counted against the tenant's rate) with no param."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    tools = [{**tool, "function": {**tool["function"], "name": f"f{i}"}} for i in range(2000)]
    error = _error(plan_chat, _chat(tools=tools))
    assert error.param == "tools" and "128" in error.message


def _call(call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "f", "arguments": "{}"}}


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([USER, {"role": "tool", "tool_call_id": "call_1", "content": "x"}], "messages[1]"),
        (
            [
                USER,
                {"role": "assistant", "content": None, "tool_calls": [_call("a")]},
                {"role": "tool", "tool_call_id": "b", "content": "x"},
            ],
            "messages[2].tool_call_id",
        ),
        (
            [
                USER,
                {"role": "assistant", "content": None, "tool_calls": [_call("a")]},
                {"role": "tool", "tool_call_id": "a", "content": "x"},
                {"role": "user", "content": "and?"},
                {"role": "tool", "tool_call_id": "a", "content": "x"},
            ],
            "messages[4]",
        ),
    ],
)
def test_a_tool_message_answers_a_call_of_the_assistant_message_before_it(messages, param):
    """OpenAI's rule: one answering no call was read into the prompt as it came, a turn the
    model's template may not even render."""
    error = _error(plan_chat, _chat(messages=messages))
    assert error.param == param and "tool_calls" in error.message


def test_tool_messages_answering_the_calls_before_them_are_planned():
    messages = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [_call("a"), _call("b")]},
        {"role": "tool", "tool_call_id": "b", "content": "2"},
        {"role": "tool", "tool_call_id": "a", "content": "1"},
    ]
    [request] = plan_chat(_chat(messages=messages)).prompts
    assert [m.tool_call_id for m in request.messages] == [None, None, "b", "a"]
