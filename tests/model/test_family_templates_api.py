"""Each model family end to end: the scripted backend with the family's imported tokenizer and
real chat template writes what that family's model writes; the OpenAI chat API (streamed and
not), Anthropic's Messages API and Ollama's /api/chat hand back typed parts.

The conversation sent holds an earlier call and its result in each API's own shape, so the
history a client sends back reaches the template; thinking is switched off with each API's own
flag where the family's case says so (``reasoning_effort``, ``thinking``, ``think``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests._support import sse_events
from tests.model.family_templates import FAMILIES, TOOLS, Family, family_tokenizer
from turbospark.model.scripted import ScriptedBackend

BY_ID = {f.id: f for f in FAMILIES}
MARKUP = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<think>", "</think>", "<|tool_call|>", "```tool_code")

OPENAI_HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "reasoning_content": "Need the tool.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12C and cloudy"},
]


def _thinking_off(family: Family) -> bool:
    return family.flags.get("enable_thinking") is False


@pytest.fixture(params=sorted(BY_ID))
async def served(request: pytest.FixtureRequest, start_server: Any) -> tuple[Family, str]:
    family = BY_ID[request.param]
    backend = ScriptedBackend(tokenizer=family_tokenizer(family), script=family.output, model_id=family.id)
    server = await start_server([backend])
    return family, server.url


def _calls(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return [(name, json.loads(args) if isinstance(args, str) else args) for name, args in pairs]


def _check(family: Family, content: str, reasoning: str, calls: list[tuple[str, Any]]) -> None:
    assert content.strip() == family.content, (family.id, content)
    assert reasoning.strip() == family.reasoning, (family.id, reasoning)
    assert _calls(calls) == list(family.calls), family.id
    assert not any(m in content + reasoning for m in MARKUP), (family.id, content, reasoning)


def _openai_body(family: Family, **extra: Any) -> dict[str, Any]:
    body = {"model": family.id, "messages": OPENAI_HISTORY, "tools": TOOLS, "max_tokens": 200, **extra}
    if _thinking_off(family):
        body["reasoning_effort"] = "none"
    return body


async def test_openai_chat(served: tuple[Family, str], client: Any) -> None:
    family, url = served
    r = await client.post(f"{url}/v1/chat/completions", json=_openai_body(family))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    message = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ()]
    _check(family, message.get("content") or "", message.get("reasoning_content") or "", calls)
    assert choice["finish_reason"] == ("tool_calls" if family.calls else "stop")
    assert all(c["id"] and c["type"] == "function" for c in message.get("tool_calls") or ())


async def test_openai_chat_streamed(served: tuple[Family, str], client: Any) -> None:
    family, url = served
    r = await client.post(f"{url}/v1/chat/completions", json=_openai_body(family, stream=True))
    frames = sse_events(r.text)
    assert frames[-1] == (None, "[DONE]")
    chunks = [json.loads(d) for _, d in frames[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.get("tool_calls") or ():
            entry = calls.setdefault(c["index"], ["", ""])
            entry[0] += c.get("function", {}).get("name") or ""
            entry[1] += c.get("function", {}).get("arguments") or ""
    _check(family, content, reasoning, [(n, a) for n, a in (calls[i] for i in sorted(calls))])
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == ["tool_calls" if family.calls else "stop"]


async def test_anthropic_messages(served: tuple[Family, str], client: Any) -> None:
    family, url = served
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need the tool.", "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "12C and cloudy"}]},
    ]
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    body: dict[str, Any] = {"model": family.id, "system": "Be brief.", "messages": messages, "tools": tools,
                            "max_tokens": 200}
    if _thinking_off(family):
        body["thinking"] = {"type": "disabled"}
    r = await client.post(f"{url}/v1/messages", json=body)
    assert r.status_code == 200, r.text
    blocks = r.json()["content"]
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    thinking = "".join(b["thinking"] for b in blocks if b["type"] == "thinking")
    _check(family, text, thinking, [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"])
    assert r.json()["stop_reason"] == ("tool_use" if family.calls else "end_turn")


async def test_ollama_chat(served: tuple[Family, str], client: Any) -> None:
    family, url = served
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "thinking": "Need the tool.",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "12C and cloudy"},
    ]
    body: dict[str, Any] = {"model": family.id, "messages": messages, "tools": TOOLS, "stream": False}
    if _thinking_off(family):
        body["think"] = False
    r = await client.post(f"{url}/api/chat", json=body)
    assert r.status_code == 200, r.text
    message = r.json()["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ()]
    _check(family, message.get("content") or "", message.get("thinking") or "", calls)
