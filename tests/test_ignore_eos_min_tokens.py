"""``ignore_eos`` (vLLM's, llama.cpp's) and ``min_tokens`` (vLLM's), as benchmark clients send
them, on the scripted backend: the end of the turn held back, stop strings under ``min_tokens``,
a grammar's end, the checks, and the families that have no such field.  The real model's side is
in ``test_mlx_ignore_eos.py``; the pieces without a server are at the end."""

from __future__ import annotations

import json

import openai
import pytest

from turbospark.model.backend import SamplingParams
from turbospark.model.output import OutputParser
from turbospark.model.scripted import ENDLESS_TEXT, ScriptedBackend, shipped_tokenizer
from turbospark.model.sequence import SequenceState
from turbospark.model.stops import StopMatcher

from ._support import chat_body, sse_events

TOK = shipped_tokenizer()
ENDLESS = TOK.encode(ENDLESS_TEXT)
SCRIPT = "Hi there."
SCRIPTED = len(TOK.encode(SCRIPT))  # its tokens; the end of turn comes after them
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def _text(data: dict) -> str:
    choice = data["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _body(path: str, **extra: object) -> dict:
    return chat_body(**extra) if path == CHAT else {"prompt": "Hello", **extra}


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_ignore_eos_runs_to_the_budget_past_the_end_of_turn(start_server, client, path) -> None:
    server = await start_server([ScriptedBackend(script=SCRIPT)])
    alone = (await client.post(f"{server.url}{path}", json=_body(path, max_tokens=20))).json()
    assert _text(alone) == SCRIPT and alone["choices"][0]["finish_reason"] == "stop"
    assert alone["usage"]["completion_tokens"] == SCRIPTED + 1
    r = await client.post(f"{server.url}{path}", json=_body(path, max_tokens=20, ignore_eos=True))
    data = r.json()
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 20
    # where its end would have come, the endless text goes on
    assert _text(data) == SCRIPT + TOK.decode(ENDLESS[: 20 - SCRIPTED])


async def test_ignore_eos_streams_to_the_budget_for_every_choice(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script=SCRIPT)])
    body = chat_body(max_tokens=12, n=2, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    frames = [json.loads(d) for _, d in sse_events((await client.post(f"{server.url}{CHAT}", json=body)).text)[:-1]]
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in frames
                if c["choices"] and c["choices"][0]["finish_reason"]}
    assert finishes == {0: "length", 1: "length"}
    assert frames[-1]["usage"]["completion_tokens"] == 24


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_min_tokens_holds_the_end_until_it_is_reached(start_server, client, path) -> None:
    server = await start_server([ScriptedBackend(script=SCRIPT)])
    r = await client.post(f"{server.url}{path}", json=_body(path, max_tokens=40, min_tokens=SCRIPTED + 5))
    data = r.json()
    # the end comes as the first token it may be: after exactly min_tokens others
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["usage"]["completion_tokens"] == SCRIPTED + 5 + 1
    assert _text(data) == SCRIPT + TOK.decode(ENDLESS[:5])
    # a minimum the answer already reaches changes nothing
    r = await client.post(f"{server.url}{path}", json=_body(path, max_tokens=40, min_tokens=SCRIPTED))
    assert _text(r.json()) == SCRIPT and r.json()["usage"]["completion_tokens"] == SCRIPTED + 1


async def test_min_tokens_grows_a_default_budget(start_server, client) -> None:
    server = await start_server()  # the endless text: only the budget ends it
    r = await client.post(f"{server.url}{COMPLETIONS}", json={"prompt": "Hello", "min_tokens": 20})
    assert r.json()["usage"]["completion_tokens"] == 20  # 16 without it (OpenAI's default)


async def test_stop_strings_count_only_from_min_tokens_on(start_server, client) -> None:
    server = await start_server()
    first = ENDLESS_TEXT.index("quick")  # "The quick", in the first two tokens
    r = await client.post(f"{server.url}{CHAT}", json=chat_body(max_tokens=60, stop=["quick"]))
    assert _text(r.json()) == ENDLESS_TEXT[:first]
    r = await client.post(f"{server.url}{CHAT}", json=chat_body(max_tokens=60, stop=["quick"], min_tokens=5))
    data = r.json()
    # the first "quick" is shown as text; the next one ("How vexingly quick") stops it
    assert _text(data) == ENDLESS_TEXT[: ENDLESS_TEXT.index("quick", first + 1)]
    assert data["choices"][0]["finish_reason"] == "stop"


async def test_stop_strings_still_end_an_ignore_eos_turn(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script=SCRIPT)])
    r = await client.post(f"{server.url}{CHAT}", json=chat_body(max_tokens=60, ignore_eos=True, stop=["brown"]))
    data = r.json()
    assert _text(data) == SCRIPT + ENDLESS_TEXT[: ENDLESS_TEXT.index("brown")]
    assert data["choices"][0]["finish_reason"] == "stop"


async def test_a_grammar_ends_where_it_must_whatever_ignore_eos_says(start_server, client) -> None:
    server = await start_server()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    r = await client.post(f"{server.url}{CHAT}", json=chat_body(max_tokens=50, ignore_eos=True, response_format=fmt))
    data = r.json()
    assert data["choices"][0]["finish_reason"] == "stop"  # the closed object allows only its end
    assert json.loads(_text(data)) == {"a": 0}


async def test_min_tokens_keeps_a_grammar_that_may_end_going(start_server, client) -> None:
    server = await start_server()
    regex = {"structured_outputs": {"regex": "[a-z]+"}}
    alone = (await client.post(f"{server.url}{COMPLETIONS}", json={"prompt": "Hi", "max_tokens": 30, **regex})).json()
    assert alone["usage"]["completion_tokens"] == 2  # a letter, then the end it may take
    r = await client.post(f"{server.url}{COMPLETIONS}",
                          json={"prompt": "Hi", "max_tokens": 30, "min_tokens": 6, **regex})
    data = r.json()
    assert data["usage"]["completion_tokens"] == 7 and data["choices"][0]["finish_reason"] == "stop"
    assert _text(data).isalpha() and _text(data).islower()


BAD = [
    ({"ignore_eos": "yes"}, "body.ignore_eos"),
    ({"ignore_eos": 1}, "body.ignore_eos"),
    ({"ignore_eos": None}, "body.ignore_eos"),
    ({"min_tokens": -1}, "min_tokens must be between 0 and"),
    ({"min_tokens": 2.5}, "body.min_tokens"),
    ({"min_tokens": "5"}, "body.min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens (9) must not exceed max_tokens (8)"),
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("extra", "needle"), BAD)
async def test_bad_values_are_an_openai_400_naming_the_field(start_server, client, path, extra, needle) -> None:
    server = await start_server()
    r = await client.post(f"{server.url}{path}", json=_body(path, **extra))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and needle in error["message"]
    if "max_tokens" in extra:
        assert error["param"] == "min_tokens"


async def test_min_tokens_over_max_completion_tokens_names_it(start_server, client) -> None:
    server = await start_server()
    r = await client.post(f"{server.url}{CHAT}", json=chat_body(min_tokens=9, max_completion_tokens=8))
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "min_tokens (9) must not exceed max_completion_tokens (8)"


async def test_families_without_such_fields_refuse_them_by_name(start_server, client) -> None:
    """The Responses and Messages APIs have no such field, nor Ollama's options: each is refused
    as unknown, as any misspelling is, never silently ignored."""
    server = await start_server()
    r = await client.post(f"{server.url}/v1/responses", json={"input": "Hi", "ignore_eos": True})
    assert r.status_code == 400 and "unknown field(s) ignore_eos" in r.json()["error"]["message"]
    messages = {"model": "claude-sonnet-4-6", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    r = await client.post(f"{server.url}/v1/messages", json=messages | {"min_tokens": 4})
    assert r.status_code == 400 and "unknown field(s) min_tokens" in r.json()["error"]["message"]
    for option in ("ignore_eos", "min_tokens"):
        r = await client.post(f"{server.url}/api/chat", json={
            "model": "scripted", "stream": False, "messages": [{"role": "user", "content": "Hi"}],
            "options": {option: 1}})
        assert r.status_code == 400 and r.json() == {"error": f"unknown option(s) {option}"}


async def test_the_openai_sdk_sends_them_in_extra_body(start_server) -> None:
    server = await start_server([ScriptedBackend(script=SCRIPT)])
    sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    r = await sdk.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=16, extra_body={"ignore_eos": True, "min_tokens": 5})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16
    c = await sdk.completions.create(model="scripted", prompt="Hi", max_tokens=30,
                                     extra_body={"min_tokens": SCRIPTED + 3})
    assert c.choices[0].finish_reason == "stop" and c.usage.completion_tokens == SCRIPTED + 4
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        await sdk.completions.create(model="scripted", prompt="Hi", max_tokens=4, extra_body={"min_tokens": 5})


# --- the pieces, without a server ------------------------------------------------------------


def test_an_unarmed_stop_matcher_holds_back_but_matches_nothing() -> None:
    m = StopMatcher(["END"])
    assert m.feed("a END b E", armed=False) == "a END b "  # shown: fed before min_tokens
    assert m.matched is None
    assert m.feed("ND", armed=True) == ""  # begun unarmed, completed armed: it counts
    assert m.matched == "END"
    m = StopMatcher(["ab", "abc"])
    assert m.feed("xab", armed=False) == "x"  # "ab" whole but unarmed; held as "abc" may follow
    assert m.feed("d", armed=True) == "abd" and m.matched is None  # whole before arming: never


def test_a_sequence_state_ends_on_a_stop_string_from_min_tokens_on() -> None:
    tokens = TOK.encode("one two one two")

    def run(min_tokens: int) -> tuple[str, str | None, int]:
        state = SequenceState(
            params=SamplingParams(max_tokens=20, stop=("one",), min_tokens=min_tokens),
            decoder=TOK.stream_decoder(), stop_ids=TOK.stop_ids, eos_id=TOK.eos_id, prompt_tokens=1,
            created=0.0, parser=OutputParser(TOK.dialect),
        )
        text = ""
        for token in tokens:
            text += state.feed(token).content
            if state.stop_reason is not None:
                break
        return text, state.stop_reason, state.new_tokens

    assert run(0) == ("", "StopString", 1)
    assert run(2) == ("one two ", "StopString", 3)  # the first "one" is text: it came before
