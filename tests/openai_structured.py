"""Structured output and tool calling through the official `openai` client.

Run by the Rust test `official_openai_client_structured_output`
(tests/server_support/binary.rs) against `tandem serve` (the embedded test
model, and SmolLM2 when ../shared has it):

    python3 tests/openai_structured.py http://127.0.0.1:PORT/v1 KIND

KIND is `embedded` or `smollm2` (which schema and prompts suit the model).
Checks `client.chat.completions.parse(..., response_format=PydanticModel)`,
a tool-call round trip (call -> tool result -> final answer) with a
function schema, and streamed tool-call deltas that reassemble into valid
arguments. Exits non-zero with the reason on the first failed check.
"""

import json
import sys
from typing import Literal

import openai
import pydantic

CHECKS = 0


def check(cond, what):
    global CHECKS
    if not cond:
        raise AssertionError(what)
    CHECKS += 1


class Embedded(pydantic.BaseModel):
    """Bounded fields: a random model closes the document well inside the limit."""

    ok: bool
    colour: Literal["red", "green", "blue"]
    score: int = pydantic.Field(ge=0, le=100)
    tag: str = pydantic.Field(max_length=8)


class City(pydantic.BaseModel):
    """Bounded fields too: unbounded, the real model's greedy number can
    repeat a digit until max_tokens (tests/server_support/grammar.rs)."""

    city: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    population_millions: int = pydantic.Field(ge=0, le=100)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def check_arguments(arguments):
    args = json.loads(arguments)
    check(isinstance(args.get("city"), str) and len(args["city"]) <= 20, f"city: {args}")
    check(args.get("unit") in ("celsius", "fahrenheit"), f"unit: {args}")
    check(set(args) == {"city", "unit"}, f"keys: {args}")


def main(base_url, kind):
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    # parse() with a Pydantic model: the answer parses and validates.
    schema_model = Embedded if kind == "embedded" else City
    question = (
        "Answer in JSON."
        if kind == "embedded"
        else "Describe Paris as JSON with city, country and population_millions."
    )
    for temperature in (0, 0.8):
        parsed = client.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": question}],
            response_format=schema_model,
            max_tokens=120,
            temperature=temperature,
            seed=7,
        )
        choice = parsed.choices[0]
        check(choice.finish_reason == "stop", f"parse finish_reason: {choice.finish_reason}")
        check(isinstance(choice.message.parsed, schema_model), f"parsed: {choice.message}")
        check(parsed.system_fingerprint, "system_fingerprint")

    # Tool calling: a required call, the tool's result, the final answer.
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    )
    choice = first.choices[0]
    check(choice.finish_reason == "tool_calls", f"finish_reason: {choice.finish_reason}")
    calls = choice.message.tool_calls
    check(calls and calls[0].function.name == "get_weather", f"tool_calls: {calls}")
    check_arguments(calls[0].function.arguments)
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append(
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temperature": 18, "sky": "clear"}'}
    )
    final = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="none",
        max_tokens=24,
        temperature=0,
    )
    answer = final.choices[0].message
    check(answer.tool_calls is None, f"no calls after tool_choice none: {answer}")
    check(isinstance(answer.content, str) and answer.content, f"final answer: {answer}")

    # A named function, streamed: the deltas reassemble into valid arguments.
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Weather in Oslo, please."}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
        temperature=0.7,
        seed=3,
        stream=True,
    )
    by_index, finish = {}, None
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                entry = by_index.setdefault(d.index, {"name": "", "arguments": "", "id": None})
                if d.id:
                    entry["id"] = d.id
                if d.function and d.function.name:
                    entry["name"] += d.function.name
                if d.function and d.function.arguments:
                    entry["arguments"] += d.function.arguments
            if c.finish_reason:
                finish = c.finish_reason
    check(finish == "tool_calls", f"streamed finish_reason: {finish}")
    check(len(by_index) == 1, f"one streamed call: {by_index}")
    call = by_index[0]
    check(call["name"] == "get_weather" and call["id"], f"streamed call: {call}")
    check_arguments(call["arguments"])

    # Bad input is a 400 naming the field.
    for kwargs, param in [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, "response_format"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ]:
        try:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **kwargs
            )
            check(False, f"{kwargs} must be refused")
        except openai.BadRequestError as e:
            body = e.body if isinstance(e.body, dict) and "param" in e.body else (e.body or {}).get("error", {})
            check(body.get("param") == param, f"{kwargs}: {e.body}")
    print(f"openai structured ({kind}): {CHECKS} checks passed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
