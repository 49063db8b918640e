"""Tool-offering turns stream live on every family (scripted backend, real socket): prose comes
as the model writes it, a call arrives as several argument deltas that the SDKs' accumulators
join, a refused call is retried before any of it is sent (usage counts both attempts, the reply
says so), keep-alives flow while a call is held, and a call written in reasoning or between
texts keeps its place."""

from __future__ import annotations

import json
import re
import time

import anthropic
import httpx
import ollama
import openai
import trio

from turbospark.model.scripted import ScriptedBackend
from turbospark.turns.guardrails import Guardrails

from ._support import WEATHER, chat_body, sse_events, streamed_call

ANTHROPIC_WEATHER = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
PROSE = "The weather is something I cannot know without looking, but Oslo is often cool and grey in spring."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
WRONG = '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Oslo"}}\n</tool_call>'


class Scripts(ScriptedBackend):
    """One script per generation, in turn (the last repeats): a first answer, then a retry's."""

    def __init__(self, *scripts: str, **kw) -> None:
        super().__init__(script=scripts[0], **kw)
        self._scripts = [self.tokenizer.encode(s) for s in scripts]

    def insert(self, seq, prompt, params):  # type: ignore[no-untyped-def]
        self._script = self._scripts[min(self.counters.generations, len(self._scripts) - 1)]
        return super().insert(seq, prompt, params)


async def _first_content_after(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, float]:
    """Seconds to the first content chunk of a streamed chat, and to the end."""
    t0 = time.monotonic()
    first = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"] \
                    and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                first = time.monotonic() - t0
    assert first is not None
    return first, time.monotonic() - t0


async def test_prose_with_tools_streams_as_soon_as_without(start_server, client) -> None:
    # one prefill step whatever the prompt: the tools' longer prompt costs no more to start
    server = await start_server([ScriptedBackend(script=PROSE, token_delay=0.02, prefill_chunk=4096)])
    with_tools, whole = await _first_content_after(client, server.url, chat_body(stream=True, tools=[WEATHER]))
    without, _ = await _first_content_after(client, server.url, chat_body(stream=True))
    assert with_tools < whole / 3  # not the whole generation first
    assert with_tools < without + 0.25


async def test_the_openai_sdk_joins_a_call_streamed_in_pieces(start_server) -> None:
    server = await start_server([ScriptedBackend(script="Sure. " + CALL + " Asked.")])
    sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x")
    pieces = []
    async with sdk.chat.completions.stream(
        model="scripted", messages=[{"role": "user", "content": "Oslo?"}], tools=[WEATHER]
    ) as stream:
        async for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces.append(event.arguments_delta)
        final = await stream.get_final_completion()
    message = final.choices[0].message
    assert len(pieces) >= 3 and "".join(pieces) == '{"city": "Oslo"}'
    assert message.content == "Sure.  Asked." and final.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    assert call.id.startswith("call_") and json.loads(call.function.arguments) == {"city": "Oslo"}
    await sdk.close()


async def test_the_anthropic_sdk_joins_input_json_deltas_in_text_call_text_order(start_server) -> None:
    server = await start_server([ScriptedBackend(script="Checking. " + CALL + " Done.")])
    sdk = anthropic.AsyncAnthropic(base_url=server.url, api_key="x")
    kinds = []
    async with sdk.messages.stream(
        model="claude-x", max_tokens=200, tools=[ANTHROPIC_WEATHER],
        messages=[{"role": "user", "content": "Oslo?"}],
    ) as stream:
        async for event in stream:
            if event.type == "content_block_delta":
                kinds.append(event.delta.type)
        final = await stream.get_final_message()
    assert kinds.count("input_json_delta") >= 3
    assert [b.type for b in final.content] == ["text", "tool_use", "text"]
    assert final.content[1].input == {"city": "Oslo"} and final.stop_reason == "tool_use"
    whole = await sdk.messages.create(model="claude-x", max_tokens=200, tools=[ANTHROPIC_WEATHER],
                                      messages=[{"role": "user", "content": "Oslo?"}])
    assert [b.type for b in whole.content] == ["text", "tool_use", "text"]
    await sdk.close()


async def test_the_ollama_client_gets_prose_live_and_the_call_whole(start_server) -> None:
    server = await start_server([ScriptedBackend(script="Sure. " + CALL)])
    sdk = ollama.AsyncClient(host=server.url)
    parts = [p async for p in await sdk.chat(model="scripted", messages=[{"role": "user", "content": "Oslo?"}],
                                                 tools=[WEATHER], stream=True)]
    assert "".join(p.message.content or "" for p in parts) == "Sure. "
    calls = [c for p in parts for c in p.message.tool_calls or ()]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert parts[-1].done


async def test_a_refused_call_is_retried_unseen_and_usage_counts_both(start_server, client) -> None:
    backend = Scripts("Let me look. " + WRONG, CALL)
    server = await start_server([backend])
    body = chat_body(tools=[WEATHER], stream=True, stream_options={"include_usage": True})
    frames = sse_events((await client.post(f"{server.url}/v1/chat/completions", json=body)).text)
    chunks = [json.loads(d) for _, d in frames[:-1]]
    text = json.dumps(chunks)
    assert "town" not in text  # nothing of the refused call was sent
    arguments = "".join(
        c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
        for c in chunks if c["choices"] and "tool_calls" in c["choices"][0]["delta"]
    )
    assert json.loads(arguments) == {"city": "Oslo"}
    usage = chunks[-1]["usage"]
    assert usage["retries"] == 1 and backend.counters.generations == 2
    first, second = (len(backend.tokenizer.encode(s)) + 1 for s in ("Let me look. " + WRONG, CALL))
    assert usage["completion_tokens"] == first + second  # every token generated, the retry's included
    server = await start_server([Scripts(WRONG, CALL)])
    r = await client.post(f"{server.url}/v1/chat/completions", json=chat_body(tools=[WEATHER]))
    assert r.headers["x-turbospark-retries"] == "1" and r.json()["usage"]["retries"] == 1


async def test_keepalives_flow_while_a_call_is_held(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script=CALL, token_delay=0.05)], keepalive_interval=0.2)
    async with client.stream("POST", f"{server.url}/v1/chat/completions",
                             json=chat_body(tools=[WEATHER], stream=True)) as r:
        raw = (await r.aread()).decode()
    assert raw.count(": keepalive") >= 2  # the call took about a second to write
    assert '"get_weather"' in raw


async def test_a_call_written_in_reasoning_is_kept_in_its_place(start_server, client) -> None:
    script = "<think>I should look it up. " + CALL + " Then answer.</think>It is cool."
    server = await start_server([ScriptedBackend(script=script)])
    r = await client.post(f"{server.url}/v1/messages", json={
        "model": "claude-x", "max_tokens": 200, "tools": [ANTHROPIC_WEATHER],
        "messages": [{"role": "user", "content": "Oslo?"}]})
    blocks = r.json()["content"]
    assert [b["type"] for b in blocks] == ["thinking", "tool_use", "thinking", "text"]
    assert blocks[1]["input"] == {"city": "Oslo"}
    r = await client.post(f"{server.url}/v1/responses", json={
        "model": "scripted", "input": "Oslo?", "tools": [{"type": "function", **WEATHER["function"]}]})
    assert [i["type"] for i in r.json()["output"]] == ["reasoning", "function_call", "reasoning", "message"]
    r = await client.post(f"{server.url}/v1/chat/completions", json=chat_body(tools=[WEATHER]))
    message = r.json()["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "get_weather" and message["content"] == "It is cool."


async def test_guardrails_off_a_native_call_still_streams_in_pieces(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script=CALL)], guardrails=Guardrails.off())
    frames = sse_events((await client.post(f"{server.url}/v1/responses", json={
        "model": "scripted", "input": "Oslo?", "stream": True,
        "tools": [{"type": "function", **WEATHER["function"]}]})).text)
    names = [n for n, _ in frames]
    assert names.count("response.function_call_arguments.delta") >= 3
    with trio.fail_after(5):
        done = json.loads(frames[-1][1])
    assert done["response"]["output"][0]["arguments"] == '{"city": "Oslo"}'


class _ReadThenAnswer(ScriptedBackend):
    """Claude Code's own ``Read`` tool on a file, then, once the file's words are in the
    conversation (the tool ran), an answer quoting them."""

    def __init__(self, path: str, secret: str) -> None:
        super().__init__(context_window=400_000, prefill_chunk=4096)
        call = json.dumps({"name": "Read", "arguments": {"file_path": path}})
        self._call = self.tokenizer.encode(f"I will read it.<tool_call>\n{call}\n</tool_call>")
        self._answer = self.tokenizer.encode(f"The file says {secret}.")
        self.secret = secret

    def insert(self, seq, prompt, params):  # type: ignore[no-untyped-def]
        self._script = self._answer if self.secret in self.tokenizer.decode(prompt) else self._call
        return super().insert(seq, prompt, params)


async def test_claude_code_runs_its_tool_and_prints_the_answer(start_server, tmp_path) -> None:
    from .claude_code import run_claude

    secret = "zebra-quartz-17"
    note = tmp_path / "note.txt"
    note.write_text(f"{secret}\n")
    backend = _ReadThenAnswer(str(note), secret)
    server = await start_server([backend])
    out = await run_claude(server.url, f"What does {note} say?", tools="Read",
                           extra=("--allowedTools", "Read", "--add-dir", str(tmp_path)))
    assert f"The file says {secret}." in out
    assert backend.counters.generations >= 2  # the call, then the answer with the tool's result


async def test_the_openai_agents_sdk_runs_a_tool_from_a_streamed_call(start_server) -> None:
    """The Agents SDK, streaming, on chat completions and on Responses: it joins the call's
    argument deltas, runs the function and answers with its result."""
    import asyncio

    import pytest

    agents = pytest.importorskip("agents")
    ran: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        ran.append(city)
        return f"{city}: 12 degrees and cloudy"

    class WeatherThenAnswer(ScriptedBackend):
        def insert(self, seq, prompt, params):  # type: ignore[no-untyped-def]
            answered = "12 degrees and cloudy" in self.tokenizer.decode(prompt)
            self._script = self.tokenizer.encode("It is 12 degrees in Oslo." if answered else "Checking. " + CALL)
            return super().insert(seq, prompt, params)

    server = await start_server([WeatherThenAnswer(context_window=32_000, prefill_chunk=4096)])

    def run(api: str) -> str:
        async def go() -> str:
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x")
            model = (agents.OpenAIChatCompletionsModel if api == "chat" else agents.OpenAIResponsesModel)(
                model="scripted", openai_client=client)
            agent = agents.Agent(name="weather", instructions="Be brief.", tools=[get_weather], model=model)
            result = agents.Runner.run_streamed(agent, "What is the weather in Oslo?")
            async for _ in result.stream_events():
                pass
            await client.close()
            return str(result.final_output)

        agents.set_tracing_disabled(True)
        return asyncio.run(go())

    for api in ("chat", "responses"):
        answer = await trio.to_thread.run_sync(run, api)
        assert answer == "It is 12 degrees in Oslo." and ran[-1] == "Oslo", api
    assert len(ran) == 2


async def test_a_client_that_leaves_while_a_call_is_held_stops_it_within_a_step(start_server) -> None:
    from turbospark.messages import Generated

    from ._support import raw_post, read_until, wait_for

    long_call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + "Oslo " * 200 + '"}}\n</tool_call>'
    backend = ScriptedBackend(script="Sure. " + long_call, token_delay=0.01)
    server = await start_server([backend])
    events = server.system.subscribe()
    sock = await raw_post(server.url, "/v1/chat/completions", chat_body(tools=[WEATHER], stream=True))
    await read_until(sock, b'"content":"Sure')
    await wait_for(lambda: backend.counters.decode_steps >= 20)  # inside the call, held back
    at_close = backend.counters.decode_steps
    await sock.aclose()
    with trio.fail_after(10):
        async for event in events:
            if isinstance(event, Generated):
                break
    assert event.stop_reason == "Cancelled" and backend.counters.decode_steps - at_close <= 2


async def test_with_the_guardrails_off_a_call_streams_while_it_is_written(start_server) -> None:
    """Nothing must be checked first: the call's first argument delta leaves while the model is
    still writing it, and the deltas, one per token or so, join to the arguments."""
    from ._support import raw_post, read_until

    city = "Oslo " * 100
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + city + '"}}\n</tool_call>'
    backend = ScriptedBackend(script="Sure. " + call, token_delay=0.01)
    server = await start_server([backend], guardrails=Guardrails.off())
    written = len(backend.tokenizer.encode("Sure. " + call))
    sock = await raw_post(server.url, "/v1/chat/completions", chat_body(tools=[WEATHER], stream=True))
    raw = await read_until(sock, b'"arguments":"{')
    assert backend.counters.decode_steps < written - 50  # the call is far from written
    raw += await read_until(sock, b"[DONE]", timeout=30)
    await sock.aclose()
    chunks = [json.loads(d) for d in re.findall(rb"^data: (\{.*\})\r?$", raw, re.M)]
    deltas = [c["delta"]["tool_calls"][0]["function"]["arguments"]
              for chunk in chunks for c in chunk["choices"] if c["delta"].get("tool_calls")]
    assert len(deltas) > 50  # token by token, not cut at the object's top level
    assert json.loads("".join(deltas)) == {"city": city}


async def test_a_forced_call_streams_token_by_token_and_the_sdk_joins_it(start_server) -> None:
    from turbospark.turns.turn_events import split_arguments

    compact = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'
    server = await start_server([ScriptedBackend(script=compact)])
    sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x")
    pieces, final = await streamed_call(sdk, model="scripted", messages=[{"role": "user", "content": "Oslo?"}],
                                        tools=[WEATHER], tool_choice="required")
    (call,) = final.choices[0].message.tool_calls
    assert "".join(pieces) == call.function.arguments == '{"city":"Oslo"}'
    assert len(pieces) > len(split_arguments(call.function.arguments))  # as written, not split once complete
    assert final.choices[0].finish_reason == "tool_calls"
    await sdk.close()
