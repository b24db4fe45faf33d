"""Structured outputs and tool calling through the official openai SDK against a live Daphne
and engine (a tiny random llama): the grammar makes its output parse whatever it would say."""

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.gateway.conftest import MODEL_NAME
from tests.inference_engine.conftest import build_tokenizer

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["unit", "days"],
            "additionalProperties": False,
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {"exact": {"type": "boolean"}},
            "required": ["exact"],
        },
    },
}


class Weather(BaseModel):
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)
    raining: bool


def closing_bias() -> dict[str, int]:
    """Pushes the random model towards the tokens that end JSON values (and EOS), so its
    numbers and strings end within the budget; the grammar alone makes the output parse."""
    tokenizer = build_tokenizer()
    closers = set('"}],')
    bias = {str(i): 6 for i in range(len(tokenizer)) if closers & set(tokenizer.decode([i]))}
    return bias | {"0": 6}


def test_parse_with_a_pydantic_model_gives_a_valid_instance(platform):
    client = platform.client()
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=MODEL_NAME,
            messages=MESSAGES,
            response_format=Weather,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
            logit_bias=closing_bias(),
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Weather)


def test_json_object_on_chat_and_completions_streaming_or_not(platform):
    client = platform.client()
    common = dict(model=MODEL_NAME, max_tokens=200, logit_bias=closing_bias(), seed=5)
    chat = client.chat.completions.create(
        messages=MESSAGES, response_format={"type": "json_object"}, **common
    )
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    stream = client.chat.completions.create(
        messages=MESSAGES, response_format={"type": "json_object"}, stream=True, **common
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content
    completion = client.completions.create(
        prompt="hello world", extra_body={"response_format": {"type": "json_object"}}, **common
    )
    assert isinstance(json.loads(completion.choices[0].text), dict)


def test_a_named_tool_call_round_trip(platform):
    """The assistant's call, the tool's result, then the answer: the conversation with both
    turns is accepted."""
    client = platform.client()
    messages = [{"role": "user", "content": "weather in Paris?"}]
    first = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        tools=[WEATHER_TOOL, SEARCH_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=100,
        logit_bias=closing_bias(),
    )
    choice = first.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's and vLLM's for a named call
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert arguments["unit"] in ("celsius", "fahrenheit") and 1 <= arguments["days"] <= 7
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"})
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=8
    )
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert answer.choices[0].message.tool_calls is None
    # the tiny model's template writes calls in no format the API reads: "auto" (the default
    # with tools) is refused, as vLLM refuses it, not answered with its calls as text
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL_NAME, messages=messages, tools=[WEATHER_TOOL], max_tokens=8
        )
    assert refused.value.body["param"] == "tool_choice"
    assert "not supported for this model" in refused.value.body["message"]


@pytest.mark.parametrize(
    ("tool_choice", "parallel"),
    [({"type": "function", "function": {"name": "search"}}, None), ("required", False)],
)
def test_streamed_tool_calls_are_reassembled_by_the_sdk(platform, tool_choice, parallel):
    client = platform.client()
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    with client.chat.completions.stream(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=[WEATHER_TOOL, SEARCH_TOOL],
        tool_choice=tool_choice,
        max_tokens=100,
        logit_bias=closing_bias(),
        **extra,
    ) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    # OpenAI's and vLLM's: "tool_calls" for a required call, "stop" for a named one
    assert choice.finish_reason == ("stop" if isinstance(tool_choice, dict) else "tool_calls")
    assert choice.message.content is None  # as unstreamed (it was "")
    calls = choice.message.tool_calls
    assert len(calls) == 1  # named, or required without parallel calls
    assert calls[0].function.name in ("get_weather", "search")
    json.loads(calls[0].function.arguments)
    if isinstance(tool_choice, dict):
        assert calls[0].function.name == "search"


def test_required_with_parallel_calls_gives_one_call_per_item(platform):
    completion = platform.client().chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=[WEATHER_TOOL, SEARCH_TOOL],
        tool_choice="required",
        max_tokens=200,
        logit_bias=closing_bias(),
        seed=11,
    )
    calls = completion.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "search") for c in calls)
    assert len({c.id for c in calls}) == len(calls)
    for call in calls:
        assert isinstance(json.loads(call.function.arguments), dict)


def test_empty_tools_and_the_ignored_fields_are_accepted(platform):
    completion = platform.client().chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=[],
        max_tokens=4,
        seed=3,
        service_tier="auto",
        store=False,
        user="end-user-42",
        metadata={"experiment": "a"},
        parallel_tool_calls=None,
    )
    assert completion.choices[0].message.content
    [record] = platform.records()
    assert record.end_user == "end-user-42"
    assert record.metadata == {"experiment": "a"}


def test_logit_bias_through_the_api_forces_a_token(platform):
    tokenizer = build_tokenizer()
    completion = platform.client().completions.create(
        model=MODEL_NAME, prompt="hello", max_tokens=4, temperature=0, logit_bias={"42": 100}
    )
    assert completion.choices[0].text == tokenizer.decode([42] * 4)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
                "tools": [WEATHER_TOOL],
            },
            "tool_choice",
            "nope",
        ),
        ({"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
        ({"response_format": {"type": "xml"}}, "response_format.type", ""),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", ""),
        ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias", ""),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "16"),
        ({"functions": []}, "functions", ""),
        (
            {
                "response_format": {"type": "json_object"},
                "tools": [WEATHER_TOOL],
                "tool_choice": "required",
            },
            "tool_choice",
            "only one of",
        ),
        (
            {"messages": [{"role": "tool", "content": "x"}]},
            "messages[0]",
            "tool_call_id",
        ),
    ],
)
def test_bad_structured_requests_are_a_400_naming_the_field(platform, body, param, message):
    payload = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **body}
    response = httpx.post(
        f"{platform.base}/v1/chat/completions",
        json=payload,
        headers={"Authorization": f"Bearer {platform.key}"},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert message in error["message"]


def test_a_schema_the_engine_cannot_compile_is_a_400_naming_the_problem(platform):
    client = platform.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "nonsense"}},
            },
        )
    assert 'Unsupported type "nonsense"' in caught.value.message
    # the field the client sent, not the engine's (it was param null, "structured_outputs")
    assert caught.value.body["param"] == "response_format"
    assert caught.value.body["message"].startswith("response_format.json cannot be compiled")
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=4, tools=[bad_tool],
            tool_choice="required",
        )  # fmt: skip
    assert caught.value.body["param"] == "tools"
    # the platform keeps serving
    assert client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)
    assert [r.status for r in platform.records()] == ["rejected", "rejected", "ok"]


class Address(BaseModel):
    city: Literal["Paris", "Oslo"]
    floor: int = Field(ge=0, le=9)


class Delivery(BaseModel):
    """A tool whose parameters hold a nested model: pydantic writes it under ``$defs``."""

    to: Address
    express: bool


def test_a_required_call_to_a_tool_with_nested_models_is_made(platform):
    """Inside the array of calls, the tool's "#/$defs/Address" pointed at nothing: the
    grammar did not compile, and the request was a 400."""
    tool = openai.pydantic_function_tool(Delivery)
    assert "$defs" in json.dumps(tool)
    completion = platform.client().chat.completions.parse(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=[tool],
        tool_choice="required",
        max_tokens=200,
        logit_bias=closing_bias(),
        seed=5,
    )
    [call] = completion.choices[0].message.tool_calls[:1]
    assert isinstance(call.function.parsed_arguments, Delivery)


def test_a_message_the_sdk_gave_goes_back_as_it_is(platform):
    """The usual loop appends the SDK's message to the conversation: what the SDK adds to it
    (``parsed``, ``annotations``, ``audio``, ``function_call``) was refused as unknown."""
    client = platform.client()
    first = client.chat.completions.parse(
        model=MODEL_NAME,
        messages=MESSAGES,
        response_format=Weather,
        max_tokens=60,
        logit_bias=closing_bias(),
        seed=7,
    )
    message = first.choices[0].message
    conversation = [
        {"role": "developer", "content": "Answer briefly."},  # OpenAI's name for system
        *MESSAGES,
        message,
        {"role": "user", "content": "and tomorrow?"},
        {"role": "assistant", "content": "x", "audio": None, "function_call": None},
        {"role": "user", "content": "thanks"},
    ]
    second = client.chat.completions.create(model=MODEL_NAME, messages=conversation, max_tokens=3)
    assert second.choices[0].message.content is not None
