"""Big bodies off the streams' path: a body surely over a limit is refused from its declared or
counted size before it is read, parsed or tokenised; a big one that is parsed is decoded in the
parser's child and validated in a worker thread, never on the event loop.  (How long a running
stream's gaps stretch is measured by ``benchmarks/bench_big_bodies.py``, not asserted here.)"""

from __future__ import annotations

import json
import threading
from urllib.parse import urlsplit

import pytest
import trio

from tests._support import chat_body
from turbospark.errors import ContextOverflow
from turbospark.messages import ChatPrompt
from turbospark.model.scripted import shipped_tokenizer
from turbospark.threads.prompt import render_prompt
from turbospark.web import bodies

PATH = "/v1/chat/completions"


async def _answer_of(url: str, path: str, length: int, sent: bytes) -> tuple[bytes, bool]:
    """Send a head declaring ``length`` bytes of body, then only ``sent``; what the server
    answers, and whether it then closed the connection (nothing more of the body is read)."""
    parts = urlsplit(url)
    stream = await trio.open_tcp_stream(parts.hostname, parts.port)
    head = (f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()
    await stream.send_all(head + sent)
    answer = b""
    with trio.fail_after(20):  # a guard against a hang, not a speed claim
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length_of(answer):
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            answer += chunk
        try:
            closed = await stream.receive_some(1) == b""
        except trio.BrokenResourceError:
            closed = True
    await stream.aclose()
    return answer, closed


def _length_of(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


@pytest.mark.parametrize(("path", "family_type"), [(PATH, "invalid_request_error"), ("/v1/messages", "request_too_large")])
async def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_read(
    start_server, path, family_type
) -> None:
    """A head that declares 1 GiB, followed by ten bytes of it: a 413 in the route family's
    error shape, from the declared length alone (the rest never comes), and the connection
    closed so the unread body is never taken for a request."""
    server = await start_server()
    answer, closed = await _answer_of(server.url, path, 1 << 30, b'{"model": ')
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    error = json.loads(body)
    assert error["error"]["type"] == family_type
    assert "larger than the 25 MiB limit" in error["error"]["message"]
    assert closed


async def test_a_big_chunked_body_is_counted_and_parsed_off_the_loop(start_server, client, monkeypatch) -> None:
    """A body with no Content-Length (chunked) is counted as it arrives: a big one is decoded
    in the parser's child and validated in a worker thread, as a declared one is; a small one
    is decoded on the loop.  Both are answered alike."""
    on_loop: list[int] = []
    threads: list[str] = []
    parse, structure = bodies.parse_json, bodies.structure

    def parse_spy(data: bytes) -> object:
        on_loop.append(len(data))
        return parse(data)

    def structure_spy(value: object, cls: type) -> object:
        threads.append(threading.current_thread().name)
        return structure(value, cls)

    monkeypatch.setattr(bodies, "parse_json", parse_spy)
    monkeypatch.setattr(bodies, "structure", structure_spy)
    server = await start_server()
    image = chat_body(max_tokens=2)
    image["messages"][0]["content"] = [  # a text model drops the image with a note, and answers
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * bodies.BIG_BODY}},
    ]
    big = json.dumps(image).encode()

    async def pieces(data: bytes):  # an async iterable: httpx sends it chunked
        for at in range(0, len(data), 1 << 16):
            yield data[at : at + (1 << 16)]

    r = await client.post(f"{server.url}{PATH}", content=pieces(big), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert on_loop == [] and threads and threads[-1] != threading.main_thread().name
    small = json.dumps(chat_body(max_tokens=2)).encode()
    r = await client.post(f"{server.url}{PATH}", content=pieces(small), headers={"content-type": "application/json"})
    assert r.status_code == 200 and on_loop == [len(small)] and threads[-1] == threading.main_thread().name


async def test_a_chunked_body_is_refused_once_it_passes_the_limit(start_server, client) -> None:
    """Without a Content-Length there is no declared size to refuse: the body is counted as it
    arrives, and a 413 in the family's shape answers it once it passes the limit (its pieces
    taken from Quart's buffer as they come, which Quart itself would not count)."""
    server = await start_server(max_body_bytes=2 * 1024 * 1024)
    body = json.dumps(chat_body("word " * (3 * 1024 * 1024 // 5))).encode()

    async def pieces():
        for at in range(0, len(body), 1 << 16):
            yield body[at : at + (1 << 16)]

    r = await client.post(f"{server.url}{PATH}", content=pieces(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["message"] == "the request body is larger than the 2 MiB limit"


class _NoRender:
    """A tokenizer whose chat template must not run (the prompt is refused from its length)."""

    def __init__(self, tok: object) -> None:
        self.tok = tok

    def render_chat(self, *args: object, **kwargs: object) -> str:
        raise AssertionError("rendered a prompt that was surely too long")

    def __getattr__(self, name: str) -> object:
        return getattr(self.tok, name)


def test_huge_tools_or_history_are_refused_from_their_length_without_rendering() -> None:
    """24 MiB of tools, or of an assistant's history, is refused as a context overflow counted
    from its characters, before the template copies it (which held the model thread, and every
    stream on it, 90-140 ms); an assistant's reasoning before ``</think>`` does not count (a
    template may drop it), so such a history is rendered and measured instead."""
    tok = shipped_tokenizer()
    words = "word " * (24 * 1024 * 1024 // 5 // 128)
    tools = tuple({"type": "function", "function": {"name": f"look_{i}", "description": words,
                                                    "parameters": {"type": "object", "properties": {}}}}
                  for i in range(128))
    history = tuple({"role": ("assistant", "user")[i % 2], "content": words * 60 if i % 2 == 0 else "Go on."}
                    for i in range(4))
    for prompt in (ChatPrompt(({"role": "user", "content": "Look it up."},), tools=tools),
                   ChatPrompt(({"role": "user", "content": "Go on."}, *history))):
        with pytest.raises(ContextOverflow) as caught:
            render_prompt(_NoRender(tok), prompt, 8192)  # type: ignore[arg-type]
        assert not caught.value.exact and caught.value.prompt_tokens > 8192
        assert caught.value.message.startswith("The prompt is at least ")
        assert "this model's context window is 8192 tokens" in caught.value.message
    thought = ({"role": "user", "content": "Go on."},
               {"role": "assistant", "content": "<think>" + words * 60 + "</think>Done."})
    with pytest.raises(AssertionError, match="rendered"):
        render_prompt(_NoRender(tok), ChatPrompt(thought), 8192)  # type: ignore[arg-type]
