"""End-to-end check of the Tandem server with the official `openai` client.

Run by the Rust test `official_openai_client_end_to_end` (tests/server.rs),
which starts `tandem serve --embedded test` and passes its address:

    python3 tests/openai_client.py http://127.0.0.1:PORT/v1 API_KEY

Checks streaming and non-streaming chat and completions: the text (greedy,
so streamed == whole), finish_reason and usage; `n` = 2. Exits non-zero with the
reason on the first failed check; prints "openai client: N checks passed".
"""

import sys

import openai

CHECKS = 0


def check(cond, what):
    global CHECKS
    if not cond:
        raise AssertionError(what)
    CHECKS += 1


def main(base_url, api_key):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30)

    models = client.models.list()
    model = models.data[0].id
    check(model == "tandem-tiny-test", f"model id: {model}")
    card = client.models.retrieve(model)
    check(card.id == model and card.object == "model", f"models.retrieve: {card}")
    try:
        client.models.retrieve("no-such-model")
        check(False, "an unknown model must be a 404")
    except openai.NotFoundError as e:
        check(e.status_code == 404, f"status {e.status_code}")

    # Chat, whole.
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
    ]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0
    )
    text = chat.choices[0].message.content
    check(chat.object == "chat.completion", chat.object)
    check(chat.choices[0].message.role == "assistant", "role")
    check(isinstance(text, str) and len(text) > 0, f"chat text: {text!r}")
    check(chat.choices[0].finish_reason == "length", chat.choices[0].finish_reason)
    check(chat.usage.completion_tokens == 12, f"usage: {chat.usage}")
    check(chat.usage.prompt_tokens > 0, f"usage: {chat.usage}")
    check(
        chat.usage.total_tokens == chat.usage.prompt_tokens + 12, f"usage: {chat.usage}"
    )

    # Chat, streamed with usage: same text, same usage.
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                parts.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    check("".join(parts) == text, f"streamed chat text {''.join(parts)!r} != {text!r}")
    check(finish == "length", f"streamed finish_reason: {finish}")
    check(usage is not None and usage.completion_tokens == 12, f"streamed usage: {usage}")
    check(usage.prompt_tokens == chat.usage.prompt_tokens, "streamed prompt_tokens")

    # Chat with logprobs.
    lp = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2,
    )
    content = lp.choices[0].logprobs.content
    check(len(content) == 4, f"logprobs entries: {len(content)}")
    check(all(len(c.top_logprobs) == 2 for c in content), "top_logprobs per token")
    check(all(c.logprob <= 0 for c in content), "logprobs are <= 0")

    # Completions, whole and streamed.
    comp = client.completions.create(
        model=model, prompt="the quick brown fox", max_tokens=10, temperature=0
    )
    ctext = comp.choices[0].text
    check(len(ctext) > 0, "completion text")
    check(comp.choices[0].finish_reason == "length", comp.choices[0].finish_reason)
    check(comp.usage.completion_tokens == 10, f"usage: {comp.usage}")
    stream = client.completions.create(
        model=model,
        prompt="the quick brown fox",
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.text)
            if choice.finish_reason:
                finish = choice.finish_reason
    check("".join(parts) == ctext, f"streamed completion {''.join(parts)!r} != {ctext!r}")
    check(finish == "length", f"streamed finish_reason: {finish}")
    check(usage is not None and usage.completion_tokens == 10, f"streamed usage: {usage}")

    # n = 2: two indexed choices, each one's own finish; streamed, the
    # chunks of both interleave and join to the same texts.
    two = client.completions.create(
        model=model, prompt="the quick brown fox", max_tokens=6, temperature=1.0, seed=3, n=2
    )
    check([c.index for c in two.choices] == [0, 1], f"n=2 indices: {two.choices}")
    check(all(c.finish_reason == "length" for c in two.choices), "n=2 finish_reason")
    check(two.usage.completion_tokens == 12, f"n=2 usage: {two.usage}")
    stream = client.completions.create(
        model=model, prompt="the quick brown fox", max_tokens=6, temperature=1.0, seed=3, n=2,
        stream=True,
    )
    texts, finishes = ["", ""], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    check(texts == [c.text for c in two.choices], f"n=2 streamed {texts}")
    check(finishes == ["length", "length"], f"n=2 streamed finishes {finishes}")
    chats = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, n=2
    )
    check(
        [c.message.content for c in chats.choices] == [chats.choices[0].message.content] * 2,
        "greedy chat n=2 gives the same answer twice",
    )

    # Stop strings end the text with finish_reason "stop".
    words = ctext.split(" ")
    if len(words) > 3:
        stop = " " + words[2]
        stopped = client.completions.create(
            model=model, prompt="the quick brown fox", max_tokens=10, temperature=0, stop=[stop]
        )
        check(stopped.choices[0].text == ctext[: ctext.index(stop)], "stop string cut")
        check(stopped.choices[0].finish_reason == "stop", "finish_reason stop")

    # Errors surface as the client's typed exceptions.
    try:
        client.completions.create(model=model, prompt="x", max_tokens=5, temperature=9)
        check(False, "temperature 9 must be refused")
    except openai.BadRequestError as e:
        check(e.status_code == 400, f"status {e.status_code}")
        check("temperature" in str(e), f"message names the field: {e}")

    bad = openai.OpenAI(base_url=base_url, api_key="wrong-key", max_retries=0)
    try:
        bad.models.list()
        check(False, "a wrong key must be refused")
    except openai.AuthenticationError as e:
        check(e.status_code == 401, f"status {e.status_code}")

    print(f"openai client: {CHECKS} checks passed")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: openai_client.py BASE_URL API_KEY")
    main(sys.argv[1], sys.argv[2])
