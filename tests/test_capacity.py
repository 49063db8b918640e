"""The capacity the defaults promise (decision 0019): a burst within running + waiting capacity
(--max-batch 16, --max-queue 512) is served whole, streamed or not."""

from __future__ import annotations

import json

import trio

from turbospark.model.scripted import ScriptedBackend

from ._support import chat_body, sse_events

PATH = "/v1/chat/completions"


async def test_a_burst_of_56_clients_is_served_whole_with_the_defaults(start_server, client) -> None:
    server = await start_server([ScriptedBackend(token_delay=0.002)])
    assert server.system.settings.max_queue == 512 and server.system.settings.max_batch == 16
    texts: list[str] = []

    async def streamed() -> None:
        r = await client.post(f"{server.url}{PATH}", json=chat_body(max_tokens=12, stream=True))
        assert r.status_code == 200, r.text
        frames = [json.loads(d) for _, d in sse_events(r.text) if d != "[DONE]"]
        texts.append("".join(f["choices"][0]["delta"].get("content") or "" for f in frames if f["choices"]))

    async def whole() -> None:
        r = await client.post(f"{server.url}{PATH}", json=chat_body(max_tokens=12))
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["message"]["content"])

    async with trio.open_nursery() as nursery:
        for i in range(56):
            nursery.start_soon(streamed if i < 24 else whole)
    assert len(texts) == 56 and len(set(texts)) == 1 and texts[0]
